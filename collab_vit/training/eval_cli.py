"""Evaluate a model on a validation set: top-1, top-5, loss and throughput, printed and written as JSON.

Weights come from our training checkpoints (model or EMA), ``.safetensors`` exports (model name and kwargs read
from the metadata), folders in timm's hub layout (``collab_vit.save_pretrained``) or plain timm/DeiT ``.pth`` files.
Runs on one process or under ``torchrun`` (metrics reduced).

The evaluation pipeline (input size, crop_pct, crop_mode, interpolation, mean/std): the flags, else what the
checkpoint records (a training export, a converted file or folder: its source's), else the model's ``pretrained_cfg``
(timm's cfg of the weights for a timm model). A source and its conversion are thus evaluated alike; the results JSON
records the pipeline used (``data_config``).
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..layers.attention import CollaborativeAttention
from ..console import run_command
from ..weights_io import WriteError, atomic_write, model_pipeline, read_weights
from .build import build_model, fit_state, is_standard_attention_state, source_weights_pipeline
from .config import BAD_INPUT, WORKERS_HELP, ConfigError, Parser, default_workers, parse_key_value_pairs
from .data import build_dataset, build_eval_loader, eval_data_config, eval_shard_size
from .distributed import cleanup_distributed, init_distributed
from .engine import accuracy_text, autocast_context, evaluate


def build_parser() -> argparse.ArgumentParser:
    """eval.py's flags; timm's validate.py spellings (-b, -j, --data, --results-file) are accepted too."""
    p = Parser(prog='eval.py', description=__doc__.splitlines()[0], allow_abbrev=False,
                epilog='Examples:\n  python eval.py --checkpoint runs/b192/model.safetensors --data-dir /data/imagenet\n'
                       '  python eval.py --model deit_base_patch16_224 --checkpoint deit_base.pth --data-dir /data/imagenet\n'
                       '  python eval.py --checkpoint converted_b384/ --data-dir /data/imagenet   (save_pretrained folder)',
                formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_argument_group('model')
    model.add_argument('--model', default='', help='timm model name (default: read from the checkpoint)')
    model.add_argument('--checkpoint', '--initial-checkpoint', default='',
                       help='.pth (ours or timm/DeiT), .safetensors, or a folder written by collab_vit.save_pretrained '
                            '(config.json + model.safetensors); default: none, random init')
    model.add_argument('--use-ema', action='store_true', help='evaluate the EMA weights of a training checkpoint')
    model.add_argument('--model-kwargs', nargs='*', default=[], metavar='KEY=VALUE', help='extra timm.create_model keywords, e.g. key_dim=384 (default: none, the '
                            'checkpoint\'s)')
    model.add_argument('--num-classes', type=int, default=None, help='default: checkpoint metadata or head size')
    data = p.add_argument_group('data')
    data.add_argument('--data-dir', '--data', required=True,
                      help='dataset root (ImageFolder with a val/ split, or see --dataset)')
    data.add_argument('--dataset', default='', help="timm dataset name: torch/fashion_mnist, wds/..., "
                                                     "hfds/... (default: '', ImageFolder)")
    data.add_argument('--split', default='validation', help='split to evaluate (default: validation)')
    data.add_argument('--dataset-download', action='store_true', help='let torchvision / TFDS / HF readers download')
    data.add_argument('--img-size', type=int, default=None, help='default: checkpoint metadata or model default')
    data.add_argument('--in-chans', type=int, default=None, help='default: checkpoint metadata, else 3')
    data.add_argument('--crop-pct', type=float, default=None,
                      help="default: as the checkpoint records (training, or a conversion's source), else the "
                           "model's pretrained cfg (timm's DeiT weights: 0.9; our models from scratch: 0.875)")
    data.add_argument('--mean', type=float, nargs='+', default=None, help='default: as recorded, else the model\'s')
    data.add_argument('--std', type=float, nargs='+', default=None, help='default: as recorded, else the model\'s')
    data.add_argument('--data-config-from', default='', metavar='CHECKPOINT',
                      help="evaluate with the pipeline another checkpoint records (file or folder), e.g. a "
                           "fine-tuned model scored with its conversion's (= its source's) pipeline (default: none, "
                           "this checkpoint's)")
    data.add_argument('-b', '--batch-size', type=int, default=128, help='images per batch (default: %(default)s)')
    data.add_argument('-j', '--workers', type=int, default=default_workers(4),
                      help=f'data-loader worker processes (default: %(default)s: {WORKERS_HELP.format(most=4)})')
    run = p.add_argument_group('run')
    run.add_argument('--device', default='', help="e.g. cuda:1 (default: '', cuda when available, else cpu)")
    run.add_argument('--amp', action='store_true', help='bfloat16 autocast on GPU')
    run.add_argument('--cpu-threads', type=int, default=0,
                     help="torch intra-op threads; 0 = torch's default (default: %(default)s)")
    run.add_argument('--output', '--results-file', default='', help='write the results here as JSON (default: none, '
                                                                  'printed only)')
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def eval_pipeline(args: argparse.Namespace, recorded: Optional[Dict[str, Any]],
                  model: torch.nn.Module) -> Dict[str, Any]:
    """The data config to evaluate with (module docstring): flags > the checkpoint's record > the model's cfg."""
    flags = args.img_size or args.crop_pct or args.mean or args.std or args.in_chans
    if recorded and not flags:  # JSON gives lists; as tuples the transforms are those of the model's own cfg
        return {k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items()}
    base = dict(recorded or model_pipeline(model))
    in_chans = args.in_chans or model.patch_embed.proj.in_channels
    size = args.img_size or (model.patch_embed.img_size or (224,))[0]

    def fits(values: Any) -> Any:  # a 3-channel default does not describe other inputs (eval_data_config says so)
        return values if values and len(values) in (1, in_chans) and (recorded or in_chans == 3) else ()

    data_cfg = eval_data_config(size, args.crop_pct or base.get('crop_pct') or 0.875, model, in_chans,
                                args.mean or fits(base.get('mean')), args.std or fits(base.get('std')))
    data_cfg.update({k: base[k] for k in ('interpolation', 'crop_mode') if base.get(k)})
    return data_cfg


def load_model(args: argparse.Namespace) -> Tuple[torch.nn.Module, str, Dict[str, Any], Optional[Dict[str, Any]]]:
    """The model named by the flags or the checkpoint, with the checkpoint's weights: (model, name, keywords, the
    data config its weights are evaluated with when the flags name none)."""
    state, meta = read_weights(args.checkpoint, args.use_ema) if args.checkpoint else ({}, {})
    name = args.model or meta.get('model_name', '')
    if not name:
        raise ConfigError('no --model given and the checkpoint does not record its model name')
    kwargs = dict(meta.get('model_kwargs') or {}) if meta.get('model_name', name) == name else {}
    kwargs.update(parse_key_value_pairs(args.model_kwargs, '--model-kwargs'))
    num_classes = args.num_classes or kwargs.pop('num_classes', None)
    kwargs.pop('num_classes', None)
    if num_classes is None:
        num_classes = state['head.weight'].shape[0] if 'head.weight' in state else 1000
    img_size = args.img_size or kwargs.pop('img_size', None)
    kwargs.pop('img_size', None)
    if args.in_chans:
        kwargs['in_chans'] = args.in_chans
    try:
        model = build_model(name, num_classes, img_size, 0.0, kwargs)
    except ConfigError as e:
        if meta.get('model_name') and not args.model:  # the name and keywords came from the file
            raise ConfigError(f'{e} (as recorded in the metadata of {os.path.abspath(args.checkpoint)})') from None
        raise
    recorded = meta.get('data_config')
    if state:
        converts = is_standard_attention_state(state) and any(
            isinstance(m, CollaborativeAttention) for m in model.modules())  # fit_state converts them on load
        model.load_state_dict(fit_state(model, state, args.checkpoint), strict=True)
        if converts and not recorded:  # timm/DeiT weights converted on load: evaluated as timm evaluates them
            recorded = source_weights_pipeline(name, model)
    return model, name, kwargs, recorded


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Build the model, load its weights, evaluate; returns the results dict (written to ``--output``)."""
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    dist_info = init_distributed(args.device)
    try:
        model, name, kwargs, recorded = load_model(args)
        model.to(dist_info.device)
        if args.data_config_from:
            recorded = read_weights(args.data_config_from)[1].get('data_config')
            if not recorded:
                raise ConfigError(f'--data-config-from {args.data_config_from} records no data config')
        data_cfg = eval_pipeline(args, recorded, model)
        dataset = build_dataset(args.dataset, args.data_dir, args.split, is_training=False,
                                download=args.dataset_download)
        loader = build_eval_loader(dataset, data_cfg, args.batch_size, args.workers, dist_info)
        metrics = evaluate(model, loader, dist_info, eval_shard_size(dataset, dist_info, args.workers),
                           autocast_context(dist_info.device, args.amp, 'bfloat16'), progress=True)
        results = {'model': name, 'model_kwargs': kwargs, 'checkpoint': args.checkpoint, 'use_ema': args.use_ema,
                   'num_params': sum(p.numel() for p in model.parameters()),
                   'data_config': {k: list(v) if isinstance(v, tuple) else v for k, v in data_cfg.items()}, **metrics}
        if dist_info.is_main:
            print(f"{name}: {accuracy_text(metrics)} | loss {metrics['loss']:.4f} "
                  f"| {metrics['img_per_s']:.0f} img/s | {metrics['num_samples']} images", flush=True)
            if args.output:
                text = json.dumps(results, indent=2)
                atomic_write(args.output, lambda f: f.write(text.encode()))
        return results
    finally:
        cleanup_distributed()


def main(argv: Optional[List[str]] = None) -> int:
    """Console entry for ``eval.py`` (``console.run_command``): config, data and checkpoint errors are one line, exit
    2; a failed write of ``--output`` (a full disk) one line, exit 1; SIGINT / SIGTERM one line, exit 130 / 143."""
    return run_command(lambda: run(parse_args(argv)), BAD_INPUT, (WriteError,),
                       after_signal='; no --output was written')
