"""``collab-vit`` command line: ``models``, ``demo``, ``convert`` (section 3.3) and ``analyze`` (section 3.1)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from pathlib import Path

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


def _convert(args: argparse.Namespace) -> None:
    from .convert import convert_to_file, format_report, parse_key_dim

    reports = convert_to_file(args.model, parse_key_dim(args.key_dim), args.method, args.out, args.checkpoint,
                              seed=args.seed, max_iter=args.max_iter, tol=args.tol)
    print(format_report(reports))
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


def _analyze(args: argparse.Namespace) -> None:
    from .convert import analyze_to_files

    table, suggestion = analyze_to_files(args.model, args.checkpoint, args.plot, args.threshold)
    print(table)
    print(f"plot: {args.plot}\nsuggested key_dim ({args.threshold:.0%} of the energy in every layer): {suggestion}")


def _prepare_data(args: argparse.Namespace) -> None:
    from .fashion_mnist import prepare_fashion_mnist

    print(f"Fashion-MNIST ready in {prepare_fashion_mnist(args.root, args.source)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="collab-vit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("models", help="print the table of registered models").set_defaults(run=_models)
    demo = commands.add_parser("demo", help="model table + exact full-rank conversion of timm DeiTs")
    demo.add_argument("--models", nargs="+", default=["deit_tiny_patch16_224", "deit_small_patch16_224",
                                                      "deit_base_patch16_224"])
    demo.set_defaults(run=_demo)

    convert = commands.add_parser("convert", help="re-parametrise a pretrained DeiT into a collaborative model")
    convert.add_argument("--model", required=True, help="timm DeiT name, e.g. deit_base_patch16_224")
    convert.add_argument("--checkpoint", help="weights file (.pth/.safetensors); default: timm's pretrained")
    convert.add_argument("--key-dim", required=True, help="int, energy threshold (0.95) or comma list per layer")
    convert.add_argument("--method", choices=["tucker", "cp"], default="tucker")
    convert.add_argument("--out", type=Path, required=True, help="output .safetensors (+ .json sidecar)")
    convert.add_argument("--seed", type=int, default=0)
    convert.add_argument("--max-iter", type=int, default=100)
    convert.add_argument("--tol", type=float, default=1e-6)
    convert.set_defaults(run=_convert)

    analyze = commands.add_parser("analyze", help="per-layer key/query redundancy spectrum and its plot")
    analyze.add_argument("--model", required=True, help="timm model name (its architecture)")
    analyze.add_argument("--checkpoint", help="weights file (.pth/.safetensors); default: timm's pretrained")
    analyze.add_argument("--plot", type=Path, default=Path("spectrum.png"))
    analyze.add_argument("--threshold", type=float, default=0.95)
    analyze.set_defaults(run=_analyze)

    prepare = commands.add_parser("prepare-data", help="put an offline copy of a dataset where timm's reader finds it")
    prepare.add_argument("dataset", choices=["fashion_mnist"])
    prepare.add_argument("--root", default="data", help="data_dir of the configs (default: data)")
    prepare.add_argument("--source", help="folder with the four IDX files (default: Debian's dataset-fashion-mnist)")
    prepare.set_defaults(run=_prepare_data)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        parser.exit(2, f"collab-vit {args.command}: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
