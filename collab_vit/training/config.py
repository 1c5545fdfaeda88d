"""Training configuration: one dataclass of hyperparameters, YAML files with ``base:`` inheritance, ``train.py``'s
flags, and the two errors a user can cause (each message one line: the CLIs print it and exit 2).

Every hyperparameter is a field of :class:`TrainConfig`, with its default and its line of help. A YAML file sets any
subset of them and may inherit from another file through ``base: relative/path.yaml``; overrides replace the result,
typed from the field's default. On the command line (:func:`parse_train_args`: ``-c CONFIG`` and ``--help`` grouped
like timm's train.py) every key is a flag, ``--key-name`` or ``--key_name``; booleans also take ``--no-key-name``;
``--model-kwargs a=1 b=2`` fills a dict; timm's spellings are accepted for the same meaning (``ALIASES``;
docs/training.md has the table). An unknown key anywhere is a :class:`ConfigError` that names it and the closest valid key.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from ..checks import is_number, positive_ints
from ..weights_io import WeightsError, atomic_write


class ConfigError(ValueError):
    """A config file, flag or option is invalid (a one-line message for the user: the CLIs print it, exit 2)."""


class DataError(RuntimeError):
    """The data directory is missing, empty or unreadable; the message names the path (one line, exit 2)."""


BAD_INPUT = (ConfigError, DataError, WeightsError, FileNotFoundError)  # exit 2 of train.py and eval.py (console.py)


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one (``taskset``, Slurm, containers),
    else every CPU of the machine."""
    affinity = getattr(os, 'sched_getaffinity', None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def default_workers(most: int) -> int:
    """The data-loader workers a CLI starts by default: ``most``, or fewer where this process may use fewer CPUs."""
    return min(most, available_cpus())


WORKERS_HELP = '{most} or the CPUs this process may use, whichever is fewer'  # a CLI's default -j, in its --help


def setting(default: Any, help: str) -> Any:
    """A config key of :class:`TrainConfig`: its default and its line of ``--help`` (a dict default is a fresh ``{}``
    per config; a callable default is called for each config)."""
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={'help': help})
    if callable(default):
        return field(default_factory=default, metadata={'help': help})
    return field(default=default, metadata={'help': help})


