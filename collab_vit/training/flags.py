"""``train.py``'s command line: ``-c CONFIG`` plus one flag per config key, ``--help`` grouped like timm's train.py.

Every field of :class:`~collab_vit.training.config.TrainConfig` is a flag (``--key-name`` or ``--key_name``);
booleans also take ``--no-key-name``; ``--model-kwargs a=1 b=2`` fills a dict. timm's spellings are accepted for
the same meaning (``ALIASES``; the README has the table). An unknown flag is a one-line error naming the closest key.
Values go through the same checks as YAML values (``config._coerce``).
"""
from __future__ import annotations

import argparse
import difflib
from typing import Any, Dict, List, Optional, Sequence

import yaml

from .config import FIELDS, ConfigError, TrainConfig, _default, build_config

# One line of help per key, in the groups of timm's train.py.
GROUPS: Dict[str, Dict[str, str]] = {
    'model': {
        'model': 'timm model name, e.g. collab_deit_base_patch16_224 (import collab_vit registers them)',
        'model_kwargs': 'extra timm.create_model keywords as key=value pairs, e.g. key_dim=192 mixing_init=random',
        'num_classes': 'number of classes (must cover the data set\'s class folders)',
        'img_size': 'input image size in pixels (square)',
        'in_chans': 'image channels (1 for grayscale data such as Fashion-MNIST)',
        'drop_path': 'stochastic depth rate',
        'checkpoint': 'initial weights: a training checkpoint, .safetensors export, timm/DeiT .pth or a '
                      'save_pretrained folder (fine-tuning)',
    },
    'data': {
        'data_dir': 'dataset root (ImageFolder with train/ and val/, tar files, WebDataset shards, ...)',
        'dataset': "timm dataset name: '' (ImageFolder), torch/fashion_mnist, wds/..., hfds/..., tfds/..., "
                   "sklearn/digits",
        'train_split': 'training split name',
        'val_split': "validation split name ('validation' also finds a val/ folder)",
        'dataset_download': 'let torchvision / TFDS / HF readers download a missing data set',
        'mean': "per-channel normalisation mean (one value or one per channel); empty = the model's (ImageNet)",
        'std': "per-channel normalisation std (one value or one per channel); empty = the model's (ImageNet)",
        'num_workers': 'data-loader worker processes per training process',
        'pin_memory': 'pin host memory for faster GPU copies',
        'persistent_workers': 'keep data-loader workers alive between epochs',
        'skip_bad_images': 'replace an unreadable or truncated image by the next one and count it (default: stop, '
                           'naming the file)',
    },
    'augmentation': {
        'aa': "auto-augment policy, e.g. rand-m9-mstd0.5-inc1 (RandAugment); '' disables",
        'reprob': 'random-erasing probability',
        'remode': 'random-erasing mode (pixel, rand, const)',
        'recount': 'random-erasing count',
        'hflip': 'horizontal-flip probability',
        'color_jitter': 'color-jitter factor (0 disables; unused when aa is set, as in timm)',
        'scale': 'random-resized-crop area range (two floats)',
        'train_interpolation': 'training resize interpolation',
        'crop_pct': 'evaluation centre-crop fraction (DeiT: 0.875 = resize 256, crop 224)',
        'mixup': 'mixup alpha (0 disables)',
        'cutmix': 'cutmix alpha (0 disables)',
        'mixup_prob': 'probability of applying mixup or cutmix per batch',
        'mixup_switch_prob': 'probability of cutmix instead of mixup when both are on',
        'mixup_mode': 'mixup mode: batch, pair or elem',
        'smoothing': 'label smoothing',
        'repeated_aug': "repeated-augmentation copies per image when distributed (DeiT's RASampler); 0 disables",
    },
    'optimizer': {
        'epochs': 'training epochs',
        'batch_size': 'batch size per process',
        'accum_steps': 'gradient-accumulation steps per optimizer update',
        'opt': 'timm optimizer name (adamw, sgd, lamb, ...)',
        'lr': 'learning rate at a global batch of lr_base_batch; scaled linearly to the actual global batch',
        'lr_base_batch': 'global batch at which lr is given',
        'weight_decay': 'weight decay (none on norms, biases, position embedding, class token, mixing matrices)',
        'layer_decay': 'layer-wise learning-rate decay (e.g. 0.65 for fine-tuning); 0 disables',
        'mixing_lr_scale': 'learning-rate multiplier of the mixing matrices (param-group lr_scale; composes with '
                           'layer_decay); 1 leaves timm\'s groups unchanged',
        'opt_eps': 'optimizer epsilon',
        'momentum': 'SGD momentum',
        'clip_grad': 'gradient clipping threshold; 0 disables',
        'clip_mode': 'gradient clipping mode: norm, value or agc',
        'skip_nonfinite_loss': 'skip (and count) a batch whose loss is NaN/inf instead of stopping the run',
        'max_nonfinite_skips': 'with skip_nonfinite_loss: stop after this many skipped batches in a row',
    },
    'scheduler': {
        'sched': 'learning-rate schedule (timm: cosine, step, plateau, ...)',
        'warmup_epochs': 'linear warm-up epochs',
        'warmup_lr': 'learning rate at the start of warm-up',
        'min_lr': 'lowest learning rate of the schedule',
        'sched_on_updates': 'step the schedule every optimizer update instead of every epoch',
    },
    'EMA': {
        'model_ema': 'keep an exponential moving average of the weights (evaluated and exported too)',
        'model_ema_decay': 'EMA decay per update',
        'model_ema_force_cpu': 'keep the EMA copy on the CPU',
    },
    'distributed and devices': {
        'amp': 'mixed precision on GPU (bf16/fp16 autocast); ignored on CPU',
        'amp_dtype': 'autocast dtype: bfloat16 or float16 (float16 uses a grad scaler)',
        'seed': 'random seed (data order, initialisation, augmentation)',
        'deterministic': 'deterministic algorithms (slower)',
        'device': "device: '' = cuda when available, else cpu",
        'cpu_threads': "torch intra-op threads per process; 0 = torch's default",
    },
    'run, checkpoints and logging': {
        'output': "run directory; '' = runs/<config name>",
        'resume': 'continue the run in --output from its last.pth (optimizer, schedule, EMA, RNG, data order)',
        'auto_resume': 'resume when <output>/last.pth exists, else start (torchrun --max-restarts, requeues)',
        'checkpoint_every': 'also keep epoch_NNNN.pth every N epochs; 0 disables',
        'eval_every': 'evaluate every N epochs (and always after the last)',
        'stop_after': 'leave after this many epochs in this invocation (continue with --resume); 0 = run to the end',
        'log_wandb': 'log to Weights & Biases (offline without an API key or network)',
        'wandb_project': 'wandb project',
        'experiment': "run name; '' = the output directory's name",
        'progress': 'progress on rank 0: a bar on a terminal, a plain line every log_interval updates in a log file',
        'log_interval': 'updates between progress lines when the output is not a terminal',
    },
}
HELP: Dict[str, str] = {key: text for group in GROUPS.values() for key, text in group.items()}

# timm's train.py spellings -> our keys (same meaning). timm's --lr is an absolute rate; ours is timm's --lr-base.
ALIASES: Dict[str, str] = {
    'workers': 'num_workers', 'grad_accum_steps': 'accum_steps', 'aug_repeats': 'repeated_aug',
    'pin_mem': 'pin_memory', 'initial_checkpoint': 'checkpoint', 'lr_base': 'lr', 'lr_base_size': 'lr_base_batch',
    'data': 'data_dir', 'drop_path_rate': 'drop_path', 'interpolation': 'train_interpolation',
}
SHORT: Dict[str, str] = {'-j': 'num_workers', '-b': 'batch_size'}


def _dash(key: str) -> str:
    return '--' + key.replace('_', '-')


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors that name the closest key (exit 2, no usage dump)."""

    def error(self, message: str) -> None:
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``train.py``: ``-c/--config`` and every config key, grouped, each with its default and help."""
    parser = _Parser(
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

