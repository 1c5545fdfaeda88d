"""CollaborativeAttention and ConcatAttention against timm's Attention and an independent float64 reference."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from timm.layers import Attention

from collab_vit import CollaborativeAttention, ConcatAttention, attention_class
from numerics import assert_within, attention_chain, float64_kwargs, max_error

DIM, HEADS, TOKENS = 48, 3, 11


def float64_call(layer: torch.nn.Module, x: torch.Tensor, **kwargs) -> torch.Tensor:
    """The same layer, weights and inputs in float64: the reference a float32 result is checked against."""
    return copy.deepcopy(layer).double()(x.double(), **float64_kwargs(kwargs))


def random_timm_attention(dim: int = DIM, heads: int = HEADS, qkv_bias: bool = True) -> Attention:
    torch.manual_seed(0)
    attn = Attention(dim, heads, qkv_bias=qkv_bias).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)  # biases too: a zero query bias would hide a wrong content bias
    return attn


def set_fused(layer: torch.nn.Module, fused: bool) -> torch.nn.Module:
    layer.fused_attn = fused
    return layer


def reference_collaborative(layer: CollaborativeAttention, x: torch.Tensor) -> torch.Tensor:
    """Eq. 5 written head by head in float64, independent of the layer's forward."""
    x = x.double()
    w = {n: p.detach().double() for n, p in layer.named_parameters()}
    q, k = x @ w["query.weight"].T, x @ w["key.weight"].T
    v = x @ w["value.weight"].T + w.get("value.bias", 0)
    outputs = []
    for i in range(layer.num_heads):
        logits = (q * w["mixing"][i]) @ k.transpose(-2, -1)
        if "content_bias.weight" in w:
            logits = logits + (x @ w["content_bias.weight"][i]).unsqueeze(-2)
        attn = (logits / layer.head_dim ** 0.5).softmax(-1)
        outputs.append(attn @ v[..., i * layer.head_dim:(i + 1) * layer.head_dim])
    return torch.cat(outputs, -1) @ w["proj.weight"].T + w["proj.bias"]


@pytest.mark.parametrize("qkv_bias", [True, False])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("extra_dims", [0, 5])
def test_from_attention_is_exact(qkv_bias: bool, fused: bool, extra_dims: int) -> None:
    attn = random_timm_attention(qkv_bias=qkv_bias)
    collab = set_fused(CollaborativeAttention.from_attention(attn, key_dim=DIM + extra_dims), fused)
    x = torch.randn(4, TOKENS, DIM)
    with torch.no_grad():
        assert_within(collab(x), float64_call(attn, x), attention_chain(DIM, DIM + extra_dims, TOKENS))
    assert (collab.content_bias is not None) == qkv_bias


@pytest.mark.parametrize("key_dim", [7, 12, 48, 50, 100])
@pytest.mark.parametrize("mixing_init", ["concatenate", "random"])
def test_any_key_dim_matches_reference(key_dim: int, mixing_init: str) -> None:
    torch.manual_seed(1)
    layer = CollaborativeAttention(DIM, HEADS, key_dim=key_dim, qkv_bias=True, mixing_init=mixing_init).eval()
    with torch.no_grad():
        layer.content_bias.weight.normal_(0, 0.3)
        layer.query.weight.normal_(0, 0.3)
    x = torch.randn(2, TOKENS, DIM)
    expected = reference_collaborative(layer, x)
    with torch.no_grad():
        for fused in (True, False):
            assert_within(set_fused(layer, fused)(x), expected, attention_chain(DIM, key_dim, TOKENS))


