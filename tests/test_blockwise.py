"""The blockwise refinement (``conversion/calibration/blockwise.py``): each converted layer trained alone on its source
layer's output, from tokens cached in one pass of the source."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import timm
import torch

from collab_vit.conversion.calibration.blockwise import (bf16_parts, converted_calls, layer_inputs, mean_loss,
                                                         refine_blocks, source_outputs, tokens_at)
from collab_vit.conversion.files.families import FAMILIES
from collab_vit.conversion.weights.fit import fit_attention
from collab_vit.conversion.reparam import timm_attention_layers
from collab_vit.conversion.weights.rotary_fit import fit_rotary
from resident import REPORT, WATCH

SMALL = dict(img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=4, num_classes=10)


def small(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(name, **SMALL).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))  # logits that depend on the attention (timm's init is near uniform)
    return model


def test_cached_calls_replay_every_layer_of_the_source() -> None:
    """The cached tokens and arguments reproduce each layer's output in the model, rope included."""
    for name in ("deit_tiny_patch16_224", "vit_small_patch16_rope_224"):
        model = small(name)
        images = torch.randn(6, 3, 32, 32)
        layers = [attn for _, attn in timm_attention_layers(model)] if "rope" not in name else \
            [block.attn for block in model.blocks]
        outputs = []
        handles = [a.register_forward_hook(lambda m, i, o: outputs.append(o)) for a in layers]
        with torch.no_grad():
            model(images)
        for h in handles:
            h.remove()
        calls = layer_inputs(model, layers, images, 4, 1)  # two batches: the tokens concatenated in order
        for layer, call, out in zip(layers, calls, outputs):
            assert call[0].shape == (6, 17, 64)
            assert torch.equal(source_outputs(layer, call, 4, torch.device("cpu")), out)


def test_refinement_lowers_each_layer_loss_and_trains_only_the_mixing_and_projections() -> None:
    for name, fit in (("deit_tiny_patch16_224", lambda a: fit_attention(a, 8)),
                      ("vit_small_patch16_rope_224", lambda a: fit_rotary(a, 8))):
        model = small(name)
        sources = [block.attn for block in model.blocks]
        calls = layer_inputs(model, sources, torch.randn(32, 3, 32, 32), 16, 2)
        layers = [fit(a).layer for a in sources]
        frozen = [copy.deepcopy(layer.value.state_dict()) for layer in layers]
        untouched = copy.deepcopy(model.state_dict())
        before = [mean_loss(layer, call, source_outputs(s, call, 16, torch.device("cpu")), 16, torch.device("cpu"))
                  for s, layer, call in zip(sources, layers, calls)]
        result = refine_blocks(sources, layers, calls, 30, 1e-2, 8, 0, False)
        after = [mean_loss(layer, call, source_outputs(s, call, 16, torch.device("cpu")), 16, torch.device("cpu"))
                 for s, layer, call in zip(sources, layers, calls)]
        # the same sums; the layer's attention route may differ while it trains (float32 rounding, ~1e-8)
        assert result.kl_before == pytest.approx(sum(before), rel=1e-6)
        assert result.kl_after == pytest.approx(sum(after), rel=1e-6)
        assert all(a < b for a, b in zip(after, before)) and not result.kept_start
        assert all(torch.equal(f["weight"], layer.value.state_dict()["weight"]) for f, layer in zip(frozen, layers))
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in untouched.items())  # the source is unchanged
        assert all(p.requires_grad for s in sources for p in s.parameters())  # and its flags are put back


def test_a_layer_whose_loss_rises_keeps_its_start() -> None:
    """At full rank the fit is exact (loss ~0); steps at a huge rate move it away, so the start is restored."""
    model = small("deit_tiny_patch16_224")
    sources = [block.attn for block in model.blocks]
    calls = layer_inputs(model, sources, torch.randn(16, 3, 32, 32), 16, 2)
    layers = [fit_attention(a, 64).layer for a in sources]
    start = [copy.deepcopy(layer.state_dict()) for layer in layers]
    result = refine_blocks(sources, layers, calls, 3, 1.0, 8, 0, False)
    assert result.kept_start and result.kl_after == result.kl_before < 1e-10
    assert all(torch.equal(layer.state_dict()[k], s[k]) for layer, s in zip(layers, start) for k in s)


