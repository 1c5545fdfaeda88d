"""Counting host syncs of the package's training code: device-to-host reads (``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``bool()``/``float()``/``int()``/formatting of a tensor) and blocking collectives, each attributed to
the phase of the run it happened in (the trainer's ``_train_epoch`` / ``_evaluate_epoch`` / ``_save_epoch``, else
``other``). Only calls made directly by the loop's code count (LOOP_FILES; torch's and timm's internals are their
own, and the samplers of ``data.py`` read CPU permutations, never a device tensor)."""
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist

TRAINING = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'collab_vit', 'training')
LOOP_FILES = tuple(os.path.join(TRAINING, f) for f in ('engine.py', 'trainer.py', 'distributed.py', 'checkpoint.py',
                                                      'build.py'))
READS = ('item', 'tolist', 'cpu', 'numpy', '__bool__', '__float__', '__int__', '__format__')
COLLECTIVES = ('all_reduce', 'all_gather', 'all_gather_object', 'broadcast', 'broadcast_object_list', 'barrier')
PHASES = {'_train_epoch': 'train', '_evaluate_epoch': 'evaluate', '_save_epoch': 'save'}


def install(monkeypatch=None) -> Counter:
    """Patch the reads and collectives (with ``monkeypatch``, undone after the test); returns the live counts,
    keyed ``(phase, name)``, plus ``('epochs', 'train')`` = training passes seen."""
    from collab_vit.training import trainer
    counts: Counter = Counter()
    phase = ['other']

    def counted(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if sys._getframe(1).f_code.co_filename in LOOP_FILES:
                counts[(phase[0], name)] += 1
            return original(*args, **kwargs)
        return original, wrapper

    def in_phase(name, label):
        original = getattr(trainer, name)

        def wrapper(*args, **kwargs):
            before, phase[0] = phase[0], label
            counts[('epochs', label)] += 1
            try:
                return original(*args, **kwargs)
            finally:
                phase[0] = before
        return original, wrapper

    patches = [(torch.Tensor, n, *counted(torch.Tensor, n)) for n in READS]
    patches += [(dist, n, *counted(dist, n)) for n in COLLECTIVES]
    patches += [(trainer, n, *in_phase(n, label)) for n, label in PHASES.items()]
    for owner, name, original, wrapper in patches:
        if monkeypatch is not None:
            monkeypatch.setattr(owner, name, wrapper)
        else:
            setattr(owner, name, wrapper)
    return counts


def by_phase(counts: Counter) -> dict:
    """{phase: total syncs}, and {phase: {name: n}} for messages."""
    totals, detail = Counter(), {}
    for (phase, name), n in counts.items():
        if phase != 'epochs':
            totals[phase] += n
            detail.setdefault(phase, {})[name] = n
    return dict(totals), detail
