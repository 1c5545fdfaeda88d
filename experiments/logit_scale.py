"""Claim (a), a diagnostic: is the gap between collaborative attention (concatenate init) and standard attention cut
to the same key dim the logit scale?

    python experiments/logit_scale.py                 # key dim 16 (D/4), 3 seeds, 2 runs side by side
    python experiments/logit_scale.py --key-dims 16 8

The collaborative layer scales its logits by 1/sqrt(dh) (dh = D / heads, the scale of the layer it replaces); the cut
baseline by 1/sqrt(D~k / heads), its own head dim. With the concatenate init the logit of head i is
``scale * sum_{j in block i} m_ij q_j k_j`` with ``m_ij = 1``, so multiplying the mixing matrix by
``sqrt(dh * heads / D~k)`` gives the collaborative model, at initialisation, exactly the cut baseline's logits on the
same query/key weights. Nothing in the layer changes: each cell is the grid's cell (``configs/fmnist/collab_k<K>.yaml``,
same seed) started from those weights with ``--checkpoint``. The weights are built as the trainer builds them (the
run's seed, then the model), so the only difference to the grid's cell is the mixing matrix's scale.
Writes ``results/logit_scale/<cell>.json`` and ``table.md`` (beside the grid's rows from ``results/from_scratch``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from runner import ROOT, Cell, difference, initial_state, mean_std, run_cells, write_json


def scaled_start(config: str, seed: int, path: Path) -> float:
    """Write the start weights of ``config`` at ``seed`` with the mixing matrices scaled to the cut baseline's logit
    scale; return the factor."""
    sys.path.insert(0, str(ROOT))
    from collab_vit.training.config import build_config
    from collab_vit.weights_io import export_safetensors

    cfg = build_config(str(ROOT / config))
    state = initial_state(cfg.to_dict(), seed)
    kwargs = cfg.model_kwargs
    factor = math.sqrt(kwargs['embed_dim'] / kwargs['key_dim'])  # sqrt(dh * heads / D~k), dh = embed_dim / heads
    state = {k: v * factor if k.endswith('.attn.mixing') else v for k, v in state.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    export_safetensors(state, str(path), cfg.model, {**kwargs, 'in_chans': cfg.in_chans, 'img_size': cfg.img_size,
                                                     'num_classes': cfg.num_classes})
    return factor


def table(records: list[dict], grid: Path) -> str:
    """Top-1 mean ± std of the rescaled cells beside the grid's collaborative (concatenate init) and cut rows."""
    lines = ['| key dim | model | logit scale at init | top-1 (mean ± std) | Δ vs cut baseline (± s.e.) | n seeds |',
             '|---:|---|---|---:|---:|---:|']
    for key_dim in sorted({r['key_dim'] for r in records}, reverse=True):
        def read(variant: str) -> list[float]:
            return [json.loads(p.read_text())['top1'] for p in sorted(grid.glob(f'{variant}-s*.json'))]

        cut = read(f'concat_k{key_dim}')
        rows = [('collaborative, concatenate init (grid)', 'dh', read(f'collab_k{key_dim}')),
                ('collaborative, concatenate init, mixing rescaled', "cut baseline's",
                 [r['top1'] for r in records if r['key_dim'] == key_dim]),
                ('standard attention cut to this key dim (grid)', 'own head dim', cut)]
        for name, scale, top1 in rows:
            if not top1:
                continue
            m, s = mean_std(top1)
            delta = difference(top1, cut) if cut and 'cut' not in name else ''
            lines.append(f'| {key_dim} | {name} | {scale} | {m:.2f} ± {s:.2f} | {delta} | {len(top1)} |')
    return '\n'.join(lines) + '\n'


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--key-dims', type=int, nargs='+', default=[16])
    p.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    p.add_argument('--jobs', type=int, default=2)
    p.add_argument('--results', type=Path, default=ROOT / 'results' / 'logit_scale')
    p.add_argument('--runs', type=Path, default=ROOT / 'runs' / 'experiments' / 'logit_scale')
    p.add_argument('--grid', type=Path, default=ROOT / 'results' / 'from_scratch',
                   help="the from-scratch grid's results (its collab and concat rows are the comparison)")
    p.add_argument('--config-dir', default='configs/fmnist')
    p.add_argument('--data-dir', default=None, help="overrides the configs' data_dir")
    p.add_argument('--train-flags', nargs=argparse.REMAINDER, default=[],
                   help='extra train.py flags for every cell (not ones that change the model: the start weights are '
                        "built from the config's model)")
    args = p.parse_args()
    cells = []
    for key_dim in args.key_dims:
        config = f'{args.config_dir}/collab_k{key_dim}.yaml'
        for seed in args.seeds:
            start = args.runs / 'starts' / f'collab_k{key_dim}-s{seed}.safetensors'
            factor = scaled_start(config, seed, start)
            flags = ['--checkpoint', str(start)] + (['--data-dir', args.data_dir] if args.data_dir else [])
            cells.append(Cell(f'collab_k{key_dim}_rescaled-s{seed}', config, seed, flags + args.train_flags,
                              {'variant': f'collab_k{key_dim}_rescaled', 'attention': 'collaborative',
                               'key_dim': key_dim, 'mixing_init': 'concatenate', 'mixing_factor': factor}))
    records = run_cells(cells, args.results, args.runs, args.jobs)
    (args.results / 'table.md').write_text(table(records, args.grid))
    write_json(args.results / 'summary.json', {'cells': len(records)})
    print(table(records, args.grid))
    print(f'wrote {args.results}/table.md')


if __name__ == '__main__':
    main()