def test_bf16_parts_run_the_sensitivity_pass_and_the_steps_in_bfloat16_and_judge_at_full_precision() -> None:
    """Under ``bf16_parts``: the sensitivity pass's layers and every step's layer output in bfloat16, the stored
    sensitivities and the mean losses that decide whether a layer keeps its start in float32; the steps still lower
    each layer's loss. Outside it, nothing in bfloat16."""
    model = small("deit_tiny_patch16_224")
    sources = [block.attn for block in model.blocks]
    images = torch.randn(16, 3, 32, 32)
    seen: list[torch.dtype] = []
    handles = [a.register_forward_hook(lambda m, i, out: seen.append(out.dtype)) for a in sources]
    with bf16_parts(True):
        calls = layer_inputs(model, sources, images, 16, 2)
    for h in handles:
        h.remove()
    # a probe and the graph's measure (two forward passes) at full precision, the tokens' pass at full precision
    # (stopped before the last layer), then the sensitivity pass; the tokens kept are those of a float32 pass
    assert seen == [torch.float32] * 7 + [torch.bfloat16] * 2 and all(c[3].dtype == torch.float32 for c in calls)
    full = layer_inputs(model, sources, images, 16, 2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(calls, full))
    with bf16_parts(True):
        first = layer_inputs(model, sources, images, 8, 2, kept=1)
    assert torch.equal(first[0][0], full[0][0]) and first[1][0] is None
    layers = [fit_attention(a, 8).layer for a in sources]
    seen.clear()
    handles = [a.register_forward_hook(lambda m, i, out: seen.append(out.dtype)) for a in layers]
    with bf16_parts(True):
        result = refine_blocks(sources, layers, calls, 5, 1e-2, 8, 0, False)
    # per layer: the mean loss before (2 batches of 8), 5 steps, the mean loss after (2 batches)
    assert seen == ([torch.float32] * 2 + [torch.bfloat16] * 5 + [torch.float32] * 2) * 2
    assert result.kl_after < result.kl_before and not result.kept_start
    seen.clear()
    refine_blocks(sources, [fit_attention(a, 8).layer for a in sources], calls, 2, 1e-2, 8, 0, False)
    for h in handles:
        h.remove()
    assert torch.bfloat16 not in seen


def test_bf16_steps_inside_the_recipe_follow_the_updated_weights() -> None:
    """The recipe refines inside an autocast region of its own; the bfloat16 steps must not reuse the weights cast
    at the first step (autocast's cache): through ``convert_model`` the steps lower the loss as in float32 (each to
    about a tenth here), where with the cache every layer rose and kept its start."""
    from collab_vit.conversion.calibration.recipe import Recipe
    from collab_vit.conversion.reparam import convert_model

    model, x = small("deit_tiny_patch16_224"), torch.randn(24, 3, 32, 32)
    refined = {}
    for bf16 in (False, True):
        report = convert_model(copy.deepcopy(model), 8, x, "default", 0, False,
                               Recipe(holdout=8, refine_steps=50, batch_size=8, bf16=bf16,
                                      candidates=("whitened+blocks",)))
        refined[bf16] = report.summary["refine"]
    assert refined[True]["bf16"] and not refined[False]["bf16"]
    for r in refined.values():
        assert not r["kept_start"] and r["loss_after"] < r["loss_before"] / 4


def test_a_shorter_run_is_a_prefix_of_a_longer_one_layer_by_layer() -> None:
    """Each layer draws its own minibatches: after 3 steps, every layer of a 7-step run is where a 3-step run leaves
    it (what experiments/blockwise_loso.py reads its snapshots from); ``on_step`` sees every step of every layer."""
    model = small("deit_tiny_patch16_224")
    sources = [block.attn for block in model.blocks]
    calls = layer_inputs(model, sources, torch.randn(24, 3, 32, 32), 8, 2)
    start = [fit_attention(a, 8).layer for a in sources]
    short = copy.deepcopy(start)
    refine_blocks(sources, short, calls, 3, 1e-2, 8, 0, False)
    seen, snapshots = [], {}

    def on_step(index: int, step: int) -> None:
        seen.append((index, step))
        if step == 3:
            snapshots[index] = copy.deepcopy(longer[index].state_dict())

    longer = copy.deepcopy(start)
    refine_blocks(sources, longer, calls, 7, 1e-2, 8, 0, False, on_step)
    assert seen == [(i, s) for i in range(2) for s in range(1, 8)]
    assert all(torch.equal(snapshots[i][k], layer.state_dict()[k]) for i, layer in enumerate(short)
               for k in snapshots[i])
    assert not torch.equal(longer[1].mixing, short[1].mixing)


