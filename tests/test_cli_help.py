"""Every flag of ``train.py``, ``eval.py`` and each ``collab-vit`` subcommand says what it does and shows its default."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from collab_vit import cli
from collab_vit.training import config, eval_cli

Default = Callable[[argparse.Action], Any]


def parsers() -> Iterator[tuple[str, argparse.ArgumentParser, Default]]:
    """(name, parser, the default an action stands for): train.py's flags leave theirs to the config's fields."""
    yield "train.py", config.build_parser(), lambda a: config._default(a.dest) if a.dest in config.FIELDS else None
    yield "eval.py", eval_cli.build_parser(), lambda a: a.default
    top = cli.build_parser()
    yield "collab-vit", top, lambda a: a.default
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"collab-vit {name}", sub, lambda a: a.default


def shown(default: Any, help_text: str) -> bool:
    """The help states the default: the word and, unless it is empty ('' or none: the help says what unset means),
    the value as argparse's ``%(default)s`` or a list of its items writes it."""
    if "default" not in help_text:
        return False
    if default in ("", [], (), {}):
        return True
    texts = {str(default)}
    if isinstance(default, (list, tuple)):
        texts |= {" ".join(map(str, default)), ", ".join(map(str, default))}
    return any(text in help_text for text in texts)


def problems(parser: argparse.ArgumentParser, default_of: Default) -> list[str]:
    """The options of ``parser`` without a help text, or whose non-None, non-boolean default the help does not show."""
    formatter = parser._get_formatter()
    visible = {a.dest for a in parser._actions if a.help != argparse.SUPPRESS}
    found = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        if action.help == argparse.SUPPRESS:  # a hidden spelling of a shown flag (train.py's --no-KEY)
            if action.dest not in visible:
                found.append(f"{name}: hidden, and no shown flag sets {action.dest}")
            continue
        if not action.help:
            found.append(f"{name}: no help")
            continue
        default = default_of(action)
        if default is not None and not isinstance(default, bool) and action.nargs != 0:
            text = formatter._expand_help(action)
            if not shown(default, text):
                found.append(f"{name}: default {default!r} not shown in {text!r}")
    return found


@pytest.mark.parametrize("name,parser,default_of", list(parsers()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_flag_has_help_and_shows_its_default(name: str, parser: argparse.ArgumentParser,
                                                   default_of: Default) -> None:
    assert problems(parser, default_of) == [], name


def test_the_check_catches_what_it_should() -> None:
    """A flag with no help, one whose default is not in its help, and one that shows it through ``%(default)s``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--bare", type=int, default=3)
    parser.add_argument("--unsaid", default=Path("x.png"), help="where the plot goes")
    parser.add_argument("--said", type=float, default=0.95, help="threshold (default: %(default)s)")
    parser.add_argument("--flag", action="store_true", help="a boolean shows no default")
    assert problems(parser, lambda a: a.default) == [
        "--bare: no help", "--unsaid: default PosixPath('x.png') not shown in 'where the plot goes'"]
