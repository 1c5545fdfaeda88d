"""``collab-vit`` command line: ``models``, ``demo``, ``convert`` (section 3.3) and ``analyze`` (section 3.1)."""
from __future__ import annotations

import argparse
import copy
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import timm
import torch

from .checks import fraction, integer, positive_int
from .console import BAD_INPUT, fail, run_command
from .conversion.files.families import family_names_short
from .conversion.calibration.capture import Pixels
from .conversion.calibration.recipe import DEFAULT_IMAGES, EFFORTS, IMAGES, PASSES, check_effort
from .conversion.reparam import reparametrize
from .models import COLLAB_MODELS, CONCAT_MODELS, DEIT_MODELS, layer_key_dim, query_key_params
from .models_rope import ROPE_MODELS, ROPE_SIZES, ROPE_VARIANTS
from .weights_io import WriteError


@dataclass
class ModelRow:
    name: str
    key_dim: int
    params: int
    qk_params: int


def model_row(name: str) -> ModelRow:
    """Count parameters on the meta device (no memory, no init cost)."""
    model = timm.create_model(name, device="meta")
    layers = [block.attn for block in model.blocks]
    return ModelRow(name, layer_key_dim(layers[0]), sum(p.numel() for p in model.parameters()),
                    sum(map(query_key_params, layers)))


def model_table() -> list[ModelRow]:
    """timm's DeiT baselines, every registered collaborative and concatenate DeiT, timm's RoPE-ViT baselines, then
    the collaborative rotary ViTs."""
    rope = [f"vit_{size}_patch16_{variant}_224" for size in ROPE_SIZES for variant in ROPE_VARIANTS]
    names = DEIT_MODELS + COLLAB_MODELS + CONCAT_MODELS + rope + ROPE_MODELS
    return [model_row(name) for name in names]


def format_table(rows: list[ModelRow]) -> str:
    lines = ["| model | key dim | params (M) | attention q/k params (M) |", "|---|---:|---:|---:|"]
    lines += [f"| `{r.name}` | {r.key_dim} | {r.params / 1e6:.2f} | {r.qk_params / 1e6:.2f} |" for r in rows]
    return "\n".join(lines)


@dataclass
class ConversionCheck:
    name: str
    max_abs_diff: float
    max_abs_logit: float
    seconds: float


def check_full_rank_conversion(name: str, batch: int = 2, seed: int = 0) -> ConversionCheck:
    """Convert a randomly initialised timm model at full rank and compare logits (exact at full rank: docs/math.md)."""
    torch.manual_seed(seed)
    reference = timm.create_model(name).eval()
    with torch.no_grad():
        for param_name, param in reference.named_parameters():
            if param_name.endswith("qkv.bias"):
                param.normal_(0, 0.2)  # non-zero query biases exercise the content bias
    start = time.perf_counter()
    converted = reparametrize(copy.deepcopy(reference))
    seconds = time.perf_counter() - start
    x = torch.randn(batch, *reference.default_cfg["input_size"])
    with torch.no_grad():
        expected, actual = reference(x), converted(x)
    return ConversionCheck(name, (expected - actual).abs().max().item(), expected.abs().max().item(), seconds)


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


def calibration_loader(dataset: str, data_dir: str, split: str, images: int, model: torch.nn.Module,
                       data_config: Optional[dict[str, Any]] = None, seed: int = 0,
                       batch_size: int = 64) -> torch.utils.data.DataLoader:
    """``images`` (a positive int: the flag's value, checked as it is read) images drawn at random (seeded) from a
    split (all of them, said in one line, where it holds fewer), in the model's evaluation transform, whatever their
    stored size.

    The split is read as ``eval.py`` reads it (``training.data.build_dataset``: ``dataset`` '' = ImageFolder,
    ``torch/fashion_mnist``, ...); the transform is the evaluation one of ``data_config`` (a file's recorded data
    config) or else of the model's pretrained cfg.
    """
    return _calibration_set(dataset, data_dir, split, images, model, data_config, seed, batch_size)[0]


