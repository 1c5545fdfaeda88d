"""Datasets, samplers, loaders and mixup for training and evaluation, all built from timm's data pipeline.

Mid-epoch resume: the sample order of an epoch is a function of (seed, epoch) alone (:class:`EpochSeededSampler` in
a single process, torch's / timm's distributed samplers otherwise), never of the global RNG, so a fresh data-loader
iterator (which first draws its workers' base seed from the global RNG) replays the same order.
:class:`SkipFirstSampler` wraps the training loader's sampler, skips the batches already trained without loading
them, and then calls back (the resume restores the RNG state saved at the stop there), so that what runs in the main
process afterwards (augmentation with ``num_workers=0``, mixup, drop path) draws the same numbers as an
uninterrupted run. Data-loader workers are restarted and reseeded, so with ``num_workers > 0`` their augmentations
differ from the uninterrupted run; the samples they load do not.

Pillow >= 13 rejects ``ImageOps.posterize(img, 0)``; timm's RandAugment ``PosterizeIncreasing`` (DeiT's
``rand-m9-mstd0.5-inc1``) asks for 0 bits whenever the sampled magnitude reaches 10, which crashes a data worker.
Keeping 0 bits meant an all-black image before Pillow 13, so that is what :func:`posterize` returns.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Sized

import numpy as np
import torch
from PIL import Image, ImageOps
from timm.data import (FastCollateMixup, ImageDataset, Mixup, auto_augment, create_dataset, create_loader,
                       resolve_data_config)
from timm.data.dataset_factory import _EVAL_SYNONYM, _TRAIN_SYNONYM, _search_split

from ..weights_io import one_line
from .config import ConfigError, DataError, TrainConfig
from .distributed import DistInfo

def posterize(img: Image.Image, bits_to_keep: int, **kwargs) -> Image.Image:
    """timm's posterize op, with ``bits_to_keep <= 0`` giving the black image older Pillow produced."""
    if bits_to_keep <= 0:
        return ImageOps.posterize(img, 1).point(lambda _: 0)
    return auto_augment.posterize(img, bits_to_keep, **kwargs)


def patch_timm_posterize() -> None:
    """Route timm's Posterize* RandAugment ops through :func:`posterize` (idempotent)."""
    for name, fn in list(auto_augment.NAME_TO_OP.items()):
        if fn is auto_augment.posterize:
            auto_augment.NAME_TO_OP[name] = posterize


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
    split_dir = _search_split(root, split)  # where timm's create_dataset will look
    if os.path.isfile(split_dir) and split_dir.endswith('.tar'):
        return  # a tar archive of class folders, read by timm's tar reader
    if split_dir == root:
        synonyms = next((list(s) for s in (_TRAIN_SYNONYM, _EVAL_SYNONYM) if split.split('[')[0] in s), [split])
        others = [s for s in (*_TRAIN_SYNONYM, *_EVAL_SYNONYM) if os.path.isdir(os.path.join(root, s))]
        if others:  # root has split folders, just not this one: timm would read the whole root as this split
            raise DataError(f"data directory {os.path.abspath(root)} has no '{split}' split folder (looked for "
                            f"{', '.join(synonyms)}; found {', '.join(others)})")
    for _, _, files in os.walk(split_dir, onerror=_unreadable):
        if any(f.lower().endswith(IMG_EXTENSIONS) for f in files):
            return
    raise DataError(f'no images found in data directory: {os.path.abspath(split_dir)}')


def _unreadable(error: OSError) -> None:
    raise DataError(f'cannot read data directory {os.path.abspath(error.filename)}: {error.strerror}')


