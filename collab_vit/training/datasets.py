"""The data sets this package prepares itself: the quickstart digits and an offline Fashion-MNIST.

* ``sklearn/digits`` (quickstart): scikit-learn's ``load_digits`` (8x8 scans, 10 classes) written as a PNG
  ImageFolder.
* ``torch/fashion_mnist``: the four original IDX files put where torchvision's reader (timm's
  ``torch/fashion_mnist``) finds them, ``<root>/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``.

Fashion-MNIST (Xiao, Rasul, Vollgraf 2017, Zalando): 70,000 28x28 grayscale product photographs, 10 classes,
60,000 train / 10,000 test. With internet, torchvision downloads it (``dataset_download: true``). Offline, Debian's
``dataset-fashion-mnist`` package installs the IDX files gzipped under ``/usr/share/datasets/fashion-mnist``; its
``.gz`` files are recompressed (their MD5 differs from torchvision's list, so torchvision would try to download again),
so they are decompressed here instead. Any folder holding the four files (``.gz`` or not) works as a source.
"""
from __future__ import annotations

import gzip
import os
import shutil
import tempfile
from typing import Optional, Sequence

import numpy as np
from PIL import Image

from ..weights_io import atomic_write, current_umask, write_error
from .config import DataError

DIGITS_SIZE = 32  # pixels per side of the written images (upsampled from 8x8)
VAL_EVERY = 5  # every 5th sample (in load_digits order) goes to val/: a fixed, deterministic 80/20 split
DIGITS_MARKER = '.complete'  # written last: a directory holding it is this package's own digits set
DIGITS_SIGNATURE = 'collab-vit sklearn digits'


def ensure_digits(root: str, size: int = DIGITS_SIZE) -> str:
    """Write ``root/{train,val}/<digit>/<index>.png`` unless already complete; returns ``root``.

    Only a missing or empty ``root`` is written to, and only all at once: the set is built in a hidden sibling folder
    and renamed into place with its marker file. A ``root`` that holds anything else (a user's own ImageFolder given
    as ``--data-dir`` with a config whose ``dataset`` is ``sklearn/digits``) is a DataError; nothing is written.
    """
    marker = os.path.join(root, DIGITS_MARKER)
    if os.path.isfile(marker):
        return root
    if os.path.isdir(root) and os.listdir(root):
        raise DataError(f"data directory {os.path.abspath(root)} is not empty and is not this package's digits set "
                        f"(no {DIGITS_MARKER} marker): not writing the digits into it; for your own ImageFolder "
                        f"pass --dataset '' (and --num-classes), or give an empty or new --data-dir")
    if os.path.exists(root) and not os.path.isdir(root):
        raise DataError(f'data directory {os.path.abspath(root)} is a file, not a directory')
    from sklearn.datasets import load_digits
    digits = load_digits()
    parent = os.path.dirname(os.path.abspath(root))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix='.' + os.path.basename(os.path.abspath(root)) + '.', suffix='.partial',
                               dir=parent)
    try:
        os.chmod(staging, 0o777 & ~current_umask())  # as os.makedirs would create it, not mkdtemp's 0700
        for i, (image, label) in enumerate(zip(digits.images, digits.target)):
            split = 'val' if i % VAL_EVERY == 0 else 'train'
            folder = os.path.join(staging, split, str(int(label)))
            os.makedirs(folder, exist_ok=True)
            pixels = np.clip(image * (255.0 / 16.0), 0, 255).astype(np.uint8)  # digits are 0..16 grey levels
            Image.fromarray(pixels, mode='L').resize((size, size), Image.BICUBIC).save(
                os.path.join(folder, f'{i:04d}.png'))
        with open(os.path.join(staging, DIGITS_MARKER), 'w') as f:
            f.write(f'{DIGITS_SIGNATURE}: {len(digits.target)} images, {size}px, every {VAL_EVERY}th to val\n')
        os.replace(staging, root)  # atomic; an empty directory at root is replaced too
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        if os.path.isfile(marker):  # another process finished first
            return root
        raise write_error(e, root) from None  # a full disk: 'no space left on device writing <root>', nothing left
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return root