@dataclass
class TrainConfig:
    """All hyperparameters of a run. Defaults are DeiT's ImageNet recipe (facebookresearch/deit, 300 epochs)."""

    model: str = setting('deit_base_patch16_224', 'timm model name, e.g. collab_deit_base_patch16_224 (import '
                                                  'collab_vit registers them)')
    model_kwargs: Dict[str, Any] = setting({}, 'extra timm.create_model keywords as key=value pairs, e.g. key_dim=192 '
                                               'mixing_init=random')
    num_classes: int = setting(1000, "number of classes (must cover the data set's class folders)")
    img_size: int = setting(224, 'input image size in pixels (square)')
    in_chans: int = setting(3, 'image channels (1 for grayscale data such as Fashion-MNIST)')
    drop_path: float = setting(0.1, 'stochastic depth rate')
    torchcompile: str = setting('', "torch.compile the model with this backend, as timm's train.py (the flag alone: "
                                    "inductor); '' = eager")
    checkpoint: str = setting('', 'initial weights: a training checkpoint, .safetensors export, timm/DeiT .pth or a '
                                  'save_pretrained folder (fine-tuning)')
    data_dir: str = setting('', 'dataset root (ImageFolder with train/ and val/, tar files, WebDataset shards, ...)')
    dataset: str = setting('', "timm dataset name: '' (ImageFolder), torch/fashion_mnist, wds/..., hfds/..., "
                               'tfds/..., sklearn/digits')
    train_split: str = setting('train', 'training split name')
    val_split: str = setting('validation', "validation split name ('validation' also finds a val/ folder)")
    dataset_download: bool = setting(False, 'let torchvision / TFDS / HF readers download a missing data set')
    mean: Tuple[float, ...] = setting((), 'per-channel normalisation mean (one value or one per channel); empty = the '
                                          "model's (ImageNet)")
    std: Tuple[float, ...] = setting((), 'per-channel normalisation std (one value or one per channel); empty = the '
                                         "model's (ImageNet)")
    num_workers: int = setting(partial(default_workers, 8), 'data-loader worker processes per training process; '
                               'unset: ' + WORKERS_HELP.format(most=8))
    skip_bad_images: bool = setting(False, 'replace an unreadable or truncated image by the next one and count it '
                                           '(default: stop, naming the file)')
    pin_memory: bool = setting(True, 'pin host memory for faster GPU copies')
    persistent_workers: bool = setting(True, 'keep data-loader workers alive between epochs')
    aa: str = setting('rand-m9-mstd0.5-inc1', "auto-augment policy, e.g. rand-m9-mstd0.5-inc1 (RandAugment); '' "
                                              'disables')
    reprob: float = setting(0.25, 'random-erasing probability')
    remode: str = setting('pixel', 'random-erasing mode (pixel, rand, const)')
    recount: int = setting(1, 'random-erasing count')
    hflip: float = setting(0.5, 'horizontal-flip probability')
    color_jitter: float = setting(0.3, 'color-jitter factor (0 disables; unused when aa is set, as in timm)')
    scale: Tuple[float, float] = setting((0.08, 1.0), 'random-resized-crop area range (two floats)')
    train_interpolation: str = setting('bicubic', 'training resize interpolation')
    crop_pct: float = setting(0.875, 'evaluation centre-crop fraction (DeiT: 0.875 = resize 256, crop 224)')
    mixup: float = setting(0.8, 'mixup alpha (0 disables)')
    cutmix: float = setting(1.0, 'cutmix alpha (0 disables)')
    mixup_prob: float = setting(1.0, 'probability of applying mixup or cutmix per batch')
    mixup_switch_prob: float = setting(0.5, 'probability of cutmix instead of mixup when both are on')
    mixup_mode: str = setting('batch', 'mixup mode: batch, pair or elem')
    smoothing: float = setting(0.1, 'label smoothing')
    repeated_aug: int = setting(3, "repeated-augmentation copies per image when distributed (DeiT's RASampler); 0 "
                                   'disables')
    epochs: int = setting(300, 'training epochs')
    batch_size: int = setting(64, 'batch size per process')
    accum_steps: int = setting(1, 'gradient-accumulation steps per optimizer update')
    opt: str = setting('adamw', 'timm optimizer name (adamw, sgd, lamb, ...)')
    lr: float = setting(5e-4, 'learning rate at a global batch of lr_base_batch; scaled linearly to the actual global '
                              'batch')
    lr_base_batch: int = setting(512, 'global batch at which lr is given')
    weight_decay: float = setting(0.05, 'weight decay (none on norms, biases, position embedding, class token, mixing '
                                        'matrices)')
    layer_decay: float = setting(0.0, 'layer-wise learning-rate decay (e.g. 0.65 for fine-tuning); 0 disables')
    opt_eps: float = setting(1e-8, 'optimizer epsilon')
    momentum: float = setting(0.9, 'SGD momentum')
    clip_grad: float = setting(0.0, 'gradient clipping threshold; 0 disables')
    clip_mode: str = setting('norm', 'gradient clipping mode: norm, value or agc')
    sched: str = setting('cosine', 'learning-rate schedule (timm: cosine, step, plateau, ...)')
    warmup_epochs: int = setting(5, 'linear warm-up epochs')
    warmup_lr: float = setting(1e-6, 'learning rate at the start of warm-up')
    min_lr: float = setting(1e-5, 'lowest learning rate of the schedule')
    sched_on_updates: bool = setting(False, 'step the schedule every optimizer update instead of every epoch')
    skip_nonfinite_loss: bool = setting(False, 'skip (and count) a batch whose loss is NaN/inf instead of stopping '
                                               'the run')
    max_nonfinite_skips: int = setting(5, 'with skip_nonfinite_loss: stop after this many skipped batches in a row')
    model_ema: bool = setting(True, 'keep an exponential moving average of the weights (evaluated and exported too)')
    model_ema_decay: float = setting(0.99996, 'EMA decay per update')
    model_ema_force_cpu: bool = setting(False, 'keep the EMA copy on the CPU')
    amp: bool = setting(True, 'mixed precision on GPU (bf16/fp16 autocast); ignored on CPU')
    amp_dtype: str = setting('bfloat16', 'autocast dtype: bfloat16 or float16 (float16 uses a grad scaler)')
    seed: int = setting(0, 'random seed (data order, initialisation, augmentation)')
    deterministic: bool = setting(False, 'deterministic algorithms (slower)')
    device: str = setting('', "device: '' = cuda when available, else cpu")
    cpu_threads: int = setting(0, "torch intra-op threads per process; 0 = torch's default")
    output: str = setting('', "run directory; '' = runs/<config name>")
    resume: bool = setting(False, 'continue the run in --output from its last.pth (optimizer, schedule, EMA, RNG, '
                                  'data order)')
    auto_resume: bool = setting(False, 'resume when <output>/last.pth exists, else start (torchrun --max-restarts, '
                                       'requeues)')
    checkpoint_every: int = setting(0, 'also keep epoch_NNNN.pth every N epochs; 0 disables')
    eval_every: int = setting(1, 'evaluate every N epochs (and always after the last)')
    stop_after: int = setting(0, 'leave after this many epochs in this invocation (continue with --resume); 0 = run '
                                 'to the end')
    log_wandb: bool = setting(False, 'log to Weights & Biases (offline without an API key or network)')
    wandb_project: str = setting('collab-vit', 'wandb project')
    experiment: str = setting('', "run name; '' = the output directory's name")
    progress: bool = setting(True, 'progress on rank 0: a bar on a terminal, a plain line every log_interval updates '
                                   'in a log file')
    log_interval: int = setting(50, 'updates between progress lines when the output is not a terminal')


    def to_dict(self) -> Dict[str, Any]:
        """Plain-type dict (tuples become lists), suitable for YAML, JSON and ``torch.load(weights_only=True)``."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


FIELDS: Dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}

# keys that left the config (no measurement kept them), their old default (a saved run config still holds it: read
# as nothing) and the one line any other value, or the flag, answers with
REMOVED_KEYS: Dict[str, Tuple[Any, str]] = {
    'mixing_lr_scale': (1.0, "mixing_lr_scale was removed (its one measurement was inconclusive: "
                             "RESULTS_HISTORY.md): drop it; the mixing matrices train at the run's lr in timm's "
                             "param groups"),
}


def _removed(key: str, value: Any) -> bool:
    """Whether ``key`` left the config: True for its old default (skipped), a ConfigError naming what replaced it for
    any other value."""
    if key not in REMOVED_KEYS:
        return False
    default, why = REMOVED_KEYS[key]
    if value != default:
        raise ConfigError(why)
    return True


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
            if not (is_number(value) or isinstance(value, str)):
                raise ValueError(value)
            return float(value)
        if isinstance(default, int):
            if not (is_number(value) or isinstance(value, str)):
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
        if _removed(key, value):
            continue
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
        if _removed(key, value):
            continue
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
    ('stop_after', 0, None, False), ('max_nonfinite_skips', 1, None, False),
)


def check_key_dim_value(value: Any, where: str) -> None:
    """``model_kwargs.key_dim``: a positive int or a list of them (one per block); its length is checked when the
    model is built."""
    try:
        positive_ints(value, 'model_kwargs.key_dim')
    except ValueError:
        raise ConfigError(f"bad value {value!r} for 'model_kwargs.key_dim' in {where} (expected a positive integer "
                          f"or a list of them, one per block)") from None


def check_compile_backend(backend: str, where: str) -> None:
    """``torchcompile``: a backend ``torch.compile`` knows (``torch._dynamo.list_backends``, debug ones included)."""
    import torch._dynamo  # noqa: PLC0415  (only when compiling: the import takes a second)
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError(f"bad value {backend!r} for 'torchcompile' in {where} (expected a torch.compile backend: "
                          f"{', '.join(b for b in known if 'TESTING' not in b)})")


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
    if cfg.torchcompile:
        check_compile_backend(cfg.torchcompile, where)
    if 'key_dim' in cfg.model_kwargs:
        check_key_dim_value(cfg.model_kwargs['key_dim'], where)


def save_config(cfg: TrainConfig, path: str) -> None:
    """Write the resolved config as YAML, atomically (it loads back with :func:`build_config`)."""
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    atomic_write(path, lambda f: f.write(text.encode()))


GROUPS_KEYS: Dict[str, str] = {  # the --help groups, as in timm's train.py
    'model': 'model model_kwargs num_classes img_size in_chans drop_path torchcompile checkpoint',
    'data': 'data_dir dataset train_split val_split dataset_download mean std num_workers pin_memory '
            'persistent_workers skip_bad_images',
    'augmentation': 'aa reprob remode recount hflip color_jitter scale train_interpolation crop_pct mixup cutmix '
                    'mixup_prob mixup_switch_prob mixup_mode smoothing repeated_aug',
    'optimizer': 'epochs batch_size accum_steps opt lr lr_base_batch weight_decay layer_decay opt_eps '
                 'momentum clip_grad clip_mode skip_nonfinite_loss max_nonfinite_skips',
    'scheduler': 'sched warmup_epochs warmup_lr min_lr sched_on_updates',
    'EMA': 'model_ema model_ema_decay model_ema_force_cpu',
    'distributed and devices': 'amp amp_dtype seed deterministic device cpu_threads',
    'run, checkpoints and logging': 'output resume auto_resume checkpoint_every eval_every stop_after log_wandb '
                                    'wandb_project experiment progress log_interval',
}
GROUPS: Dict[str, Dict[str, str]] = {title: {k: FIELDS[k].metadata['help'] for k in keys.split()}
                                     for title, keys in GROUPS_KEYS.items()}
HELP: Dict[str, str] = {key: text for group in GROUPS.values() for key, text in group.items()}

# timm's train.py spellings -> our keys (same meaning). timm's --lr is an absolute rate; ours is timm's --lr-base.
ALIASES: Dict[str, str] = {
    'workers': 'num_workers', 'grad_accum_steps': 'accum_steps', 'aug_repeats': 'repeated_aug',
    'pin_mem': 'pin_memory', 'initial_checkpoint': 'checkpoint', 'lr_base': 'lr', 'lr_base_size': 'lr_base_batch',
    'data': 'data_dir', 'drop_path_rate': 'drop_path', 'interpolation': 'train_interpolation',
}
SHORT: Dict[str, str] = {'-j': 'num_workers', '-b': 'batch_size'}
BARE: Dict[str, str] = {'torchcompile': 'inductor'}  # the value of a flag given alone (timm's --torchcompile)


def _dash(key: str) -> str:
    return '--' + key.replace('_', '-')


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (a ConfigError: exit 2, no usage dump)."""

    def error(self, message: str) -> None:
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``train.py``: ``-c/--config`` and every config key, grouped, each with its default and help."""
    parser = Parser(
        prog='train.py', formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description='Train a (collaborative) ViT with DeiT\'s recipe: a YAML config plus any key as a flag.',
        epilog='Examples:\n  python train.py -c configs/quickstart.yaml\n'
               '  torchrun --nproc_per_node=8 train.py -c configs/deit_base_collab_k192.yaml --data-dir /data/imagenet\n'
               '  python train.py -c configs/fmnist/collab_k16.yaml --seed 1 --epochs 10 --model-kwargs key_dim=8\n'
               'timm spellings accepted: ' + ', '.join(f'{_dash(a)} = {_dash(k)}' for a, k in ALIASES.items())
               + ', -j = --num-workers, -b = --batch-size.\n'
               'Booleans: --key (true), --key false, or --no-key. Keys may be written with - or _.')
    parser.add_argument('-c', '--config', metavar='FILE', help='YAML config (keys as below; base: FILE inherits)')
    for title, keys in GROUPS.items():
        group = parser.add_argument_group(title)
        for key in keys:
            default = _default(key)
            names = [n for n, k in SHORT.items() if k == key] + [_dash(key)]
            names += [_dash(alias) for alias, target in ALIASES.items() if target == key]
            shown = default if default not in ('', (), {}) else "''" if default == '' else 'none'
            text = f'{HELP[key]} (default: {shown})'
            if isinstance(default, bool):
                group.add_argument(*names, dest=key, nargs='?', const='true', metavar='BOOL',
                                   default=argparse.SUPPRESS, help=text)
                negatives = ['--no-' + name[2:] for name in names if name.startswith('--')]
                group.add_argument(*negatives, dest=key, action='store_const', const='false',
                                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            elif isinstance(default, (tuple, dict)):
                metavar = 'KEY=VALUE' if isinstance(default, dict) else 'X'
                group.add_argument(*names, dest=key, nargs='*', metavar=metavar, default=argparse.SUPPRESS, help=text)
            else:
                group.add_argument(*names, dest=key, metavar=type(default).__name__.upper(),
                                   nargs='?' if key in BARE else None, const=BARE.get(key),
                                   default=argparse.SUPPRESS, help=text)
    return parser


def _normalise(argv: Sequence[str]) -> List[str]:
    """``--key_name`` -> ``--key-name`` (both spellings work), values untouched."""
    out = []
    for arg in argv:
        if arg.startswith('--') and not arg.startswith('---'):
            name, sep, value = arg[2:].partition('=')
            arg = '--' + name.replace('_', '-') + sep + value
        out.append(arg)
    return out


def _unknown(flag: str) -> ConfigError:
    key = flag.lstrip('-').partition('=')[0].replace('-', '_')
    if key in REMOVED_KEYS:
        return ConfigError(REMOVED_KEYS[key][1])
    close = difflib.get_close_matches(key, list(FIELDS) + list(ALIASES), n=1)
    hint = f"; did you mean '{ALIASES.get(close[0], close[0])}'?" if close else ''
    return ConfigError(f"unknown config key '{key}' in command-line flags{hint}")


def parse_flags(argv: Sequence[str]) -> tuple[Optional[str], Dict[str, Any]]:
    """``(config path, overrides)`` from the command line; overrides are still raw (checked by build_config)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(_normalise(argv))
    if unknown:
        raise (_unknown(unknown[0]) if unknown[0].startswith('-') else
               ConfigError(f"unexpected argument '{unknown[0]}' (flags look like --key value)"))
    values = vars(args)
    path = values.pop('config', None)
    overrides: Dict[str, Any] = {}
    for key, raw in values.items():
        default = _default(key)
        if isinstance(default, dict):
            overrides[key] = parse_key_value_pairs(raw, _dash(key))
        elif isinstance(default, tuple):
            overrides[key] = [yaml.safe_load(v) for v in raw]
        elif isinstance(default, (bool, str)):
            overrides[key] = raw
        else:
            overrides[key] = yaml.safe_load(raw)
    return path, overrides


def parse_overrides(argv: Sequence[str]) -> Dict[str, Any]:
    """Only the ``--key value`` flags (no config file) as a dict of raw values."""
    path, overrides = parse_flags(argv)
    if path:
        raise ConfigError('-c/--config is not a config key')
    return overrides


def parse_train_args(argv: Sequence[str]) -> TrainConfig:
    """``-c FILE`` plus any ``--key value`` flags, resolved into a checked :class:`TrainConfig`."""
    path, overrides = parse_flags(argv)
    return build_config(path, overrides)


def parse_key_value_pairs(values: List[str], flag: str) -> Dict[str, Any]:
    """``['key_dim=384', 'depth=6']`` -> ``{'key_dim': 384, 'depth': 6}`` (values parsed as YAML)."""
    pairs = {}
    for value in values:
        key, sep, text = value.partition('=')
        if not sep or not key:
            raise ConfigError(f"bad value '{value}' for '{flag}' (expected key=value pairs)")
        pairs[key] = yaml.safe_load(text)
    return pairs