def calibration_pixels(dataset: str, data_dir: str, split: str, images: int, model: torch.nn.Module,
                       data_config: Optional[dict[str, Any]] = None, seed: int = 0, batch_size: int = 64) -> Pixels:
    """:func:`calibration_loader`'s images as their uint8 pixels (``capture.Pixels``: the transform up to
    ``ToTensor``, and its ``Normalize``), a quarter of the bytes while a conversion holds them."""
    loader, cfg = _calibration_set(dataset, data_dir, split, images, model, data_config, seed, batch_size, True)
    return Pixels(loader, tuple(cfg["mean"]), tuple(cfg["std"]))


def _calibration_set(dataset: str, data_dir: str, split: str, images: int, model: torch.nn.Module,
                     data_config: Optional[dict[str, Any]], seed: int, batch_size: int, pixels: bool = False
                     ) -> tuple[torch.utils.data.DataLoader, dict[str, Any]]:
    """The seeded draw of :func:`calibration_loader` and its data config (``pixels``: uint8, the transform up to
    ``ToTensor``)."""
    from timm.data import create_transform, resolve_data_config

    from .training.data import build_dataset, in_channels
    from .weights_io import model_pipeline

    cfg = resolve_data_config(dict(data_config or model_pipeline(model)), model=model)
    data = build_dataset(dataset, data_dir, split, is_training=False)
    if len(data) < images:
        print(f"note: --calibration-images {images} asked, {data_dir} holds {len(data)}: using {len(data)}",
              flush=True)
    # an unreadable image stops the conversion, named: skipping it would change the seeded draw the file records
    data.bad_image_hint = "remove or replace it: convert does not skip images, so --seed draws the recorded set"
    data.transform = create_transform(cfg["input_size"], is_training=False, interpolation=cfg["interpolation"],
                                      mean=cfg["mean"], std=cfg["std"], crop_pct=cfg["crop_pct"],
                                      crop_mode=cfg.get("crop_mode", "center"), use_prefetcher=pixels)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:images].tolist()
    return in_channels(torch.utils.data.DataLoader(torch.utils.data.Subset(data, order), batch_size=batch_size),
                       cfg["input_size"][0]), cfg


def add_calibration_flags(parser: argparse.ArgumentParser, purpose: str) -> argparse._ArgumentGroup:
    """The calibration-image flags (spelled as eval.py's data flags), in a group of their own."""
    data = parser.add_argument_group(f"{purpose} (calibration images; flags as eval.py's data flags)")
    data.add_argument("--calibration-data-dir", default="",
                      help="dataset root; images come from its training split (an image folder without a train/ "
                           "subfolder is used as it is; default: none, weights only)")
    data.add_argument("--calibration-dataset", default="",
                      help="timm dataset name: torch/fashion_mnist, ... (default: '', ImageFolder)")
    data.add_argument("--calibration-images", type=flag_type(positive_int, "--calibration-images"), default=None,
                      help="images drawn at random (--seed) from it (default: " + ", ".join(
                          f"{n} at --effort {e}" for e, n in IMAGES.items()) + ")")
    return data


def _calibration(args: argparse.Namespace) -> Optional[Callable[[torch.nn.Module, dict], Any]]:
    """What ``convert_to_file`` calls with the source model and its metadata to get the calibration images."""
    if not args.calibration_data_dir:
        if args.calibration_dataset:
            raise ValueError("--calibration-dataset needs --calibration-data-dir")
        return None
    images = args.calibration_images
    if images is None:  # the effort's own (convert; analyze reads the default's)
        images = IMAGES.get(getattr(args, "effort", "default"), IMAGES["default"])
    images = positive_int(images, "--calibration-images")  # before any model is read
    return lambda model, meta: calibration_pixels(args.calibration_dataset, args.calibration_data_dir, "train",
                                                  images, model, meta.get("data_config"), args.seed)


