"""Prose that cannot age: no timing, ratio, date or commit in the package's docstrings and comments (they live in
benchmarks/ and RESULTS.md); docs/testing.md's layout names every module of the package and no other; the docs
name the converter ``reparametrize``; experiments/ and benchmarks/ use only public names of the package that exist."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import re
import tokenize
import types
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "collab_vit"
AGING = {
    "timing": re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|s|sec|secs|seconds?|minutes?|min|hours?|h)\b"),
    "ratio": re.compile(r"\b\d+(?:\.\d+)?\s?x\b(?!\d)|\b\d+(?:\.\d+)?\s?%\s*(?:slower|faster|less|more|smaller|larger)"),
    "date": re.compile(r"\b(?:19|20)\d{2}-\d{2}\b|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? \d{4}\b"),
    "commit": re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
}
LAYOUT_MODULE = re.compile(r"\b(\w+)\.py(?= \(|[,;]|$)", re.M)  # "name.py (what it holds)", "name.py," or "name.py;"


def package_prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every docstring and comment of one source file."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                    str):
                yield first.lineno, first.value.value
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def aging(text: str) -> list[str]:
    """What in ``text`` would age: each match of a pattern of ``AGING``, with its kind."""
    return [f"{kind} {match.group()!r}" for kind, pattern in AGING.items() for match in pattern.finditer(text)]


def test_aging_patterns_catch_what_they_name() -> None:
    assert aging("about 100x slower") and aging("took 38 s where two took 256 s") and aging("12.5 ms per step")
    assert aging("10-15 % slower") and aging("commit c2a1b61") and aging("on 2026-12-01") and aging("December 2026")
    assert not aging("8x8 scans, (B, Nh, N, N), 90 / 95 / 99 % of the energy, D x D, arXiv 2006.16362, dims 64")


def test_no_timing_ratio_date_or_commit_in_package_prose() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}: {hit}" for path in sorted(PACKAGE.rglob("*.py"))
             for line, text in package_prose(path) for hit in aging(text)]
    assert not found, "measurements belong in benchmarks/ or RESULTS.md:\n" + "\n".join(found)


def layout_block() -> str:
    text = (ROOT / "docs" / "testing.md").read_text()
    block = re.search(r"^## Layout\n.*?^```\n(.*?)^```", text, re.S | re.M)
    assert block, "docs/testing.md lost its Layout block"
    return block.group(1)


def layout_modules(block: str) -> set[str]:
    """The package modules the layout names: entries start at column 0, their text runs on indented lines."""
    named = set()
    for entry in re.split(r"\n(?=\S)", block):
        where = entry.split()[0]
        if where.startswith("collab_vit/") and where.endswith(".py"):
            named.add(where)
        elif where.startswith("collab_vit/"):
            named |= {f"{where}{name}.py" for name in LAYOUT_MODULE.findall(entry[len(where):])}
    return named


def test_layout_names_every_module_and_no_other() -> None:
    tree = {str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*.py") if not path.name.startswith("_")}
    named = layout_modules(layout_block())
    assert not tree - named, f"docs/testing.md's layout does not name {sorted(tree - named)}"
    assert not named - tree, f"docs/testing.md's layout names modules that do not exist: {sorted(named - tree)}"


def test_layout_check_sees_a_missing_and_an_extra_module() -> None:
    block = layout_block()
    assert "collab_vit/conversion/weights/fit.py" in layout_modules(block)
    assert "collab_vit/conversion/weights/fit.py" not in layout_modules(block.replace("fit.py (", "fitting ("))
    assert "collab_vit/layers/gone.py" in layout_modules(block.replace("forms.py (BEiT's", "gone.py (BEiT's"))


def test_docs_name_the_converter_reparametrize() -> None:
    """``reparametrize_layers`` appears only where the text says it was deprecated or removed."""
    texts = [(str(page.relative_to(ROOT)), page.read_text()) for page in [ROOT / "README.md",
                                                                         *sorted((ROOT / "docs").glob("*.md"))]]
    texts += [(f"{path.relative_to(ROOT)}:{line}", text) for path in sorted(PACKAGE.rglob("*.py"))
              for line, text in package_prose(path)]
    wrong = [where for where, text in texts for match in re.finditer(r"reparametrize_layers", text)
             if not re.search("deprecat|removed", text[max(0, match.start() - 200):match.end() + 200].lower())]
    assert not wrong, f"these name the deprecated reparametrize_layers as the converter: {wrong}"


def outside_import_fallbacks(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node, except inside ``except ImportError:`` handlers (code for older revisions of the package)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            fallback = isinstance(child, ast.ExceptHandler) and isinstance(child.type, ast.Name) and \
                child.type.id in ("ImportError", "ModuleNotFoundError")
            if not fallback:
                stack.append(child)


def package_names_used(path: Path) -> Iterator[tuple[int, types.ModuleType, str]]:
    """(line, module, name) for each name of a ``collab_vit`` module that a script imports or reads."""
    nodes = list(outside_import_fallbacks(ast.parse(path.read_text())))
    aliases: dict[str, types.ModuleType] = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "collab_vit":
                    aliases[alias.asname or "collab_vit"] = importlib.import_module(
                        alias.name if alias.asname else "collab_vit")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "collab_vit":
            module = importlib.import_module(node.module)
            for alias in node.names:
                yield node.lineno, module, alias.name
                value = getattr(module, alias.name, None)
                if isinstance(value, types.ModuleType):
                    aliases[alias.asname or alias.name] = value
    for node in nodes:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            yield node.lineno, aliases[node.value.id], node.attr


def exists(module: types.ModuleType, name: str) -> bool:
    """Whether ``module.name`` is there: an attribute, or a submodule of a package not imported yet."""
    return hasattr(module, name) or (hasattr(module, "__path__") and
                                     importlib.util.find_spec(f"{module.__name__}.{name}") is not None)


# the references the package's Tucker route is checked against (CP-ALS on the full tensor, the paper's parafac):
# CP-ALS shares Tucker's ALS sweeps and starts, so it reads the decomposition's private parts
REFERENCES = {"benchmarks/reference_decompose.py"}


def test_experiments_and_benchmarks_use_public_names_that_exist() -> None:
    wrong = []
    for path in sorted([*(ROOT / "experiments").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        for line, module, name in package_names_used(path):
            where = f"{path.relative_to(ROOT)}:{line}: {module.__name__}.{name}"
            if name.startswith("_") and not name.startswith("__") and str(path.relative_to(ROOT)) not in REFERENCES:
                wrong.append(f"{where} is private")
            elif not exists(module, name):
                wrong.append(f"{where} does not exist")
    assert not wrong, "\n".join(wrong)
