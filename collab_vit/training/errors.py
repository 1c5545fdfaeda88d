"""The two errors a user can cause: each message is one line meant for the user (the CLIs print it, exit 2)."""


class ConfigError(ValueError):
    """A config file, flag or option is invalid."""


class DataError(RuntimeError):
    """The data directory is missing, empty or unreadable; the message names the path."""
