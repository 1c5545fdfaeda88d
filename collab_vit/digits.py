"""The quickstart dataset: scikit-learn's ``load_digits`` (8x8 scans, 10 classes) written as a PNG ImageFolder."""
from __future__ import annotations

import os

import numpy as np
from PIL import Image

DIGITS_SIZE = 32  # pixels per side of the written images (upsampled from 8x8)
VAL_EVERY = 5  # every 5th sample (in load_digits order) goes to val/: a fixed, deterministic 80/20 split


def ensure_digits(root: str, size: int = DIGITS_SIZE) -> str:
    """Write ``root/{train,val}/<digit>/<index>.png`` unless already complete; returns ``root``."""
    marker = os.path.join(root, '.complete')
    if os.path.isfile(marker):
        return root
    from sklearn.datasets import load_digits
    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images, digits.target)):
        split = 'val' if i % VAL_EVERY == 0 else 'train'
        folder = os.path.join(root, split, str(int(label)))
        os.makedirs(folder, exist_ok=True)
        pixels = np.clip(image * (255.0 / 16.0), 0, 255).astype(np.uint8)  # digits are 0..16 grey levels
        Image.fromarray(pixels, mode='L').resize((size, size), Image.BICUBIC).save(os.path.join(folder, f'{i:04d}.png'))
    with open(marker, 'w') as f:
        f.write(f'{len(digits.target)} images, {size}px, every {VAL_EVERY}th to val\n')
    return root