def test_concatenate_init_gives_each_head_its_block() -> None:
    layer = CollaborativeAttention(DIM, HEADS, key_dim=10)
    assert layer.mixing.tolist() == [[1.] * 3 + [0.] * 7, [0.] * 3 + [1.] * 4 + [0.] * 3, [0.] * 7 + [1.] * 3]
    full = CollaborativeAttention(DIM, HEADS)
    assert torch.equal(full.mixing, torch.eye(HEADS).repeat_interleave(DIM // HEADS, dim=1))


def test_random_init_matches_concatenate_logit_scale() -> None:
    torch.manual_seed(0)
    layer = CollaborativeAttention(768, 12, key_dim=192, mixing_init="random")
    expected_std = (64 / 192) ** 0.5
    assert abs(layer.mixing.std().item() - expected_std) < 0.05 * expected_std


def _masks(batch: int, tokens: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    keep = torch.rand(batch, 1, tokens, tokens) > 0.3
    keep[..., 0] = True  # every query row keeps at least one key
    return {
        "bool": keep,
        "bool_2d": keep[0, 0],
        "float": torch.randn(batch, HEADS, tokens, tokens),
    }


@pytest.mark.parametrize("mask_kind", ["bool", "bool_2d", "float", "causal"])
@pytest.mark.parametrize("fused", [True, False])
def test_attn_mask_honoured_like_timm(mask_kind: str, fused: bool) -> None:
    attn = set_fused(random_timm_attention(), fused)
    collab = set_fused(CollaborativeAttention.from_attention(attn), fused)
    x = torch.randn(2, TOKENS, DIM)
    kwargs = {"is_causal": True} if mask_kind == "causal" else {"attn_mask": _masks(2, TOKENS)[mask_kind]}
    with torch.no_grad():
        expected = float64_call(attn, x, **kwargs)
        assert_within(collab(x, **kwargs), expected, attention_chain(DIM, DIM, TOKENS))
        assert max_error(float64_call(attn, x), expected) > 1e-2, "the mask must change the output"


@pytest.mark.parametrize("fused", [True, False])
def test_concat_attention_at_full_key_dim_is_timm_attention(fused: bool) -> None:
    attn = random_timm_attention()
    concat = set_fused(ConcatAttention(DIM, HEADS, qkv_bias=True).eval(), fused)
    concat.load_state_dict(attn.state_dict())  # same [q | k | v] layout at key_dim == dim
    x = torch.randn(2, TOKENS, DIM)
    with torch.no_grad():
        assert_within(concat(x), float64_call(attn, x), attention_chain(DIM, DIM, TOKENS))
        assert_within(concat(x, is_causal=True), float64_call(attn, x, is_causal=True),
                      attention_chain(DIM, DIM, TOKENS))


def test_concat_attention_reduced_heads() -> None:
    torch.manual_seed(0)
    layer = ConcatAttention(DIM, HEADS, key_dim=12, qkv_bias=True).eval()
    x = torch.randn(2, TOKENS, DIM)
    ref = copy.deepcopy(layer).double()
    q, k, v = ref.qkv(x.double()).split([12, 12, DIM], -1)
    q, k, v = (t.reshape(2, TOKENS, HEADS, -1).transpose(1, 2) for t in (q, k, v))
    expected = ref.proj(F.scaled_dot_product_attention(q, k, v, scale=4 ** -0.5).transpose(1, 2).reshape(2, TOKENS, DIM))
    assert layer.qkv.out_features == 2 * 12 + DIM
    with torch.no_grad():
        for fused in (True, False):
            assert_within(set_fused(layer, fused)(x), expected, attention_chain(DIM, 12, TOKENS))


@pytest.mark.parametrize("bad", [0, -3, 1.5, "192", True, None])
def test_invalid_key_dim(bad: object) -> None:
    if bad is None:  # None means "default" for the layer, but not for attention_class
        with pytest.raises(ValueError, match="key_dim must be a positive integer"):
            attention_class(CollaborativeAttention, bad)
        return
    with pytest.raises(ValueError, match="key_dim must be a positive integer"):
        CollaborativeAttention(DIM, HEADS, key_dim=bad)
    with pytest.raises(ValueError, match="key_dim must be a positive integer"):
        ConcatAttention(DIM, HEADS, key_dim=bad)


def test_invalid_layer_arguments() -> None:
    with pytest.raises(ValueError, match="divisible by num_heads"):
        ConcatAttention(DIM, HEADS, key_dim=10)
    with pytest.raises(ValueError, match="mixing_init"):
        CollaborativeAttention(DIM, HEADS, mixing_init="orthogonal")
    with pytest.raises(ValueError, match="key_dim >= dim"):
        CollaborativeAttention.from_attention(random_timm_attention(), key_dim=DIM - 1)
    with pytest.raises(TypeError, match="timm Attention"):
        CollaborativeAttention.from_attention(torch.nn.Linear(3, 3))


def test_qk_norm_and_scale_norm_layers() -> None:
    layer = CollaborativeAttention(DIM, HEADS, key_dim=20, qk_norm=True, scale_norm=True,
                                   norm_layer=torch.nn.LayerNorm)
    assert layer.q_norm.normalized_shape == (20,) and layer.norm.normalized_shape == (DIM,)
    out = layer(torch.randn(2, TOKENS, DIM))
    assert out.shape == (2, TOKENS, DIM) and torch.isfinite(out).all()


def test_attention_class_is_cached_and_fixes_key_dim() -> None:
    cls = attention_class(CollaborativeAttention, 20, "random")
    assert cls is attention_class(CollaborativeAttention, 20, "random")
    assert issubclass(cls, CollaborativeAttention)
    layer = cls(DIM, num_heads=HEADS, qkv_bias=True)
    assert layer.key_dim == 20 and layer.mixing_init == "random"
