"""Datasets, loaders and mixup for training and evaluation, all built from timm's data pipeline."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence

import torch
from timm.data import FastCollateMixup, Mixup, create_dataset, create_loader, resolve_data_config

from .compat import patch_timm_posterize
from .config import TrainConfig
from .distributed import DistInfo
from .errors import DataError
from .preemption import EpochSeededSampler

patch_timm_posterize()

IMG_EXTENSIONS = ('.png', '.jpg', '.jpeg', '.bmp', '.ppm', '.pgm', '.tif', '.tiff', '.webp')


def _is_folder_dataset(dataset: str) -> bool:
    return dataset in ('', 'folder', 'imagefolder') or dataset.startswith(('folder/', 'imagefolder/'))


def check_image_folder(root: str, split: str) -> None:
    """Fail early, naming the path, when an ImageFolder root or its split holds no images."""
    if not root:
        raise DataError('no data directory given (set data_dir in the config or pass --data-dir DIR)')
    if not os.path.isdir(root):
        raise DataError(f'data directory not found: {os.path.abspath(root)}')
    candidates = [split] + (['val'] if split == 'validation' else []) + (['validation'] if split == 'val' else [])
    split_dir = next((os.path.join(root, s) for s in candidates if os.path.exists(os.path.join(root, s))), root)
    if os.path.isfile(split_dir) and split_dir.endswith('.tar'):
        return  # a tar archive of class folders, read by timm's tar reader
    for _, _, files in os.walk(split_dir):
        if any(f.lower().endswith(IMG_EXTENSIONS) for f in files):
            return
    raise DataError(f'no images found in data directory: {os.path.abspath(split_dir)}')


def build_dataset(dataset: str, root: str, split: str, is_training: bool, batch_size: int = 1,
                  seed: int = 0, repeats: int = 0, download: bool = False) -> torch.utils.data.Dataset:
    """One split via ``timm.data.create_dataset``; ImageFolder roots are checked first for a clear error.

    ``torch/fashion_mnist`` is read from ``root/FashionMNIST/raw`` (see :mod:`collab_vit.training.datasets` for getting
    the files offline); ``download`` lets torchvision fetch a missing torch dataset.
    """
    if dataset == 'torch/fashion_mnist' and not download:
        from .datasets import check_fashion_mnist
        check_fashion_mnist(root)
    if dataset == 'sklearn/digits':
        from .datasets import ensure_digits
        ensure_digits(root)
        dataset = ''
    if _is_folder_dataset(dataset):
        check_image_folder(root, split)
    try:
        ds = create_dataset(dataset, root=root, split=split, is_training=is_training, batch_size=batch_size,
                            seed=seed, repeats=repeats, download=download)
    except (FileNotFoundError, RuntimeError, AssertionError) as e:
        raise DataError(f"cannot read dataset '{dataset or 'folder'}' at {os.path.abspath(root)} "
                        f"(split '{split}'): {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    try:
        n = len(ds)
    except TypeError:  # some iterable datasets only know their size once loading starts
        n = None
    if n == 0:
        raise DataError(f'no images found in data directory: {os.path.abspath(root)} (split {split})')
    return ds


def eval_data_config(img_size: int, crop_pct: float, model: Optional[torch.nn.Module] = None, in_chans: int = 3,
                     mean: Sequence[float] = (), std: Sequence[float] = ()) -> Dict[str, Any]:
    """DeiT's eval pipeline: bicubic resize to img_size / crop_pct, centre crop img_size; ``mean``/``std`` (one
    value, or one per channel) or else the model's defaults, which fit 3-channel images only."""
    args: Dict[str, Any] = {'input_size': (in_chans, img_size, img_size), 'crop_pct': crop_pct,
                            'interpolation': 'bicubic'}
    for key, value in (('mean', mean), ('std', std)):
        if value:
            if len(value) not in (1, in_chans):
                raise DataError(f'{key} has {len(value)} values; give 1 or in_chans ({in_chans})')
            args[key] = tuple(value)
        elif in_chans != 3:
            raise DataError(f'in_chans is {in_chans}: set {key} to the dataset\'s own per-channel {key} '
                            f'(the model default is for 3-channel ImageNet images)')
    return resolve_data_config(args, model=model)


