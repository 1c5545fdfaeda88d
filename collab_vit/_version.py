"""The package version (also in pyproject.toml; tests/test_layout.py checks they agree)."""
__version__ = "0.2.0"
