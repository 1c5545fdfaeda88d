"""Training configuration: one dataclass of hyperparameters, YAML files with ``base:`` inheritance, overrides,
and the two errors a user can cause (each message one line: the CLIs print it and exit 2).

Every hyperparameter is a field of :class:`TrainConfig`. A YAML file sets any subset of them and may inherit from
another file through ``base: relative/path.yaml``; overrides (``train.py``'s flags, :mod:`.flags`) replace the
result, typed from the field's default. An unknown key anywhere is a :class:`ConfigError` that names it and the
closest valid key.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import yaml

from ..weights_io import atomic_write


class ConfigError(ValueError):
    """A config file, flag or option is invalid (a one-line message for the user: the CLIs print it, exit 2)."""


class DataError(RuntimeError):
    """The data directory is missing, empty or unreadable; the message names the path (one line, exit 2)."""


@dataclass
class TrainConfig:
    """All hyperparameters of a run. Defaults are DeiT's ImageNet recipe (facebookresearch/deit, 300 epochs)."""

    # model
    model: str = 'deit_base_patch16_224'
    model_kwargs: Dict[str, Any] = field(default_factory=dict)  # passed to timm.create_model, e.g. {key_dim: 384}
    num_classes: int = 1000
    img_size: int = 224
    in_chans: int = 3  # image channels (1 for grayscale data such as Fashion-MNIST)
    drop_path: float = 0.1
    checkpoint: str = ''  # initial weights (our checkpoint, .safetensors, a timm/DeiT .pth or a save_pretrained folder)
    # data (dataset '' = ImageFolder; timm names such as 'wds/...', 'hfds/...', 'tfds/...' or 'sklearn/digits')
    data_dir: str = ''
    dataset: str = ''
    train_split: str = 'train'
    val_split: str = 'validation'
    dataset_download: bool = False  # let torchvision / TFDS / HF readers download a missing dataset
    mean: Tuple[float, ...] = ()  # per-channel normalisation; () = the model's default (ImageNet)
    std: Tuple[float, ...] = ()
    num_workers: int = 8
    skip_bad_images: bool = False  # replace an unreadable/truncated image by the next one and count it (default: stop)
    pin_memory: bool = True
    persistent_workers: bool = True
    # augmentation
    aa: str = 'rand-m9-mstd0.5-inc1'
    reprob: float = 0.25
    remode: str = 'pixel'
    recount: int = 1
    hflip: float = 0.5
    color_jitter: float = 0.3
    scale: Tuple[float, float] = (0.08, 1.0)
    train_interpolation: str = 'bicubic'
    crop_pct: float = 0.875
    mixup: float = 0.8
    cutmix: float = 1.0
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: str = 'batch'
    smoothing: float = 0.1
    repeated_aug: int = 3  # repeated-augmentation copies per image (DeiT's RASampler); 0 disables
    # optimisation
    epochs: int = 300
    batch_size: int = 64  # per process
    accum_steps: int = 1
    opt: str = 'adamw'
    lr: float = 5e-4  # base lr at a global batch of 512; scaled linearly to the actual global batch
    lr_base_batch: int = 512
    weight_decay: float = 0.05
    layer_decay: float = 0.0  # layer-wise lr decay (BEiT/timm), e.g. 0.65 for fine-tuning; 0 disables
    mixing_lr_scale: float = 1.0  # lr multiplier of the mixing matrices (param-group lr_scale; training/build.py)
    opt_eps: float = 1e-8
    momentum: float = 0.9
    clip_grad: float = 0.0  # 0 disables
    clip_mode: str = 'norm'
    sched: str = 'cosine'
    warmup_epochs: int = 5
    warmup_lr: float = 1e-6
    min_lr: float = 1e-5
    sched_on_updates: bool = False
    skip_nonfinite_loss: bool = False  # skip (and count) a batch whose loss is NaN/inf instead of stopping the run
    max_nonfinite_skips: int = 5  # with skip_nonfinite_loss: stop when this many batches in a row were skipped
    # model EMA
    model_ema: bool = True
    model_ema_decay: float = 0.99996
    model_ema_force_cpu: bool = False
    # run
    amp: bool = True  # used on GPU only
    amp_dtype: str = 'bfloat16'
    seed: int = 0
    deterministic: bool = False
    device: str = ''  # '' = cuda when available, else cpu
    cpu_threads: int = 0  # torch intra-op threads per process; 0 = torch's default
    output: str = ''  # run directory; '' = runs/<config name>
    resume: bool = False
    auto_resume: bool = False  # resume when <output>/last.pth exists, else start (with resume too: resume's rule)
    checkpoint_every: int = 0  # also keep epoch_XXXX.pth every N epochs; 0 disables
    eval_every: int = 1
    stop_after: int = 0  # leave after this many epochs in this invocation (pre-emptible jobs); 0 = run to the end
    log_wandb: bool = False
    wandb_project: str = 'collab-vit'
    experiment: str = ''  # run name; '' = derived from the output directory
    progress: bool = True  # rank 0: a tqdm bar on a terminal, else a plain line every log_interval updates
    log_interval: int = 50

    def to_dict(self) -> Dict[str, Any]:
        """Plain-type dict (tuples become lists), suitable for YAML, JSON and ``torch.load(weights_only=True)``."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


FIELDS: Dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _default(name: str) -> Any:
    f = FIELDS[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _check_key(key: str, where: str) -> None:
    if key not in FIELDS:
        close = difflib.get_close_matches(key, list(FIELDS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ''
        raise ConfigError(f"unknown config key '{key}' in {where}{hint}")


def _coerce(name: str, value: Any, where: str) -> Any:
    """Convert ``value`` to the type of the field's default; raise ConfigError when it does not fit."""
    default = _default(name)
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                if value.lower() in ('1', 'true', 'yes', 'on'):
                    return True
                if value.lower() in ('0', 'false', 'no', 'off'):
                    return False
                raise ValueError(value)
            if isinstance(value, (bool, int)):
                return bool(value)
            raise ValueError(value)
        if isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError(value)
            return float(value)
        if isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError(value)
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if isinstance(default, str):
            if isinstance(value, (list, tuple, dict, set)):
                raise ValueError(value)
            return '' if value is None else str(value)
        if isinstance(default, tuple):
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
                raise ValueError(value)
            if not default:  # variable length (mean, std): floats
                return tuple(float(v) for v in value)
            return tuple(type(d)(v) for d, v in zip(default, value, strict=True))
        if isinstance(default, dict):
            if value is None:
                return {}
            if not isinstance(value, dict):
                raise ValueError(value)
            return dict(value)
    except (TypeError, ValueError):
        raise ConfigError(f"bad value {value!r} for '{name}' in {where} (expected {type(default).__name__})") from None
    return value