def test_sensitivities_are_the_gradients_of_the_drawn_class_log_probability() -> None:
    """``g_s . v`` is the derivative of ``log p(c_s | x)`` along ``v`` added to a layer's output: central differences
    in float64 (step 1e-4: truncation ~1e-8 relative), each image on its own; the sensitivities are kept in float32
    (a sum of 1088 products, each rounded to ~6e-8 relative: within 1e-5)."""
    model = small("deit_tiny_patch16_224").double()
    sources = [block.attn for block in model.blocks]
    images = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    calls = layer_inputs(model, sources, images, 2, samples=2, seed=1)
    assert [c[3].shape for c in calls] == [(3, 2, 17, 64)] * 2
    logits = model(images)
    drawn = torch.multinomial(logits.softmax(-1), 2, replacement=True, generator=torch.Generator().manual_seed(1))
    for layer, call in zip(sources, calls):
        v = torch.randn(3, 17, 64, dtype=torch.float64)
        shifted = []
        for sign in (1, -1):
            handle = layer.register_forward_hook(lambda m, a, out, sign=sign: out + sign * 1e-4 * v)
            with torch.no_grad():
                shifted.append(torch.log_softmax(model(images), -1))
            handle.remove()
        for s in range(2):
            numeric = (shifted[0] - shifted[1]).gather(1, drawn[:, s:s + 1]).squeeze(1) / 2e-4
            analytic = torch.einsum("bnd,bnd->b", call[3][:, s].double(), v)
            assert torch.allclose(analytic, numeric, rtol=1e-5, atol=1e-7)


def test_the_default_refinement_runs_the_whole_model_a_fixed_number_of_times() -> None:
    """The cost guarantee of the blockwise refinement (RESULTS_HISTORY.md, "Blockwise refinement"): the default effort's
    refinement steps run single layers, so the whole model's forward passes do not grow with the steps (capture, one
    pass with the sensitivities, the held-out measures)."""
    from collab_vit.conversion.calibration.recipe import Recipe
    from collab_vit.conversion.reparam import convert_model

    model, x = small("deit_tiny_patch16_224"), torch.randn(24, 3, 32, 32)
    counts = {}
    for pinned, steps in ((None, 5), (None, 50), (("weight+blocks",), 5), (("weight+blocks",), 50)):
        calls = []
        handle = model.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))
        convert_model(copy.deepcopy(model), 8, x, "default", 0, False,
                      Recipe(holdout=8, refine_steps=steps, batch_size=8, candidates=pinned))
        handle.remove()
        counts[pinned, steps] = len(calls)
    assert counts[None, 5] == counts[None, 50]
    assert counts[("weight+blocks",), 5] == counts[("weight+blocks",), 50]


