"""The training sample order depends on (seed, epoch) only, so a mid-epoch resume with data-loader workers trains
exactly the samples of the uninterrupted epoch."""
import os
import sys

import pytest
import torch

from collab_vit.training import data, trainer
from collab_vit.training.distributed import DistInfo
from collab_vit.training.checkpoint import load_checkpoint, save_checkpoint
from collab_vit.training.checkpoint import SAMPLE_ORDER
from collab_vit.training.stop import StopRequest
from collab_vit.training.data import EpochSeededSampler, SkipFirstSampler
from collab_vit.training.config import build_config
from collab_vit.training.trainer import train

from test_preemption import stop_at_update_checks
from tinyrun import tiny_data, tiny_overrides  # noqa: F401  (tiny_data is a fixture)

WORKERS = dict(num_workers=2, persistent_workers=True, epochs=3, accum_steps=2, seed=5)


def test_epoch_seeded_order_ignores_the_global_rng_and_iterators():
    ds = list(range(64))

    def loader():
        return torch.utils.data.DataLoader(ds, batch_size=8, sampler=EpochSeededSampler(ds, seed=1), num_workers=2,
                                           persistent_workers=True)

    torch.manual_seed(0)
    dl, orders = loader(), []
    for epoch in range(3):
        dl.sampler.set_epoch(epoch)
        orders.append([int(i) for b in dl for i in b])
    assert all(sorted(o) == ds for o in orders) and len({tuple(o) for o in orders}) == 3
    torch.manual_seed(123)  # another global RNG state, a fresh loader and iterator: the same epoch-2 order
    fresh = loader()
    fresh.sampler.set_epoch(2)
    assert [int(i) for b in fresh for i in b] == orders[2]
    assert list(EpochSeededSampler(ds, seed=2)) != list(EpochSeededSampler(ds, seed=1))
    one_later = EpochSeededSampler(ds, seed=0)
    one_later.set_epoch(1)
    assert list(one_later) != list(EpochSeededSampler(ds, seed=1))  # (seed, epoch + 1) is not (seed + 1, epoch)


def test_gpu_prefetcher_loader_gets_the_seeded_sampler(tiny_data, tmp_path, monkeypatch):
    """On CUDA timm wraps the DataLoader in its PrefetchLoader: the rebuilt DataLoader goes inside (checked on CPU by
    letting timm build the prefetcher for the CPU)."""
    create_loader = data.create_loader
    on_cpu = torch.device('cpu')
    monkeypatch.setattr(data, 'create_loader', lambda *a, **k: create_loader(*a, **{**k, 'device': on_cpu}))
    cfg = build_config(None, tiny_overrides(tiny_data, str(tmp_path), num_workers=2, persistent_workers=True))
    dataset = data.build_dataset('', tiny_data, 'train', True)
    cuda = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device('cuda'))
    loader = data.build_train_loader(cfg, dataset, data.eval_data_config(32, 0.875), cuda)
    assert type(loader).__name__ == 'PrefetchLoader' and isinstance(loader.sampler, EpochSeededSampler)
    assert loader.loader.num_workers == 2 and loader.loader.persistent_workers and loader.loader.drop_last
    loader.sampler.set_epoch(1)
    assert len(loader) == 6 and all(x.shape == (4, 3, 32, 32) for x, _ in loader)


def record_trained_samples(monkeypatch) -> list:
    """Per train_one_epoch call, the dataset indices of the batches it trained (read from the sampler, which runs in
    the main process even with workers, cut to the batches the loop consumed: workers prefetch ahead)."""
    epochs: list = []
    original_iter = SkipFirstSampler.__iter__
    original_epoch = trainer.train_one_epoch

    def recording_iter(self):
        for index in original_iter(self):
            epochs[-1].append(int(index))
            yield index

    def recording_epoch(model, loader, *args, **kwargs):
        epochs.append([])
        result = original_epoch(model, loader, *args, **kwargs)
        batch_size = getattr(loader, 'loader', loader).batch_size
        del epochs[-1][result.batches * batch_size:]
        return result

    monkeypatch.setattr(SkipFirstSampler, '__iter__', recording_iter)
    monkeypatch.setattr(trainer, 'train_one_epoch', recording_epoch)
    return epochs


def test_mid_epoch_resume_with_persistent_workers_trains_the_same_samples(tiny_data, tmp_path, monkeypatch):
    """6 batches / 3 updates per epoch: stop at update 5 (epoch 1, batch 4), resume with 2 persistent workers."""
    seen = record_trained_samples(monkeypatch)
    train(build_config(None, tiny_overrides(tiny_data, str(tmp_path / 'full'), **WORKERS)))
    full = list(seen)
    assert len(full) == 3 and all(len(e) == 24 and sorted(e) == list(range(24)) for e in full)
    assert full[0] != full[1]  # the order changes between epochs

    seen.clear()
    out = str(tmp_path / 'split')
    reason = StopRequest.reason
    stop_at_update_checks(monkeypatch, 5)
    assert train(build_config(None, tiny_overrides(tiny_data, out, **WORKERS)))['batches_done'] == 4
    monkeypatch.setattr(StopRequest, 'reason', reason)
    train(build_config(None, tiny_overrides(tiny_data, out, resume=True, **WORKERS)))
    assert [len(e) for e in seen] == [24, 16, 8, 24]
    assert seen[0] == full[0] and seen[1] + seen[2] == full[1] and seen[3] == full[2]


def test_resuming_an_older_mid_epoch_checkpoint_warns(tiny_data, tmp_path, monkeypatch, capsys):
    """A mid-epoch checkpoint without the sample-order mark came from a version with another order: say so."""
    out = str(tmp_path / 'old')
    stop_at_update_checks(monkeypatch, 2)
    train(build_config(None, tiny_overrides(tiny_data, out)))
    monkeypatch.undo()
    ckpt = load_checkpoint(os.path.join(out, 'last.pth'))
    assert ckpt['batches_done'] == 2 and ckpt.pop('sample_order') == SAMPLE_ORDER
    save_checkpoint(ckpt, os.path.join(out, 'last.pth'))
    capsys.readouterr()
    train(build_config(None, tiny_overrides(tiny_data, out, resume=True)))
    assert 'written inside an epoch by an older version' in capsys.readouterr().out


if __name__ == '__main__':
    sys.exit(pytest.main([__file__, '-q']))
