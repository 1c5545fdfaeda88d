"""timm's ViT family converted to collaborative attention (section 3.3): the table of architectures tried in
docs/post_hoc.md.

Each architecture is created without pretrained weights at a small size (``SMALL``: 32 px, patch 8, depth 2, width
64, 4 heads, 10 classes; random biases and layer scales so that none hides an error), then converted

* at full rank (exact): the largest logit difference to a float64 run of the source, relative to the largest
  logit, beside its bound ``k u`` (``u = 2^-24``, ``k`` the model's chain of reduction lengths,
  ``tests/numerics.py``; the attention-pool head of SigLIP adds one attention and one MLP);
* at half rank (key dim = dim / 2, weight-only Tucker): top-1 agreement with the source on ``IMAGES`` random images
  and the largest logit difference relative to the largest logit;

and saved with ``collab_vit.save_pretrained`` and reloaded with ``timm.create_model("local-dir:...")`` (bit-identical
outputs, or the one-line refusal). Rotary models (``ROTARY``) are converted at full rank only (their compression is
not there yet), their bound adding ``ROPE_CHAIN`` per layer; they are also compared with the float32 source. Models
that cannot be converted are listed with the one-line reason ``collab_vit.reparametrize`` gives.

    python benchmarks/vit_family.py [--doc docs/post_hoc.md]      # prints the table; --doc rewrites its block

The figures are CPU-dependent in their last digits; ``tests/test_vit_family.py`` checks the table in docs/post_hoc.md
against the bounds and against what this command covers, and the full-rank exactness of every architecture afresh
(``tests/test_rotary.py`` the rotary ones).
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from numerics import U32, attention_chain, max_error, vit_chain  # noqa: E402

import collab_vit  # noqa: E402
from collab_vit.conversion.files import families  # noqa: E402
from collab_vit.conversion.weights.rotary import is_rotary  # noqa: E402
from collab_vit.conversion.weights.support import check_model  # noqa: E402
from measure import replace_marked_block  # noqa: E402

SMALL = families.SMALL
IMAGES = 64
MARKER = "vit-family"

# label -> (timm name, keywords over SMALL), from the package's one table (collab_vit/conversion/files/families.py)
CASES: dict[str, tuple[str, Optional[dict[str, Any]]]] = {
    d.label: (d.model, d.kwargs) for d in families.converting_designs(rotary=False)}
# rotary attention, exact at full rank (compressed: conversion/weights/rotary_fit.py)
ROTARY: dict[str, tuple[str, Optional[dict[str, Any]]]] = {
    d.label: (d.model, d.kwargs) for d in families.converting_designs(rotary=True)}
ROPE_CHAIN = 4  # per rotary layer: the rotation (a 2-term sum) and its sin / cos evaluated in float32 (~1 u each)
# label -> (timm name, keywords over SMALL): refused, with the reason check_model gives
REFUSED: dict[str, tuple[str, Optional[dict[str, Any]]]] = {
    d.label: (d.model, d.kwargs) for d in families.refused_designs()}


@dataclass
class Row:
    label: str
    model: str
    full_rank_error: float  # max |logit - float64 logit| / max |float64 logit|
    bound: int  # k of the bound k u
    top1_agreement: float  # half rank
    half_rank_error: float  # half rank: max |logit - source logit| / max |source logit|
    kept: str
    reload: str


def create(name: str, kwargs: Optional[dict[str, Any]], seed: int = 0) -> torch.nn.Module:
    """``name`` at ``SMALL`` size (``kwargs`` None: timm's own size), no pretrained weights; random biases and layer
    scales (normal, std 0.2; the classifier's bias left at 0 so that the logits are the features'), query/key/value
    weights of std 0.15 (attention logits of order one: timm's init, std 0.02, leaves the attention near uniform,
    where no key dim matters)."""
    torch.manual_seed(seed)
    model = timm.create_model(name, **SMALL, **kwargs) if kwargs is not None else timm.create_model(name)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(("bias", "gamma", "gamma_1", "gamma_2")) and not param_name.startswith("head"):
                param.normal_(0, 0.2)
            elif param_name.endswith(("qkv.weight", "q_proj.weight", "k_proj.weight", "relative_position_bias_table")):
                param.normal_(0, 0.15)
    return model.eval()


def chain(model: torch.nn.Module) -> int:
    """``k``: the reduction lengths from pixels to logits (``numerics.vit_chain``, plus an attention-pool head)."""
    dim, tokens = model.embed_dim, model.patch_embed.num_patches + model.num_prefix_tokens
    attn = model.blocks[0].attn if hasattr(model.blocks[0], "attn") else model.blocks[0].attns[0]
    mlp_ratio = model.blocks[0].mlp.fc1.out_features / dim if hasattr(model.blocks[0], "mlp") else 4.0
    parallel = len(getattr(model.blocks[0], "attns", [attn]))
    k = vit_chain(dim, len(model.blocks) * parallel, tokens, model.patch_embed.proj.in_channels *
                  model.patch_embed.proj.kernel_size[0] * model.patch_embed.proj.kernel_size[1], mlp_ratio=mlp_ratio)
    if not isinstance(getattr(attn, "norm", None) or torch.nn.Identity(), torch.nn.Identity):
        k += len(model.blocks) * dim  # the scale norm inside the attention
    if getattr(model, "attn_pool", None) is not None:
        k += attention_chain(dim, dim, tokens) + dim + int(mlp_ratio * dim)
    if is_rotary(attn, model):
        k += len(model.blocks) * ROPE_CHAIN
    return k


def images(n: int = IMAGES, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, SMALL["img_size"], SMALL["img_size"], generator=torch.Generator().manual_seed(seed))


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    return out[0] if isinstance(out, tuple) else out


def reload_check(model: torch.nn.Module) -> str:
    """``save_pretrained`` then ``local-dir:`` reload: "bit-identical", or the refusal."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            collab_vit.save_pretrained(model, f"{folder}/m")
        except ValueError as error:
            return f"refused: {str(error).split(': ', 1)[-1]}"
        again = timm.create_model(f"local-dir:{folder}/m", pretrained=True).eval()
        x = images(3, seed=2)
        return "bit-identical" if torch.equal(logits(again, x), logits(model, x)) else "OUTPUTS DIFFER"


@dataclass
class FullRank:
    got: torch.Tensor  # the converted model's float32 logits
    ref: torch.Tensor  # the source's float64 logits
    k: int
    converted: torch.nn.Module
    kept: dict[str, str]


def full_rank(label: str) -> FullRank:
    """The exact conversion of ``CASES[label]`` (or ``ROTARY[label]``) and its logits against a float64 run
    (``tests`` use this too)."""
    name, kwargs = CASES[label] if label in CASES else ROTARY[label]
    source = create(name, kwargs)
    converted = copy.deepcopy(source)
    _, report = collab_vit.reparametrize(converted, progress=False, return_report=True)
    x = images()
    return FullRank(logits(converted, x), logits(copy.deepcopy(source).double(), x.double()), chain(source),
                    converted, report.kept)


def measure(label: str) -> Row:
    name, kwargs = CASES[label]
    exact = full_rank(label)
    source = create(name, kwargs)
    half = copy.deepcopy(source)
    collab_vit.reparametrize(half, key_dim=source.embed_dim // 2, progress=False)
    x = images()
    base, approx = logits(source, x), logits(half, x)
    agreement = (base.argmax(-1) == approx.argmax(-1)).double().mean().item()
    kept = ", ".join(f"`{n}`" for n in exact.kept) or "—"
    return Row(label, name, max_error(exact.got, exact.ref), exact.k, agreement, max_error(approx, base), kept,
               reload_check(exact.converted))


@dataclass
class RotaryRow:
    label: str
    model: str
    layout: str  # the rope's pair layout
    prefix: int  # tokens left unrotated
    full_rank_error: float  # max |logit - float64 logit| / max |float64 logit|
    bound: int
    float32_error: float  # against the float32 source
    reload: str


def measure_rotary(label: str) -> RotaryRow:
    exact = full_rank(label)
    source = create(*ROTARY[label])
    x = images()
    attn = exact.converted.blocks[0].attn
    return RotaryRow(label, ROTARY[label][0], "half" if attn.rotate_half else "interleaved", attn.num_prefix_tokens,
                     max_error(exact.got, exact.ref), exact.k, max_error(exact.got, logits(source, x)),
                     reload_check(exact.converted))


def format_rotary(rows: list[RotaryRow]) -> str:
    lines = ["| rotary architecture | timm model | rope layout | unrotated prefix tokens | full rank: max abs logit "
             "diff / max abs logit (float64 ref) | bound k u | the same against the float32 source | `local-dir:` "
             "reload |", "|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.label} | `{r.model}` | {r.layout} | {r.prefix} | {r.full_rank_error:.1e} "
                     f"({r.full_rank_error / U32:.1f} u) | {r.bound * U32:.1e} (k = {r.bound}) | "
                     f"{r.float32_error:.1e} | {r.reload} |")
    return "\n".join(lines)


def refusal(label: str) -> str:
    name, kwargs = REFUSED[label]
    model = timm.create_model(name, device="meta", **SMALL, **kwargs) if kwargs is not None else \
        timm.create_model(name, device="meta")
    try:
        check_model(model)
    except ValueError as error:
        return str(error)
    return "CONVERTS"


def format_table(rows: list[Row], rotary: list[RotaryRow], refused: dict[str, str]) -> str:
    lines = [f"Created without pretrained weights at {', '.join(f'{k}={v}' for k, v in SMALL.items())} "
             f"(`python benchmarks/vit_family.py --doc docs/post_hoc.md`); logits on {IMAGES} random images.", "",
             "| architecture | timm model | full rank: max abs logit diff / max abs logit (float64 ref) | bound k u "
             "| half rank: top-1 agreement | half rank: max abs logit diff / max abs logit | kept as is "
             "| `local-dir:` reload |", "|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r.label} | `{r.model}` | {r.full_rank_error:.1e} ({r.full_rank_error / U32:.1f} u) | "
                     f"{r.bound * U32:.1e} (k = {r.bound}) | {r.top1_agreement:.0%} | {r.half_rank_error:.3f} | "
                     f"{r.kept} | {r.reload} |")
    lines += ["", "Rotary attention converts exactly at full rank (below it: per frequency, RESULTS.md \"Rotary "
              "models\"):", "", format_rotary(rotary)]
    lines += ["", "| refused | timm model | reason (one line, before any work) |", "|---|---|---|"]
    lines += [f"| {label} | `{REFUSED[label][0]}` | {why} |" for label, why in refused.items()]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", type=Path, help=f"rewrite the {MARKER} block of this Markdown file with the table "
                        f"(and its {families.MARKER} block with the package's table of families)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    table = format_table([measure(label) for label in CASES], [measure_rotary(label) for label in ROTARY],
                         {label: refusal(label) for label in REFUSED})
    print(table)
    if args.doc:
        replace_marked_block(args.doc, MARKER, table)
        replace_marked_block(args.doc, families.MARKER, families.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
