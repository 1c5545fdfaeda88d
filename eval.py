"""Evaluate a checkpoint: ``python eval.py --model NAME --checkpoint FILE --data-dir DIR [--output results.json]``.

Also runs under ``torchrun --nproc_per_node=N eval.py ...``; see ``collab_vit/training/eval_cli.py`` for all flags.
"""
import sys

from collab_vit.training.eval_cli import main

if __name__ == '__main__':
    sys.exit(main())
