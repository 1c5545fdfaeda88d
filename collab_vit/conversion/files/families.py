"""The one table of timm's model families that convert (section 3.3), and what is refused in each.

Each row is a timm family as a user names it: a timm model, the keywords that build it small with random weights
(:data:`SMALL` plus the row's own: what the tests and ``benchmarks/vit_family.py`` build), the attention class timm
gives it, whether that attention is rotary, the variants of the family that convert as well (other designs timm
builds from the same attention: checked exactly, at full rank) and the ones that are refused (one line each, before
any work). The README's list, docs/post_hoc.md's "Which models convert" and the end-to-end tests of every command
(``tests/test_every_command.py``) read this table; a row added here runs through every command there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

MARKER = "families"  # docs/post_hoc.md's block that holds :func:`markdown`
# every row at this size: 32 px, patch 8 (16 patches), depth 2, width 64 in 4 heads of 16, 10 classes
SMALL: dict[str, Any] = dict(img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=4, num_classes=10)


@dataclass(frozen=True)
class Design:
    """One timm architecture: ``model`` built with :data:`SMALL` and ``kwargs`` (``kwargs`` None: timm's own size)."""

    label: str
    model: str
    kwargs: Optional[dict[str, Any]] = field(default_factory=dict)

    def small_kwargs(self) -> dict[str, Any]:
        return {} if self.kwargs is None else {**SMALL, **self.kwargs}

    def create(self, **extra: Any) -> Any:
        """The architecture at its small size with timm's random initialisation."""
        import timm

        return timm.create_model(self.model, **self.small_kwargs(), **extra)


@dataclass(frozen=True)
class Family:
    """A row: the family's representative design, its attention class, whether it is rotary, variants that convert
    and designs that are refused."""

    name: str
    design: Design
    attention: str  # timm's class of the representative's attention layers
    rotary: bool
    variants: tuple[Design, ...] = ()
    refused: tuple[Design, ...] = ()


QK_NORM = dict(qk_norm=True)

FAMILIES: tuple[Family, ...] = (
    Family("DeiT", Design("DeiT", "deit_tiny_patch16_224"), "Attention", False,
           variants=(Design("DeiT-III (layer scale, no class-token position)", "deit3_small_patch16_224"),)),
    Family("DeiT distilled", Design("DeiT distilled (distillation token)", "deit_tiny_distilled_patch16_224"),
           "Attention", False),
    Family("ViT", Design("ViT (augreg)", "vit_tiny_patch16_224"), "Attention", False,
           variants=(Design("ViT, no qkv bias", "vit_tiny_patch16_224", dict(qkv_bias=False)),
                     Design("CLIP image tower (pre-norm, eps 1e-5)", "vit_base_patch16_clip_224"),
                     Design("SigLIP image tower (attention-pool head)", "vit_base_patch16_siglip_224"),
                     Design("DINOv2 (layer scale)", "vit_small_patch14_dinov2"),
                     Design("DINOv2 with registers", "vit_small_patch14_reg4_dinov2"),
                     Design("parallel blocks (two attentions per block)", "vit_small_patch16_18x2_224")),
           refused=(Design("ViT with qk_norm", "vit_tiny_patch16_224", QK_NORM),)),
    Family("ViT, registers and average pool",
           Design("registers, average pool, no class token", "vit_medium_patch16_reg4_gap_256"), "Attention", False),
    Family("BEiT", Design("BEiT (relative position bias, layer scale)", "beit_base_patch16_224"), "Attention", False),
    Family("EVA", Design("EVA-01 (no rope, fused qkv with q/v biases)", "eva_giant_patch14_224", dict(qkv_bias=True)),
           "EvaAttention", False,
           variants=(Design("EVA, separate q/k/v projections, scale norm", "eva_giant_patch14_224",
                            dict(qkv_fused=False, scale_attn_inner=True)),),
           refused=(Design("EVA-01 with qk_norm", "eva_giant_patch14_224", QK_NORM),)),
    Family("EVA-02", Design("EVA-02 (fused qkv, q/v biases)", "eva02_tiny_patch14_224"), "EvaAttention", True,
           variants=(Design("EVA-02, separate q/k/v, scale norm", "eva02_tiny_patch14_224",
                            dict(qkv_fused=False, scale_attn_inner=True)),),
           refused=(Design("EVA-02 with qk_norm", "eva02_tiny_patch14_224", QK_NORM),)),
    Family("DINOv3", Design("DINOv3 (class token + 4 registers)", "vit_small_patch16_dinov3"), "EvaAttention", True),
    Family("DINOv3, qkv bias", Design("DINOv3 with qkv bias", "vit_small_patch16_dinov3_qkvb"), "EvaAttention", True),
    Family("PE core", Design("PE core (q/k/v biases, attention-pool head)", "vit_pe_core_tiny_patch16_384"),
           "AttentionRope", True),
    Family("RoPE-ViT", Design("RoPE-ViT axial", "vit_small_patch16_rope_224"), "AttentionRope", True,
           variants=(Design("rope, 1 register, average pool", "vit_base_patch16_rope_reg1_gap_256"),),
           refused=(Design("RoPE-ViT with mixed rope (frequencies learned per head)",
                           "vit_small_patch16_rope_mixed_224"),)),
    Family("RoPE-ViT, absolute position",
           Design("RoPE-ViT axial + absolute position", "vit_small_patch16_rope_ape_224"), "AttentionRope", True),
)

# refused outside every family: no self-attention at all
NO_ATTENTION = Design("ResNet-18 (no attention)", "resnet18", None)


def family_names() -> list[str]:
    """The rows' names, in the table's order (the README's and docs' list)."""
    return [family.name for family in FAMILIES]


def converting_designs(rotary: bool) -> list[Design]:
    """Every design that converts, representatives first then variants, of the rotary rows or of the others."""
    rows = [f for f in FAMILIES if f.rotary == rotary]
    return [f.design for f in rows] + [v for f in rows for v in f.variants]


def refused_designs() -> list[Design]:
    """Every refused design, the model with no attention last."""
    return [d for f in FAMILIES for d in f.refused] + [NO_ATTENTION]


def family_names_short() -> list[str]:
    """The families without their variants' qualifiers (DeiT, ViT, BEiT, ...): what ``--help`` lists."""
    return list(dict.fromkeys(name.split(",")[0].replace(" distilled", "") for name in family_names()))


def markdown() -> str:
    """The table as docs/post_hoc.md shows it ("Which models convert"; ``benchmarks/vit_family.py --doc`` writes it)."""
    def names(designs: tuple[Design, ...]) -> str:
        return "; ".join(f"{d.label} (`{d.model}`)" for d in designs) or "—"

    lines = ["| family | timm model (tested at the small size) | timm attention | rotary | variants that convert too "
             "| refused |", "|---|---|---|---|---|---|"]
    lines += [f"| {f.name} | `{f.design.model}` | `{f.attention}` | {'yes' if f.rotary else 'no'} | "
              f"{names(f.variants)} | {names(f.refused)} |" for f in FAMILIES]
    small = ", ".join(f"{k}={v}" for k, v in SMALL.items())
    return "\n".join(lines) + f"\n\nSmall size: {small}, random weights (`collab_vit.conversion.files.families.SMALL`)."