def build_mixup(cfg: TrainConfig, fast: bool) -> Optional[Mixup]:
    """Mixup/CutMix with label smoothing (``FastCollateMixup`` for the GPU prefetcher path), or None when off."""
    if not (cfg.mixup > 0 or cfg.cutmix > 0):
        return None
    cls = FastCollateMixup if fast else Mixup
    return cls(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, prob=cfg.mixup_prob, switch_prob=cfg.mixup_switch_prob,
               mode=cfg.mixup_mode, label_smoothing=cfg.smoothing, num_classes=cfg.num_classes)


def build_train_loader(cfg: TrainConfig, dataset, data_cfg: Dict[str, Any], dist_info: DistInfo,
                       collate_fn=None) -> torch.utils.data.DataLoader:
    """DeiT's training pipeline (RandAugment, random erasing, bicubic, repeated augmentation when distributed).

    The sample order of an epoch never depends on the global RNG, so a resumed epoch replays the order of the
    uninterrupted one with or without data-loader workers: distributed, timm picks torch's ``DistributedSampler``
    or its ``RepeatAugSampler`` (seeded by the epoch); in one process its ``RandomSampler`` (drawn from the global
    RNG, which a fresh iterator first advances to seed its workers) is replaced by an :class:`EpochSeededSampler`
    seeded by (``cfg.seed``, epoch).
    """
    use_prefetcher = dist_info.device.type == 'cuda'
    loader = create_loader(
        dataset, input_size=data_cfg['input_size'], batch_size=cfg.batch_size, is_training=True,
        use_prefetcher=use_prefetcher, device=dist_info.device, re_prob=cfg.reprob, re_mode=cfg.remode,
        re_count=cfg.recount, scale=tuple(cfg.scale), hflip=cfg.hflip, color_jitter=cfg.color_jitter,
        auto_augment=cfg.aa or None, num_aug_repeats=cfg.repeated_aug if dist_info.distributed else 0,
        interpolation=cfg.train_interpolation, mean=data_cfg['mean'], std=data_cfg['std'],
        num_workers=cfg.num_workers, distributed=dist_info.distributed, collate_fn=collate_fn,
        pin_memory=cfg.pin_memory and use_prefetcher, persistent_workers=cfg.persistent_workers)
    inner = getattr(loader, 'loader', loader)  # timm's PrefetchLoader keeps the DataLoader in .loader
    if not isinstance(inner.sampler, torch.utils.data.RandomSampler):
        return loader  # distributed (epoch-seeded) or an iterable dataset (no sampler)
    # timm's create_loader takes no sampler: the same DataLoader again with ours (no worker has started yet)
    rebuilt = type(inner)(
        inner.dataset, batch_size=inner.batch_size, sampler=EpochSeededSampler(inner.dataset, cfg.seed),
        num_workers=inner.num_workers, collate_fn=inner.collate_fn, pin_memory=inner.pin_memory,
        drop_last=inner.drop_last, timeout=inner.timeout, worker_init_fn=inner.worker_init_fn,
        multiprocessing_context=inner.multiprocessing_context, generator=inner.generator,
        prefetch_factor=inner.prefetch_factor, persistent_workers=inner.persistent_workers,
        pin_memory_device=inner.pin_memory_device, in_order=inner.in_order)
    if inner is loader:
        return rebuilt
    loader.loader = rebuilt
    return loader


def build_eval_loader(dataset, data_cfg: Dict[str, Any], batch_size: int, num_workers: int, dist_info: DistInfo,
                      pin_memory: bool = True, persistent_workers: bool = False) -> torch.utils.data.DataLoader:
    """Ordered eval loader; when distributed each rank reads a shard (padding is dropped by the eval loop)."""
    use_prefetcher = dist_info.device.type == 'cuda'
    return create_loader(
        dataset, input_size=data_cfg['input_size'], batch_size=batch_size, is_training=False,
        use_prefetcher=use_prefetcher, device=dist_info.device, interpolation=data_cfg['interpolation'],
        mean=data_cfg['mean'], std=data_cfg['std'], crop_pct=data_cfg['crop_pct'],
        crop_mode=data_cfg.get('crop_mode'), num_workers=num_workers, distributed=dist_info.distributed,
        pin_memory=pin_memory and use_prefetcher, persistent_workers=persistent_workers)


def shard_size(num_samples: int, dist_info: DistInfo) -> int:
    """Real (unpadded) samples on this rank under timm's ``OrderedDistributedSampler``."""
    return len(range(dist_info.rank, num_samples, dist_info.world_size))

