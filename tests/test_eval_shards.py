"""Evaluation of an iterable (WebDataset) set counts every sample once, on 1 and 2 gloo processes; shards that
cannot split evenly over ranks x workers are warned about with the counts."""
import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from collab_vit.training.data import build_dataset, build_eval_loader, eval_data_config, eval_shard_size
from collab_vit.training.distributed import DistInfo
from collab_vit.training.engine import evaluate

from tinyrun import ROOT

pytest.importorskip('webdataset', reason='the wds extra (pip install collab-vit[wds]) is not installed')


def write_shards(root, shard_sizes, size=16, classes=3):
    """WebDataset shards ``validation-NNNN.tar`` (``<key>.png`` + ``<key>.cls``) and timm's ``_info.json``."""
    rng = np.random.default_rng(0)
    names, index = [], 0
    for s, n in enumerate(shard_sizes):
        name = f'validation-{s:04d}.tar'
        with tarfile.open(os.path.join(root, name), 'w') as tar:
            for _ in range(n):
                for ext, payload in (('png', None), ('cls', str(index % classes).encode())):
                    if payload is None:
                        buf = io.BytesIO()
                        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, 'PNG')
                        payload = buf.getvalue()
                    info = tarfile.TarInfo(f'{index:06d}.{ext}')
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
                index += 1
        names.append(name)
    split = {'name': 'validation', 'num_samples': sum(shard_sizes), 'filenames': names,
             'shard_lengths': list(shard_sizes)}
    with open(os.path.join(root, '_info.json'), 'w') as f:
        json.dump({'name': 'tiny', 'splits': {'validation': split}}, f)
    return str(root)


def count_evaluated(root, dist_info: DistInfo, num_workers: int = 0) -> dict:
    """Evaluate a fixed linear model on the wds set as the trainer does (eval_shard_size, evaluate)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 3))
    dataset = build_dataset('wds/tiny', root, 'validation', False, batch_size=4)
    loader = build_eval_loader(dataset, eval_data_config(16, 1.0), 4, num_workers, dist_info, pin_memory=False)
    return evaluate(model, loader, dist_info, eval_shard_size(dataset, dist_info, num_workers))


RANK_SCRIPT = '''import json, os, sys
sys.path.insert(0, os.path.join({root!r}, 'tests'))
from collab_vit.training.distributed import init_distributed, cleanup_distributed
from test_eval_shards import count_evaluated
info = init_distributed('cpu')
metrics = count_evaluated(sys.argv[1], info)
cleanup_distributed()
open(os.path.join(sys.argv[2], 'rank%d.json' % info.rank), 'w').write(json.dumps(metrics))
'''


def test_wds_eval_counts_every_sample_once(tmp_path):
    """4 shards of 3: one process reads all 12; two read 6 each (before, each rank stopped after 12 / 2**2)."""
    data = tmp_path / 'data'
    data.mkdir()
    write_shards(data, [3, 3, 3, 3])
    alone = count_evaluated(str(data), DistInfo())
    assert alone['num_samples'] == 12
    script = tmp_path / 'rank.py'
    script.write_text(RANK_SCRIPT.format(root=ROOT))
    proc = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           str(script), str(data), str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, 'PYTHONPATH': ROOT, 'OMP_NUM_THREADS': '1'}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f'rank{r}.json').read_text()) for r in (0, 1)]
    assert [r['num_samples'] for r in ranks] == [12, 12]  # reduced over the ranks: 6 + 6
    assert ranks[0]['top1'] == ranks[1]['top1'] == alone['top1']
    # the same float32 per-sample losses up to the last bits (other batch compositions), summed in float64:
    # 16 x 2**-24 (~1e-6) relative to the mean loss
    assert abs(ranks[0]['loss'] - alone['loss']) <= 1e-6 * alone['loss']


def test_uneven_wds_shards_are_warned_about_with_counts(tmp_path, capsys):
    write_shards(tmp_path, [3, 3, 3])
    dataset = build_dataset('wds/tiny', str(tmp_path), 'validation', False)
    assert eval_shard_size(dataset, DistInfo(rank=0, world_size=2), num_workers=0) is None
    err = capsys.readouterr().err
    assert 'warning: the eval set has 3 shards for 2 process(es) x 1 worker(s) = 2 readers: 1 reader(s) get one ' \
           'shard more' in err, err
    assert eval_shard_size(dataset, DistInfo(), num_workers=0) is None and not capsys.readouterr().err