FILES = ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte', 't10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte')
SOURCES = ('/usr/share/datasets/fashion-mnist',)  # Debian/Ubuntu: apt-get install dataset-fashion-mnist
SIZES = {'train-images-idx3-ubyte': 47040016, 'train-labels-idx1-ubyte': 60008,
         't10k-images-idx3-ubyte': 7840016, 't10k-labels-idx1-ubyte': 10008}  # the original files
MAGIC = {'images': 2051, 'labels': 2049}  # IDX headers: 0x0803 (uint8, 3 dims), 0x0801 (uint8, 1 dim)
# Per-channel statistics of the 60,000 training images (pixels / 255), measured with torchvision's reader.
MEAN, STD = (0.2860,), (0.3530,)


def raw_dir(root: str) -> str:
    return os.path.join(root, 'FashionMNIST', 'raw')


def _idx_magic(path: str) -> int:
    with open(path, 'rb') as f:
        return int.from_bytes(f.read(4), 'big')


def is_complete(root: str) -> bool:
    """All four decompressed IDX files are in ``root/FashionMNIST/raw`` (checked by their IDX headers)."""
    folder = raw_dir(root)
    paths = {f: os.path.join(folder, f) for f in FILES}
    return all(os.path.isfile(p) and _idx_magic(p) == MAGIC['images' if 'images' in f else 'labels']
               for f, p in paths.items())


def find_source(candidates: Sequence[str] = SOURCES) -> Optional[str]:
    """The first folder holding the four IDX files (gzipped or not), or None."""
    for folder in candidates:
        if all(os.path.isfile(os.path.join(folder, f)) or os.path.isfile(os.path.join(folder, f + '.gz'))
               for f in FILES):
            return folder
    return None


def prepare_fashion_mnist(root: str, source: Optional[str] = None) -> str:
    """Decompress (or copy) the IDX files from ``source`` (default: the Debian package's folder) into
    ``root/FashionMNIST/raw``; nothing is written when they are already there. Returns that folder.

    Each file is written to a temporary name and renamed (:func:`atomic_write`); a failure (a full disk: one line
    naming the file) removes the files and folders this call added, so no half copy is left behind.
    """
    target = raw_dir(root)
    if is_complete(root):
        return target
    folder = source or find_source()
    if folder is None:
        raise DataError(f'Fashion-MNIST files not found in {", ".join(SOURCES)}; install them with '
                        f'`apt-get install dataset-fashion-mnist`, pass --source DIR (a folder with the four IDX '
                        f'files), or let torchvision download them (dataset_download: true)')
    created = _missing_parents(target)
    written = []
    try:
        for name in FILES:
            plain, packed = os.path.join(folder, name), os.path.join(folder, name + '.gz')
            if not (os.path.isfile(plain) or os.path.isfile(packed)):
                raise DataError(f'{folder} lacks {name}(.gz)')
            with (open(plain, 'rb') if os.path.isfile(plain) else gzip.open(packed, 'rb')) as src:
                data = src.read()
            if len(data) != SIZES[name]:
                raise DataError(f'{name} from {folder} has the wrong size (not the original Fashion-MNIST file)')
            path = os.path.join(target, name)
            if not os.path.exists(path):
                written.append(path)
            atomic_write(path, lambda f: f.write(data))
    except BaseException:  # a full disk, a bad source file, an interrupt: nothing this call added stays
        for path in written:
            if os.path.isfile(path):
                os.remove(path)
        for folder_made in reversed(created):
            if os.path.isdir(folder_made) and not os.listdir(folder_made):
                os.rmdir(folder_made)
        raise
    return target


def _missing_parents(path: str) -> list:
    """The folders from ``path`` upwards that do not exist yet, outermost first (created by :func:`atomic_write`)."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing[::-1]


def check_fashion_mnist(root: str) -> None:
    """A one-line error that says how to get the files when ``root`` lacks them (nothing is written here)."""
    if not root:
        raise DataError('no data directory given for torch/fashion_mnist (set data_dir or pass --data-dir DIR)')
    if not is_complete(root):
        raise DataError(f'Fashion-MNIST is not in {os.path.abspath(raw_dir(root))}: run '
                        f'`collab-vit prepare-data fashion_mnist --root {root}` (offline, from Debian\'s '
                        f'dataset-fashion-mnist) or pass --dataset-download true')
