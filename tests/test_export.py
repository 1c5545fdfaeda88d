"""Deployment exports compute the model: both ONNX exporters (run by onnxruntime), ``torch.export`` and a saved
``torch.jit.trace``, each at two batch sizes (``collab_vit/layers/dispatch.py``: graph capture on the CPU takes
``explicit``).

The TorchScript-based exporters used to trace the CPU core (an autograd Function): the ONNX graph had no attention
(logits off by 0.9 of their max) and a traced module could not be saved. Bound: the issue's acceptance criterion,
``max |exported - eager| <= 1e-5 max |eager|`` (about 170 float32 unit roundoffs): two float32 evaluations of the
same function by different kernels (observed: about 1e-6, ONNX; 0 for ``torch.export`` and the trace); the faults
it guards against are of order 1.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

import onnxruntime
import pytest
import timm
import torch
from timm.utils.onnx import onnx_export

import collab_vit  # noqa: F401  (registers the models)
from numerics import max_error

BOUND = 1e-5
BATCHES = (2, 5)  # exported at 2; a dynamic batch must give the same function at another size
TINY = dict(img_size=32, patch_size=8, depth=2, num_classes=10, key_dim=48)


def tiny_model(name: str) -> torch.nn.Module:
    """A tiny model with random non-zero biases (timm zero-inits them, which would hide a lost bias term)."""
    torch.manual_seed(0)
    model = timm.create_model(name, **TINY).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(0, 0.2)
    return model


def onnx_runner(path: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: torch.from_numpy(session.run(None, {name: x.numpy()})[0])


def export_timm_onnx(model: torch.nn.Module, x: torch.Tensor, tmp: Path) -> Callable:
    onnx_export(model, str(tmp / "timm.onnx"), example_input=x)  # TorchScript exporter, timm's default
    return onnx_runner(tmp / "timm.onnx")


def export_torchscript_onnx(model: torch.nn.Module, x: torch.Tensor, tmp: Path) -> Callable:
    torch.onnx.export(model, (x,), str(tmp / "ts.onnx"), dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return onnx_runner(tmp / "ts.onnx")


def export_dynamo_onnx(model: torch.nn.Module, x: torch.Tensor, tmp: Path) -> Callable:
    torch.onnx.export(model, (x,), str(tmp / "dynamo.onnx"), dynamo=True, verbose=False,
                      dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
    return onnx_runner(tmp / "dynamo.onnx")


def export_torch_export(model: torch.nn.Module, x: torch.Tensor, tmp: Path) -> Callable:
    program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
    torch.export.save(program, str(tmp / "model.pt2"))
    return torch.export.load(str(tmp / "model.pt2")).module()


def export_jit_trace(model: torch.nn.Module, x: torch.Tensor, tmp: Path) -> Callable:
    with torch.no_grad():
        torch.jit.trace(model, x).save(str(tmp / "traced.pt"))  # saving failed on the core's Python call
    return torch.jit.load(str(tmp / "traced.pt"))


EXPORTERS = {"timm_onnx_export": export_timm_onnx, "onnx_torchscript": export_torchscript_onnx,
             "onnx_dynamo": export_dynamo_onnx, "torch_export": export_torch_export, "jit_trace": export_jit_trace}


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", ["collab_deit_tiny_patch16_224", "concat_deit_tiny_patch16_224"])
def test_exported_graph_computes_the_model(name: str, exporter: str, tmp_path: Path) -> None:
    model = tiny_model(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exporters' deprecation and tracer warnings
        run = EXPORTERS[exporter](model, torch.randn(BATCHES[0], 3, 32, 32), tmp_path)
    for batch in BATCHES:
        x = torch.randn(batch, 3, 32, 32)
        with torch.no_grad():
            expected, got = model(x), run(x)
        assert got.shape == expected.shape
        assert max_error(got, expected) <= BOUND, f"{exporter}, batch {batch}: {max_error(got, expected):.3g}"
