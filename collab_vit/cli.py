"""``collab-vit`` command line: ``models`` (parameter table) and ``demo`` (full-rank conversion check)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .summary import check_full_rank_conversion, format_table, model_table


def _models(args: argparse.Namespace) -> None:
    print(format_table(model_table()))


def _demo(args: argparse.Namespace) -> None:
    print("Registered models (parameters counted by code):\n")
    print(format_table(model_table()))
    print("\nFull-rank conversion of timm's DeiTs (random init) into collaborative attention:\n")
    print("| timm model | max abs logit diff | max abs logit | convert (s) |\n|---|---:|---:|---:|")
    for name in args.models:
        check = check_full_rank_conversion(name)
        print(f"| `{check.name}` | {check.max_abs_diff:.2e} | {check.max_abs_logit:.2f} | {check.seconds:.2f} |")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="collab-vit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("models", help="print the table of registered models").set_defaults(run=_models)
    demo = commands.add_parser("demo", help="model table + exact full-rank conversion of timm DeiTs")
    demo.add_argument("--models", nargs="+", default=["deit_tiny_patch16_224", "deit_small_patch16_224",
                                                      "deit_base_patch16_224"])
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