@pytest.mark.parametrize("short", ["disk", "memory"])
def test_a_conversion_that_would_not_fit_is_one_line_before_any_work(tmp_path, monkeypatch, capsys, short) -> None:
    """``collab-vit convert`` with more calibration images than the disk beside the output can hold (tokens and
    sensitivities) or the host's memory (images, graph, model): one line naming the sizes and what to do, exit 1,
    nothing written, before the recipe captures or fits anything (the estimate: one image's tokens)."""
    from collab_vit.cli import main as cli_main
    from collab_vit.conversion.calibration import blockwise, recipe, state

    from test_calibration_cli import exported
    from tinyrun import make_image_folder

    data = make_image_folder(tmp_path / "data", classes=2, train_per_class=100, val_per_class=1)
    monkeypatch.setattr(state if short == "disk" else blockwise,
                        "disk_free" if short == "disk" else "available_bytes", lambda *a: 1000)
    monkeypatch.setattr(recipe, "capture", lambda *a, **k: pytest.fail("captured tokens for a cache that cannot fit"))
    out = tmp_path / "k6.safetensors"
    source = exported(tmp_path)
    before = sorted(tmp_path.iterdir())
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["convert", "--checkpoint", source, "--key-dim", "6", "--out", str(out),
                  "--calibration-data-dir", data, "--calibration-images", "200"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 1
    expected = "MiB beside the output (tokens, sensitivities and the output)" if short == "disk" else "GiB in memory"
    assert expected in err
    assert err.endswith("too little for two calibration images: make room, or convert weight-only (without "
                        "--calibration-data-dir)")
    assert sorted(tmp_path.iterdir()) == before  # nothing written beside the source: no output, no state folder


def test_a_refused_conversion_names_the_most_calibration_images_that_fit() -> None:
    """The refusal names the largest count of calibration images whose files fit on the disk (a quarter of them held
    out, as the recipe does: ``blockwise.Footprint``), and that count passes the check; one more image does not."""
    from collab_vit.conversion.calibration import blockwise, state
    from collab_vit.conversion.calibration.recipe import Recipe, plan, split

    model = small("deit_tiny_patch16_224")
    layers = timm_attention_layers(model)
    images = torch.randn(200, 3, 32, 32)
    files = blockwise.footprint(model, [a for _, a in layers], images[:1], Recipe().samples, 1)
    room = files.bytes(split(150, None), 150 - split(150, None), True)  # 113 fitting images, 37 held out
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(state, "disk_free", lambda *a: room)
        with pytest.raises(MemoryError, match=r"use at most 150 calibration images \(--calibration-images 150\)"):
            plan(model, layers, images, Recipe(), 1, 2)
        assert plan(model, layers, images[:150], Recipe(), 1, 2).disk == room
        with pytest.raises(MemoryError):
            plan(model, layers, images[:151], Recipe(), 1, 2)


def test_the_cache_estimate_is_what_the_cache_holds() -> None:
    """``cache_bytes`` from one image is the bytes ``layer_inputs`` holds (tokens and sensitivities, rope included)
    and the refinement's ``WORKING`` token tensors; the store's files hold no more than that at any time."""
    from collab_vit.conversion.calibration import blockwise, state

    for name in ("deit_tiny_patch16_224", "vit_small_patch16_rope_224"):
        model = small(name)
        sources = [block.attn for block in model.blocks]
        images = torch.randn(6, 3, 32, 32)
        calls = layer_inputs(model, sources, images, 2, 3)
        held = sum(c[0].numel() * c[0].element_size() + c[3].numel() * c[3].element_size() for c in calls)
        working = blockwise.WORKING * calls[0][0].numel() * 4  # a layer's refinement
        assert blockwise.cache_bytes(model, sources, images[:1], 6, 3) == held + working
        first = layer_inputs(model, sources, images, 2, 3, kept=1)  # what the recipe holds: the first layer's tokens
        assert first[1][0] is None and torch.equal(first[0][0], calls[0][0])
        assert all(torch.equal(a[3], b[3]) for a, b in zip(first, calls))
        kept = blockwise.cache_bytes(model, sources, images[:1], 6, 3, 1)
        assert kept == held + working - calls[1][0].numel() * 4
        store = state.Store("test")
        with store.use():
            stored = layer_inputs(model, sources, images, 2, 3, kept=1)
        assert all(torch.equal(a[3], b[3]) for a, b in zip(first, stored))
        layers = [(fit_rotary(a, 8) if "rope" in name else fit_attention(a, 8)).layer for a in sources]
        for block, layer in zip(model.blocks, layers):
            block.attn = layer
        most = [0]

        def measured(number: int, step: int) -> None:
            most[0] = max(most[0], sum(p.stat().st_size for p in store.folder.iterdir() if p.suffix == ".bin"))

        with store.use():
            refine_blocks(sources, layers, converted_calls(model, layers, stored, images, 2), 2, 1e-3, 2, 0, False,
                          measured)
        assert 0 < most[0] <= kept
        store.close()
        assert not store.folder.exists()


PROBE = """
import sys
import timm, torch
from collab_vit.conversion.calibration import recipe
from collab_vit.conversion.reparam import convert_model

recipe.PASSES["default"] = 1  # the memory does not depend on the steps
torch.manual_seed(0)
model = timm.create_model("deit_tiny_patch16_224", img_size=32, patch_size=4, depth=2, embed_dim=128, num_heads=4,
                          num_classes=10).eval()
images = torch.randn(int(sys.argv[1]), 3, 32, 32)
""" + WATCH + """
convert_model(model, 8, images, "default", 0, False, recipe.Recipe(candidates=("weight+blocks",)))
""" + REPORT


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident memory from Linux's /proc")
def test_the_calibrated_conversion_holds_the_same_memory_for_four_times_the_images() -> None:
    """The peak resident memory (``RssAnon + RssShmem``, sampled every 2 ms in a fresh process whose freed blocks go
    back to the system: ``MALLOC_MMAP_THRESHOLD_``) of a calibrated conversion with 800 images is within 10 % of the
    same conversion with 200: the tokens and sensitivities (13 token tensors per fitting image here, 260 MB at 800
    images, half the process) live in the store's memory-mapped files, whose page cache is not the process's."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    peaks = [int(subprocess.run([sys.executable, "-c", PROBE, str(n)], capture_output=True, text=True, env=env,
                                check=True).stdout.split()[-1]) for n in (200, 800)]
    assert peaks[1] <= 1.1 * peaks[0], peaks


def test_the_lost_plain_loss_is_refused() -> None:
    """The plain per-layer squared error (no sensitivities) lost on top-1 and left the package: zero classes drawn
    is refused by the recipe and by the cache."""
    from collab_vit.conversion.calibration.recipe import Recipe

    with pytest.raises(ValueError, match="samples"):
        Recipe(samples=0)
    model = small("deit_tiny_patch16_224")
    with pytest.raises(ValueError, match="samples"):
        layer_inputs(model, [model.blocks[0].attn], torch.randn(2, 3, 32, 32), 2, 0)


def test_each_layer_is_refined_on_the_tokens_the_refined_layers_before_it_give() -> None:
    """``converted_calls``: the first layer reads the source's tokens, the second what the model gives it with the
    first converted and refined (not the source's tokens), each read after the layer before it was refined; the
    recipe's blockwise refinement is that, rope included."""
    for name, fit in (("deit_tiny_patch16_224", lambda a: fit_attention(a, 8)),
                      ("vit_small_patch16_rope_224", lambda a: fit_rotary(a, 8))):
        model = small(name)
        images = torch.randn(24, 3, 32, 32)
        sources = [block.attn for block in model.blocks]
        calls = layer_inputs(model, sources, images, 16, 2)
        layers = [fit(a).layer for a in sources]
        for block, layer in zip(model.blocks, layers):
            block.attn = layer
        seen = []

        def spy():
            for call in converted_calls(model, layers, calls, images, 16):
                seen.append(call)
                yield call

        refine_blocks(sources, layers, spy(), 5, 1e-2, 8, 0, False)
        reached = []
        handle = layers[1].register_forward_pre_hook(lambda m, a: reached.append(a[0]))
        with torch.no_grad():
            model(images)
        handle.remove()
        assert seen[0] is calls[0]
        assert torch.equal(seen[1][0], reached[0])  # the model's tokens with the refined first layer
        assert not torch.allclose(seen[1][0], calls[1][0], atol=1e-3)
        assert all(torch.equal(a, b) for a, b in zip(seen[1][3:], calls[1][3:]))  # the source's sensitivities


class _Half(torch.nn.Module):
    """Something a model does between two blocks (halves the tokens)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x


def test_converted_tokens_are_carried_block_to_block_as_a_stopped_pass_reads_them() -> None:
    """``converted_calls`` reads each layer's tokens by running the block before it once over the images (block 0
    crosses each image once, plus one checking batch per layer), and they are the stopped pass's to the bit, rope
    included; where the model does more between two blocks, the stopped passes read them from there on."""
    for name, fit, between in (("deit_tiny_patch16_224", lambda a: fit_attention(a, 8), False),
                               ("vit_small_patch16_rope_224", lambda a: fit_rotary(a, 8), False),
                               ("deit_tiny_patch16_224", lambda a: fit_attention(a, 8), True)):
        torch.manual_seed(0)
        model = timm.create_model(name, **{**SMALL, "depth": 5}).eval()
        sources = [block.attn for block in model.blocks]
        images = torch.randn(28, 3, 32, 32)  # 4 batches of 8, the last of 4
        calls = layer_inputs(model, sources, images, 8, 1)
        layers = [fit(a).layer for a in sources]
        for block, layer in zip(model.blocks, layers):
            block.attn = layer
        if between:
            model.blocks = torch.nn.Sequential(*model.blocks[:3], _Half(), *model.blocks[3:])
        crossed = []  # the images each block call completes
        handles = [b.register_forward_hook(lambda m, a, out: crossed.append(a[0].shape[0])) for b in model.blocks]
        for index, call in enumerate(converted_calls(model, layers, calls, images, 8)):
            counted = len(crossed)
            assert torch.equal(call[0], tokens_at(model, layers[index], images, 8)), (name, between, index)
            del crossed[counted:]
            with torch.no_grad():
                layers[index].mixing.mul_(1.1)  # as if refined: the next layer's tokens change
        for handle in handles:
            handle.remove()
        if not between:  # blocks 0-3 replayed once each; the checking batch of layer l crosses blocks 0 to l - 1
            assert sum(crossed) == 4 * 28 + (1 + 2 + 3 + 4) * 8  # stopped passes: (1 + 2 + 3 + 4) * 28


def test_the_recipe_holds_the_first_layers_tokens_alone() -> None:
    """The recipe's cache keeps the source's tokens of the first layer only (the others are read from the converted
    model) and every layer's sensitivities; experiments may ask for every layer's tokens."""
    from collab_vit.conversion.calibration.recipe import Recipe, RecipeRun

    model = small("deit_tiny_patch16_224")
    run = RecipeRun(model, timm_attention_layers(model), torch.randn(24, 3, 32, 32), Recipe(), 0)
    calls = run.cached_calls()
    assert calls[0][0].shape[0] == 18 and [c[0] for c in calls[1:]] == [None]
    every = run.cached_calls(every_layer=True)
    assert all(c[0].shape[0] == 18 for c in every) and torch.equal(every[1][3], calls[1][3])


# ``collab-vit convert`` with the device's rule forced (a CPU without bfloat16 takes the float32 parts, one with it the
# bfloat16 ones): the suite covers both routes through the command on any CPU
FORCED = """
import sys
from collab_vit.conversion.calibration import recipe
forced = sys.argv.pop(1) == "1"
recipe.bf16_native = lambda device: forced
from collab_vit.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_the_command_refines_in_the_precision_the_device_rule_gives(family, tmp_path) -> None:
    """Through ``collab-vit convert`` in a process of its own, every family of the package's table, the rule forced
    each way: the conversion finishes, refining in that precision (the file's record says which), and the converted
    weights stay float32. (Random sources: the losses are about zero, so only the route is checked here;
    ``test_bf16_steps_inside_the_recipe_follow_the_updated_weights`` checks what the bfloat16 steps do.)"""
    import json
    import sys

    import warmstart
    from safetensors.torch import load_file
    from test_every_command import ENV, source_flags
    from tinyrun import make_image_folder

    design = next(f.design for f in FAMILIES if f.name == family)
    data = make_image_folder(tmp_path / "data", classes=4, train_per_class=12, val_per_class=1, size=16)
    for forced in (True, False):
        out = tmp_path / f"bf16_{int(forced)}.safetensors"
        done = warmstart.run([sys.executable, "-c", FORCED, str(int(forced)), "convert", *source_flags(design),
                              "--key-dim", "16", "--out", str(out), "--calibration-data-dir", str(data),
                              "--calibration-images", "48"], tmp_path, {**os.environ, **ENV})
        assert done.code == 0, done.why()
        calibration = json.loads(out.with_suffix(".json").read_text())["calibration"]
        refined = [name for name in calibration["candidates"] if name.endswith("+blocks")]  # of the better start
        assert calibration["bf16"] is forced and len(refined) == 1, calibration
        assert all(t.dtype == torch.float32 for t in load_file(str(out)).values() if t.is_floating_point())