class CheckedImageDataset(ImageDataset):
    """timm's ``ImageDataset`` where an unreadable or truncated image is a :class:`DataError` naming the file,
    instead of timm's silent substitution of the next sample; with ``skip_bad`` it is replaced by the next readable
    image, warned about once per process and counted (``skipped()``: distinct files, over all data-loader workers).
    """

    bad_image_hint = 'set skip_bad_images: true to skip unreadable images'  # what a user can do (train / eval)

    def enable_checks(self, skip_bad: bool) -> None:
        self.skip_bad = skip_bad
        self._bad = torch.zeros(len(self.reader), dtype=torch.uint8).share_memory_()  # shared with the workers
        self._warned: set = set()

    def skipped(self) -> int:
        """How many distinct files were found unreadable and skipped so far."""
        return int(self._bad.sum())

    def _path(self, index: int) -> str:
        name = self.reader.filename(index, absolute=True)
        return os.path.abspath(name) if os.path.exists(name) else name

    def __getitem__(self, index):
        first = index
        while True:
            try:
                img, target, *features = self.reader[index]
                if self.load_bytes:
                    img = img.read()
                else:
                    img = Image.open(img)
                    img = img.convert(self.input_img_mode) if self.input_img_mode else img
                    img.load()  # decode now, so a truncated file fails here, named
                break
            except (OSError, SyntaxError, ValueError) as e:  # PIL: unidentified, truncated or broken image data
                path = self._path(index)
                if not self.skip_bad:
                    raise DataError(f'cannot read image {path}: {one_line(e)} ({self.bad_image_hint})') from None
                self._bad[index] = 1
                if path not in self._warned:
                    self._warned.add(path)
                    print(f'warning: skipped unreadable image {path}: {one_line(e)}', file=sys.stderr, flush=True)
                index = (index + 1) % len(self.reader)
                if index == first:
                    raise DataError(f'no readable image in {os.path.abspath(getattr(self.reader, "root", ""))}') \
                        from None
        if self.transform is not None:
            img = self.transform(img)
        if target is None:
            target = -1
        elif self.target_transform is not None:
            target = self.target_transform(target)
        if self.additional_features is None:
            return img, target
        return img, target, *features


def build_dataset(dataset: str, root: str, split: str, is_training: bool, batch_size: int = 1,
                  seed: int = 0, repeats: int = 0, download: bool = False,
                  skip_bad_images: bool = False) -> torch.utils.data.Dataset:
    """One split via ``timm.data.create_dataset``; ImageFolder roots are checked first for a clear error.

    ``torch/fashion_mnist`` is read from ``root/FashionMNIST/raw`` (see :mod:`collab_vit.training.datasets` for getting
    the files offline); ``download`` lets torchvision fetch a missing torch dataset. Image-file datasets read through
    :class:`CheckedImageDataset`: an unreadable image is an error naming it, or skipped and counted with
    ``skip_bad_images``.
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
                        f"(split '{split}'): {one_line(e)}") from e
    try:
        n = len(ds)
    except TypeError:  # some iterable datasets only know their size once loading starts
        n = None
    if n == 0:
        raise DataError(f'no images found in data directory: {os.path.abspath(root)} (split {split})')
    if type(ds) is ImageDataset:
        ds.__class__ = CheckedImageDataset  # same state, checked reads
        ds.enable_checks(skip_bad_images)
    return ds


def class_names(dataset) -> Optional[Dict[str, int]]:
    """The class-folder -> index map of an ImageFolder / tar dataset (None for readers without one)."""
    return getattr(getattr(dataset, 'reader', None), 'class_to_idx', None)


def check_classes(train_set, val_set, root: str, num_classes: int) -> None:
    """Train and val must hold the same class folders, and ``num_classes`` must be their number (DataError/
    ConfigError naming the difference); datasets without a class map are not checked."""
    train, val = class_names(train_set), class_names(val_set)
    if train and val and set(train) != set(val):
        parts = []
        for where, names in (('train', sorted(set(train) - set(val))), ('val', sorted(set(val) - set(train)))):
            if names:
                parts.append(f'only in {where}: ' + ', '.join(names[:5]) + (' ...' if len(names) > 5 else ''))
        raise DataError(f'class folders differ between the train and val splits of {os.path.abspath(root)} '
                        f'({"; ".join(parts)})')
    if train and len(train) != num_classes:
        raise ConfigError(f'num_classes is {num_classes} but {os.path.abspath(root)} has {len(train)} classes: '
                          f'set --num-classes {len(train)}')


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


def epoch_seed(seed: int, epoch: int) -> int:
    """A 64-bit seed from ``seed`` and ``epoch`` (numpy's SeedSequence: (s, e + 1) and (s + 1, e) differ)."""
    return int(np.random.SeedSequence([seed % 2 ** 64, epoch]).generate_state(1, np.uint64)[0])


class EpochSeededSampler(torch.utils.data.Sampler):
    """A random permutation of ``data_source`` drawn from its own generator seeded by (seed, epoch), like torch's
    ``DistributedSampler`` for one process: the order depends on nothing else (not the global RNG, not how often or
    when an iterator is created). ``set_epoch`` selects the epoch's permutation."""

    def __init__(self, data_source: Sized, seed: int = 0) -> None:
        self.data_source = data_source
        self.seed = seed
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(epoch_seed(self.seed, self.epoch))
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()

    def __len__(self) -> int:
        return len(self.data_source)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class SkipFirstSampler(torch.utils.data.Sampler):
    """``sampler`` with its first ``skip`` indices dropped; ``set_epoch`` passes through.

    The wrapped sampler draws its whole permutation as before (its order must not depend on the global RNG: see
    :class:`EpochSeededSampler`). When ``after_skip`` is set, it is called once the skipped indices are drawn
    (before the first kept one is used), then forgotten.
    """

    def __init__(self, sampler: torch.utils.data.Sampler, skip: int = 0) -> None:
        self.sampler = sampler
        self.skip = skip
        self.after_skip: Optional[Callable[[], None]] = None

    def __iter__(self) -> Iterator[int]:
        for i, index in enumerate(self.sampler):
            if i < self.skip:
                continue
            if self.after_skip is not None:
                self.after_skip()
                self.after_skip = None
            yield index

    def __len__(self) -> int:
        return max(len(self.sampler) - self.skip, 0)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, 'set_epoch'):
            self.sampler.set_epoch(epoch)


