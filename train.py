"""Train a ViT: ``python train.py -c configs/X.yaml [--key value ...]`` or ``torchrun --nproc_per_node=N train.py ...``.

Every config key can be overridden on the command line (``--data-dir DIR``, ``--output DIR``, ``--resume``, ...);
see ``collab_vit/training/config.py`` for the keys and ``configs/_base_deit.yaml`` for the DeiT recipe.
"""
import sys

from collab_vit.training.trainer import main

if __name__ == '__main__':
    sys.exit(main())