def _convert(args: argparse.Namespace) -> None:
    from .conversion.files.commands import convert_to_file, format_report, format_summary, output_kind, parse_key_dim
    from .conversion.calibration.state import beside
    from .conversion.weights.support import kept_text
    from .hub import save_pretrained
    from .training.config import parse_key_value_pairs

    key_dim = parse_key_dim(args.key_dim)
    effort = check_effort(args.effort)
    model_kwargs = parse_key_value_pairs(args.model_kwargs, "--model-kwargs")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA device is available")
    output_kind(args.out)  # its folder exists and takes files, before any model is built or image read
    calibration = _calibration(args)
    with beside(args.out):  # a stopped conversion resumes from <out>.partial, removed once --out is written
        reports = convert_to_file(args.model, key_dim, args.out, args.checkpoint, seed=args.seed,
                                  model_kwargs=model_kwargs, calibration=calibration, device=args.device,
                                  save_folder=save_pretrained, effort=effort)
    print(format_report(reports))
    if reports.summary:
        print(format_summary(reports.summary))
    if reports.kept:
        print("kept as they are:\n" + kept_text(reports.kept))
    sidecar = args.out.with_suffix(".json") if args.out.suffix == ".safetensors" else args.out / "conversion.json"
    print(f"wrote {args.out} and {sidecar}")


def _analyze(args: argparse.Namespace) -> None:
    from .conversion.files.commands import analyze_to_files

    from .training.config import parse_key_value_pairs

    model_kwargs = parse_key_value_pairs(args.model_kwargs, "--model-kwargs")
    table, suggestion = analyze_to_files(args.model, args.checkpoint, args.out, args.threshold,
                                         calibration=_calibration(args), model_kwargs=model_kwargs, seed=args.seed)
    print(table)
    print(f"wrote {args.out / 'spectrum.md'} and {args.out / 'spectrum.png'}\n"
          f"suggested key_dim ({args.threshold:.0%} of the energy in every layer): {suggestion}")


def _prepare_data(args: argparse.Namespace) -> None:
    from .training.datasets import prepare_fashion_mnist

    print(f"Fashion-MNIST ready in {prepare_fashion_mnist(args.root, args.source)}")


FAMILY_LIST = ", ".join(family_names_short())
REFUSED_TEXT = ("Models that cannot convert (qk_norm, mixed rope, no self-attention, already collaborative) are "
                "refused with one line before anything is downloaded or written.")


def add_source_flags(parser: argparse.ArgumentParser) -> None:
    """--model, --checkpoint, --model-kwargs: the source model, as convert and analyze read it."""
    parser.add_argument("--model", help="timm model name, e.g. deit_base_patch16_224 (default: read from the "
                        "checkpoint)")
    parser.add_argument("--checkpoint", help="weights file (.pth/.safetensors) for --model, or none: its random "
                        "initialisation (seeded by --seed); default: timm's pretrained weights")
    parser.add_argument("--model-kwargs", nargs="*", default=[], metavar="KEY=VALUE",
                        help="the source's architecture where it is not the name's, e.g. img_size=384 num_classes=10 "
                        "(default: none, the name's or the checkpoint's)")


OUT_PARENT = ("its folder must exist and be writable (checked before any work; a missing folder is refused, not "
              "created, so a mistyped path does not go unnoticed)")


class Parser(argparse.ArgumentParser):
    """argparse with its errors as every other bad input: one line on stderr (``collab-vit convert: error: ...``, no
    usage block), exit 2. A flag's value checked by ``flag_type`` reads as the package's checks word it."""

    def error(self, message: str) -> None:
        message = re.sub(r"^argument (\S+): (?=\1 )", "", message)  # "argument --seed: --seed must ..." once
        sys.exit(fail(BAD_INPUT, f"{self.prog}: error: {message}"))