def make_skippable(loader) -> SkipFirstSampler:
    """Wrap the sampler of a timm training loader (DataLoader or timm's PrefetchLoader) in a SkipFirstSampler."""
    inner = getattr(loader, 'loader', loader)  # timm's PrefetchLoader keeps the DataLoader in .loader
    batch_sampler = inner.batch_sampler
    wrapped = SkipFirstSampler(batch_sampler.sampler)
    batch_sampler.sampler = wrapped
    return wrapped


class ImageMode:
    """A PIL image converted to the model's ``channels`` (1: ``L``, 3: ``RGB``; others as they are), as timm's
    ``ImageDataset`` converts a folder's images to RGB: a grayscale set (``torch/fashion_mnist``) feeds a
    three-channel model, and an RGB one a one-channel model, as timm's folders do."""

    def __init__(self, channels: int) -> None:
        self.mode = {1: 'L', 3: 'RGB'}.get(channels)

    def __call__(self, img):
        return img.convert(self.mode) if self.mode and isinstance(img, Image.Image) and img.mode != self.mode else img

    def __repr__(self) -> str:
        return f'{type(self).__name__}({self.mode})'


def in_channels(loader, channels: int):
    """``loader`` whose dataset's images are first converted to ``channels`` (``ImageMode``); the loader."""
    from torchvision.transforms import Compose

    dataset = getattr(loader, 'loader', loader).dataset  # timm's PrefetchLoader keeps the DataLoader in .loader
    dataset = getattr(dataset, 'dataset', dataset)  # a Subset's
    dataset.transform = Compose([ImageMode(channels), dataset.transform])
    return loader


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
    in_channels(loader, data_cfg['input_size'][0])
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
    return in_channels(create_loader(
        dataset, input_size=data_cfg['input_size'], batch_size=batch_size, is_training=False,
        use_prefetcher=use_prefetcher, device=dist_info.device, interpolation=data_cfg['interpolation'],
        mean=data_cfg['mean'], std=data_cfg['std'], crop_pct=data_cfg['crop_pct'],
        crop_mode=data_cfg.get('crop_mode'), num_workers=num_workers, distributed=dist_info.distributed,
        pin_memory=pin_memory and use_prefetcher, persistent_workers=persistent_workers), data_cfg['input_size'][0])


def shard_size(num_samples: int, dist_info: DistInfo) -> int:
    """Real (unpadded) samples on this rank under timm's ``OrderedDistributedSampler``."""
    return len(range(dist_info.rank, num_samples, dist_info.world_size))


def eval_shard_size(dataset, dist_info: DistInfo, num_workers: int) -> Optional[int]:
    """The real samples of this rank's eval shard, which the eval loop keeps (dropping the sampler's padding).

    A map-style set is cut by timm's ``OrderedDistributedSampler`` (which pads to equal shards). An iterable set
    (``wds/``, ``hfds/``, ``tfds/``) is split by its reader over ranks x workers, which yields each sample once
    already: None (no cap; its ``len`` is per rank). Where its shards do not split evenly over ranks x workers,
    some ranks repeat samples and others miss some (timm's readers fill every worker to the same length): warned,
    with the counts.
    """
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        return shard_size(len(dataset), dist_info)
    reader = getattr(dataset, 'reader', None)
    shards = len(getattr(getattr(reader, 'split_info', None), 'filenames', ()) or ())
    readers = dist_info.world_size * max(num_workers, 1)
    if shards and readers > 1 and shards % readers and dist_info.is_main:
        print(f'warning: the eval set has {shards} shards for {dist_info.world_size} process(es) x '
              f'{max(num_workers, 1)} worker(s) = {readers} readers: {shards % readers} reader(s) get one shard more, '
              f'so evaluation may repeat or miss samples (use a number of shards divisible by {readers})',
              file=sys.stderr, flush=True)
    return None

