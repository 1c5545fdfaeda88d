"""Process-group set-up from torchrun's environment variables, and the few collectives the loops need."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    """Where this process sits: rank, world size, local rank and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device('cpu')

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = '') -> DistInfo:
    """Join the process group when launched by torchrun (nccl on GPU, gloo on CPU); otherwise a single process."""
    if not device:
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    world_size = int(os.environ.get('WORLD_SIZE', 1))
    rank = int(os.environ.get('RANK', 0))
    local_rank = int(os.environ.get('LOCAL_RANK', 0))
    if device.startswith('cuda'):
        torch.cuda.set_device(local_rank)
        dev = torch.device('cuda', local_rank)
    else:
        dev = torch.device(device)
    if world_size > 1 and not dist.is_initialized():
        backend = 'nccl' if dev.type == 'cuda' else 'gloo'
        store = _elastic_store(world_size)
        if store is None:
            dist.init_process_group(backend=backend, init_method='env://')
        else:
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def _elastic_store(world_size: int):
    """torchrun's agent store with this attempt's key prefix, or None outside torchrun.

    torchrun keeps one store (the same ``MASTER_PORT``) across ``--max-restarts`` attempts, and ``env://`` uses it
    without a prefix, so the workers of a restarted group read the addresses the dead attempt published and cannot
    connect (gloo: "connectFullMesh failed ... Connection refused", or a hang). Prefixing the keys with
    ``TORCHELASTIC_RESTART_COUNT`` gives every attempt its own namespace (what torch did before 2.x's agent store).
    """
    if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True' or 'TORCHELASTIC_RESTART_COUNT' not in os.environ:
        return None
    from torch.distributed.constants import default_pg_timeout
    store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), world_size, is_master=False,
                          timeout=default_pg_timeout)
    return dist.PrefixStore(f"collab_vit/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def cleanup_distributed() -> None:
    """Leave the process group if one was joined."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a float64 tensor over all ranks (identity on a single process)."""
    if dist.is_available() and dist.is_initialized():
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on any rank (one all-reduce and host read when distributed)."""
    if dist.is_available() and dist.is_initialized():
        values = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return bool(values.item())
    return flag


def all_gather_rows(values: torch.Tensor) -> list:
    """Every rank's 1-D ``values`` as Python lists, in rank order (one row on a single process)."""
    if dist.is_available() and dist.is_initialized():
        rows = [torch.empty_like(values) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, values.contiguous())
        return [r.tolist() for r in rows]
    return [values.tolist()]


def barrier() -> None:
    """Wait for every rank (no-op on a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank (identity on a single process)."""
    if dist.is_available() and dist.is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj
