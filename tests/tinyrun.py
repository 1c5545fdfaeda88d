"""Helpers for the training/eval tests: a tiny random-image ImageFolder, tiny-model overrides, the ``tiny_data`` and
``tiny_fashion_mnist`` fixtures (import one into a test module to use it)."""
import os

import numpy as np
import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = 'collab_deit_tiny_patch16_224'
TINY_KWARGS = {'key_dim': 24, 'patch_size': 8, 'depth': 2, 'embed_dim': 48, 'num_heads': 3}


def make_image_folder(root, classes=3, train_per_class=8, val_per_class=4, size=16, seed=0):
    """Random RGB PNGs under root/{train,val}/class_<i>/; each class has its own mean colour (learnable)."""
    rng = np.random.default_rng(seed)
    for split, n in (('train', train_per_class), ('val', val_per_class)):
        for c in range(classes):
            folder = os.path.join(root, split, f'class_{c}')
            os.makedirs(folder, exist_ok=True)
            for i in range(n):
                base = np.zeros(3)
                base[c % 3] = 160
                img = np.clip(base + rng.normal(0, 40, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(img).save(os.path.join(folder, f'{i}.png'))
    return str(root)


def tiny_overrides(data_dir, output, **extra):
    """Config overrides for a few CPU steps of a tiny model on the tiny ImageFolder."""
    cfg = dict(model=TINY_MODEL, model_kwargs=dict(TINY_KWARGS), num_classes=3, img_size=32, data_dir=data_dir,
               output=output, batch_size=4, epochs=2, warmup_epochs=1, lr=1e-3, lr_base_batch=4, num_workers=0,
               pin_memory=False, persistent_workers=False, progress=False, cpu_threads=1, device='cpu',
               checkpoint_every=0)
    cfg.update(extra)
    return cfg


def to_flags(overrides):
    """The same overrides as command-line flags."""
    flags = []
    for k, v in overrides.items():
        flags.append('--' + k.replace('_', '-'))
        if isinstance(v, dict):
            flags += [f'{a}={b}' for a, b in v.items()]
        elif isinstance(v, (list, tuple)):
            flags += [str(x) for x in v]
        else:
            flags.append(str(v))
    return flags


@pytest.fixture(scope='session')
def tiny_data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp('tiny_data'))


def write_idx(path, array: np.ndarray) -> None:
    """An IDX file as in the original Fashion-MNIST distribution (uint8; 3 dims for images, 1 for labels)."""
    magic = 2051 if array.ndim == 3 else 2049
    header = magic.to_bytes(4, 'big') + b''.join(int(n).to_bytes(4, 'big') for n in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


@pytest.fixture(scope='module')
def tiny_fashion_mnist(tmp_path_factory):
    """200 train / 100 test 28x28 grayscale images whose class sets the brightness of one band: learnable."""
    root = tmp_path_factory.mktemp('fmnist')
    raw = root / 'FashionMNIST' / 'raw'
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (('train', 200), ('t10k', 100)):
        labels = np.arange(n) % 10
        images = rng.integers(0, 60, (n, 28, 28))
        for i, c in enumerate(labels):
            images[i, 2 * c:2 * c + 4] += 150
        write_idx(raw / f'{prefix}-images-idx3-ubyte', images)
        write_idx(raw / f'{prefix}-labels-idx1-ubyte', labels)
    return root
