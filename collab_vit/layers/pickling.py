"""Classes made on the fly (a key dim fixed for timm's ``attn_layer``, a mixin added to a model class) pickle by
how they are made: ``torch.save(model)``, ``multiprocessing`` and launchers that pickle a model then load it in a
fresh process, where the class exists only once the load makes it again."""
from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn


def _instance_of(factory: Callable[..., type], args: tuple) -> nn.Module:
    """Unpickling: an empty instance of the class ``factory(*args)`` makes (its state is set after)."""
    cls = factory(*args)
    return cls.__new__(cls)


def reduced_by(factory: Callable[..., type], *args: Any) -> Callable[[nn.Module, int], tuple]:
    """The ``__reduce_ex__`` of a class that ``factory(*args)`` makes (``factory``, ``args`` importable by name):
    pickle stores how to make the class, not a reference to it."""
    return lambda self, protocol: (_instance_of, (factory, args), self.__dict__)
