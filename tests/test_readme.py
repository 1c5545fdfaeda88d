"""The README stays true: its model table is the one the code computes."""
from __future__ import annotations

import re
from pathlib import Path

from collab_vit.cli import format_table, model_table

README = Path(__file__).parents[1] / "README.md"


def test_readme_model_table_matches_code() -> None:
    text = README.read_text()
    block = re.search(r"<!-- model-table:start -->\n(.*?)\n<!-- model-table:end -->", text, re.S)
    assert block, "README lost its model-table markers"
    assert block.group(1) == format_table(model_table()), "README table is stale: run `collab-vit models`"