def flag_type(check: Callable[[object, str], Any], name: str, parse: Callable[[str], Any] = int
              ) -> Callable[[str], Any]:
    """An argparse ``type=``: the text read by ``parse`` (``int``, ``float``), then ``check(value, name)`` (a
    ``checks`` function); either's failure is the check's one line (``--seed must be an integer, got 'x'``)."""
    def read(text: str) -> Any:
        try:
            value: object = parse(text)
        except ValueError:
            value = text
        try:
            return check(value, name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return read


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="collab-vit", description="Collaborative attention for timm ViTs: model table, "
                                     "exact-conversion demo, post-hoc conversion (convert), redundancy spectrum "
                                     "(analyze), offline data sets (prepare-data).")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("models", help="print the table of registered models").set_defaults(run=_models)
    demo = commands.add_parser("demo", help="model table + exact full-rank conversion of timm DeiTs")
    demo.add_argument("--models", nargs="+", default=DEIT_MODELS, metavar="NAME",
                      help=f"timm models to convert at full rank (default: {' '.join(DEIT_MODELS)})")
    demo.set_defaults(run=_demo)

    convert = commands.add_parser(
        "convert", help=f"re-parametrise a timm ViT ({FAMILY_LIST}, ...) into collaborative attention",
        description=f"Convert a timm ViT ({FAMILY_LIST}, ...) into collaborative attention (rotary ones per "
        "frequency, an even key dim). Recommended: --key-dim K with calibration images "
        "(--calibration-data-dir ...): candidates are measured on held-out images and the result is never worse "
        f"there than the weight-only conversion. {REFUSED_TEXT}")
    add_source_flags(convert)
    convert.add_argument("--key-dim", required=True, help="int (every layer) or comma list (one per layer); "
                         "collab-vit analyze suggests one")
    convert.add_argument("--out", type=Path, required=True,
                         help="X.safetensors (+ X.json report), or a folder: timm's hub layout + conversion.json; "
                         f"{OUT_PARENT}")
    convert.add_argument("--seed", type=flag_type(integer, "--seed"), default=0,
                         help="seed of the decompositions, refinement and calibration draw (default: %(default)s)")
    convert.add_argument("--device", default=None, help="forward passes and refinement, every tensor of a layer's "
                         "refinement on it: cpu, cuda, cuda:1 (default: cuda where one is available, as train.py)")
    data = add_calibration_flags(convert, "the recommended recipe")
    data.add_argument("--effort", default="default", metavar="{" + ",".join(EFFORTS) + "}",
                      help=f"fast: closed forms only; default: the better one refined layer by layer "
                      f"({PASSES['default']} passes over {DEFAULT_IMAGES} images: sized for DeiT-B on a CPU); full: "
                      f"{PASSES['full']} passes over {IMAGES['full']} images (about 4 times the default's compute: the "
                      "default before, for a GPU or the time)")
    convert.set_defaults(run=_convert)

    analyze = commands.add_parser("analyze", help="per-layer key/query redundancy spectrum and its plot",
                                  description=f"The redundancy spectrum of every attention layer (section 3.1; "
                                  f"rotary layers per frequency, in shared pairs) and a suggested key dim, "
                                  f"for the models convert takes ({FAMILY_LIST}, ...). {REFUSED_TEXT}")
    add_source_flags(analyze)
    analyze.add_argument("--out", type=Path, required=True,
                         help="folder for spectrum.md (table, suggestions) and spectrum.png (one curve per layer); "
                         f"{OUT_PARENT}")
    analyze.add_argument("--threshold", type=flag_type(fraction, "--threshold", float), default=0.95,
                         help="energy fraction every layer keeps in the suggested key dim (default: %(default)s)")
    analyze.add_argument("--seed", type=flag_type(integer, "--seed"), default=0,
                         help="seed of the calibration images' draw and of --checkpoint "
                         "none's weights (default: %(default)s)")
    add_calibration_flags(analyze, "spectrum of the logits on real tokens: whitened by their moments")
    analyze.set_defaults(run=_analyze)

    prepare = commands.add_parser("prepare-data", help="put an offline copy of a dataset where timm's reader finds it")
    prepare.add_argument("dataset", choices=["fashion_mnist"], help="the dataset (fashion_mnist)")
    prepare.add_argument("--root", default="data", help="data_dir of the configs (default: data)")
    prepare.add_argument("--source", help="folder with the four IDX files (default: Debian's dataset-fashion-mnist)")
    prepare.set_defaults(run=_prepare_data)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry (``console.run_command``): bad input (any ValueError, OSError or RuntimeError) is one line,
    exit 2; a failed write (a full disk) or too little memory one line, exit 1; SIGINT / SIGTERM one line, exit 130 /
    143. A failure
    leaves as ``SystemExit`` (as argparse's own errors do)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    code = run_command(lambda: args.run(args), (ValueError, OSError, RuntimeError),
                       (WriteError, MemoryError), name=f"collab-vit {args.command}")
    if code:
        sys.exit(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