def read_yaml(path: str, _seen: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """Read a config file, merging its ``base:`` chain (paths relative to the file); keys are checked."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f'config file not found: {path}')
    if path in _seen:
        raise ConfigError(f'config inheritance cycle through {path}')
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f'config file {path} must hold a mapping of keys to values')
    base = data.pop('base', None)
    merged: Dict[str, Any] = {}
    if base:
        merged = read_yaml(os.path.join(os.path.dirname(path), base), _seen + (path,))
    for key, value in data.items():
        _check_key(key, path)
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = {**merged[key], **value}  # model_kwargs and the like merge with the base
        merged[key] = value
    return merged


def build_config(path: Optional[str] = None, overrides: Optional[Dict[str, Any]] = None) -> TrainConfig:
    """Resolve a config: dataclass defaults <- YAML chain at ``path`` <- ``overrides`` (dict-valued keys merge)."""
    try:
        values = read_yaml(path) if path else {}
    except yaml.YAMLError as e:
        mark = getattr(e, 'problem_mark', None)
        where = f' (line {mark.line + 1}, column {mark.column + 1})' if mark is not None else ''
        raise ConfigError(f'cannot parse config file {os.path.abspath(path)}{where}: '
                          f'{getattr(e, "problem", None) or type(e).__name__}') from None
    where = {key: path for key in values}
    for key, value in (overrides or {}).items():
        _check_key(key, 'overrides')
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            value = {**values[key], **value}
        values[key], where[key] = value, 'command-line flags'
    kwargs = {k: _coerce(k, v, where[k]) for k, v in values.items()}
    cfg = TrainConfig(**kwargs)
    check_values(cfg, path or 'overrides')
    if not cfg.output:
        name = os.path.splitext(os.path.basename(path))[0] if path else 'run'
        cfg.output = os.path.join('runs', name)
    return cfg


# value ranges: (key, lowest allowed, highest allowed or None, lowest excluded?)
RANGES: Tuple[Tuple[str, float, Optional[float], bool], ...] = (
    ('num_classes', 1, None, False), ('img_size', 1, None, False), ('in_chans', 1, None, False),
    ('epochs', 1, None, False), ('batch_size', 1, None, False), ('accum_steps', 1, None, False),
    ('lr_base_batch', 1, None, False), ('num_workers', 0, None, False), ('cpu_threads', 0, None, False),
    ('lr', 0.0, None, False), ('min_lr', 0.0, None, False), ('warmup_lr', 0.0, None, False),
    ('warmup_epochs', 0, None, False), ('weight_decay', 0.0, None, False), ('clip_grad', 0.0, None, False),
    ('drop_path', 0.0, 1.0, False), ('smoothing', 0.0, 1.0, False), ('reprob', 0.0, 1.0, False),
    ('hflip', 0.0, 1.0, False), ('mixup', 0.0, None, False), ('cutmix', 0.0, None, False),
    ('mixup_prob', 0.0, 1.0, False), ('crop_pct', 0.0, None, True), ('model_ema_decay', 0.0, 1.0, False),
    ('repeated_aug', 0, None, False), ('checkpoint_every', 0, None, False), ('eval_every', 0, None, False),
    ('stop_after', 0, None, False), ('max_nonfinite_skips', 1, None, False), ('mixing_lr_scale', 0.0, None, True),
)


def check_key_dim_value(value: Any, where: str) -> None:
    """``model_kwargs.key_dim``: a positive int or a list of them (one per block); its length is checked when the
    model is built."""
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in values):
        raise ConfigError(f"bad value {value!r} for 'model_kwargs.key_dim' in {where} (expected a positive integer "
                          f"or a list of them, one per block)")


def check_values(cfg: TrainConfig, where: str) -> None:
    """Range checks of a typed config: one ConfigError naming the key, its value and the allowed range."""
    for key, low, high, open_low in RANGES:
        value = getattr(cfg, key)
        if value < low or (open_low and value == low) or (high is not None and value > high):
            bound = f'> {low}' if open_low else f'>= {low}'
            bound += f' and <= {high}' if high is not None else ''
            raise ConfigError(f"bad value {value!r} for '{key}' in {where} (expected a number {bound})")
    if cfg.amp_dtype not in ('bfloat16', 'bf16', 'float16', 'fp16'):
        raise ConfigError(f"bad value {cfg.amp_dtype!r} for 'amp_dtype' in {where} (expected bfloat16 or float16)")
    if 'key_dim' in cfg.model_kwargs:
        check_key_dim_value(cfg.model_kwargs['key_dim'], where)


def save_config(cfg: TrainConfig, path: str) -> None:
    """Write the resolved config as YAML, atomically (it loads back with :func:`build_config`)."""
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    atomic_write(path, lambda f: f.write(text.encode()))
