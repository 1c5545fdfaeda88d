"""Claim (a), paper Table 2 / Figure 3 in miniature: trained from scratch on Fashion-MNIST, collaborative attention with
a 4x smaller key/query dim matches standard attention, while standard attention cut to the same dim loses accuracy.

    python experiments/from_scratch.py                     # the whole grid, 3 seeds, 2 runs side by side
    python experiments/from_scratch.py --seeds 0 1 2 3 4   # more seeds (finished cells are not rerun)

Grid (``configs/fmnist/``; D = 64, 4 heads of 16): standard attention at Dk = D; collaborative at D, D/2, D/4, D/8
(concatenate mixing init) and D/4, D/8 (random mixing init); standard attention cut to D/2, D/4, D/8 (``concat``).
Writes ``results/from_scratch/<cell>.json`` per run, ``table.md``, ``top1_vs_key_dim.png`` and ``mixing.md`` (how
far the trained mixing matrices moved from the block structure of the concatenate init).
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch
from runner import ROOT, Cell, difference, figure, initial_state, machine, mean_std, run_cells, write_json

D = 64
VARIANTS = [  # (config, attention, key dim, mixing init)
    ('standard', 'standard', D, ''),
    ('collab_k64', 'collaborative', D, 'concatenate'),
    ('collab_k32', 'collaborative', D // 2, 'concatenate'),
    ('collab_k16', 'collaborative', D // 4, 'concatenate'),
    ('collab_k8', 'collaborative', D // 8, 'concatenate'),
    ('collab_k16_random', 'collaborative', D // 4, 'random'),
    ('collab_k8_random', 'collaborative', D // 8, 'random'),
    ('concat_k32', 'concatenate (reduced)', D // 2, ''),
    ('concat_k16', 'concatenate (reduced)', D // 4, ''),
    ('concat_k8', 'concatenate (reduced)', D // 8, ''),
    # RESULTS.md, "One dim per head (D/16)": where cutting may cost accuracy (its mixing-lr variant was removed)
    ('concat_k4', 'concatenate (reduced)', D // 16, ''),
    ('collab_k4', 'collaborative', D // 16, 'concatenate'),
    ('collab_k4_random', 'collaborative', D // 16, 'random'),
]


def tier(variant: tuple) -> int:
    """Run order: the issue's required grid (D, D/2, D/4) first, then D/8, then the random mixing init."""
    name, _, key_dim, init = variant
    return 3 if key_dim == D // 16 else 2 if init == 'random' else 1 if key_dim == D // 8 else 0


def cells(seeds: list[int], config_dir: str, extra: list[str], only: Optional[list[str]] = None) -> list[Cell]:
    """Every (variant, seed), tier by tier (``tier``), so that a cut-short grid has all seeds of the earlier tiers."""
    chosen = [v for v in VARIANTS if not only or v[0] in only]
    return [Cell(f'{name}-s{seed}', f'{config_dir}/{name}.yaml', seed, list(extra),
                 {'variant': name, 'attention': attention, 'key_dim': key_dim, 'mixing_init': init})
            for t in (0, 1, 2, 3) for seed in seeds
            for name, attention, key_dim, init in chosen if tier((name, attention, key_dim, init)) == t]


def table(records: list[dict]) -> str:
    """Mean ± sample std over seeds; the differences to standard attention and, for collaborative rows, to standard
    attention cut to the same key dim (the standard model itself at Dk = D), each with its standard error
    ``sqrt(s1^2/n1 + s2^2/n2)`` (a difference within about two of those is not resolved by these seeds)."""
    groups = defaultdict(list)
    for r in records:
        groups[r['variant']].append(r)
    base = [r['top1'] for r in groups.get('standard', [])]
    cut = {r['key_dim']: [] for r in records if r['attention'].startswith('concatenate')}
    for r in records:
        if r['attention'].startswith('concatenate'):
            cut[r['key_dim']].append(r['top1'])
    if base:
        cut[D] = base
    lines = ['| attention | key dim | mixing init | params | q/k params | top-1 (mean ± std) | Δ vs standard (± s.e.) | '
             'Δ vs standard cut to the same key dim | top-5 | n seeds | train min/run |',
             '|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|']
    for name, *_ in VARIANTS:
        rs = groups.get(name)
        if not rs:
            continue
        top1 = [r['top1'] for r in rs]
        m, s = mean_std(top1)
        vs_standard = difference(top1, base) if base and name != 'standard' else ''
        same_dim = cut.get(rs[0]['key_dim'])
        vs_cut = difference(top1, same_dim) if same_dim and rs[0]['attention'] == 'collaborative' else ''
        minutes = mean_std([r['train_seconds'] for r in rs])[0] / 60
        lines.append(f"| {rs[0]['attention']} | {rs[0]['key_dim']} | {rs[0]['mixing_init'] or '-'} | "
                     f"{rs[0]['params'] / 1e3:.1f}k | {rs[0]['qk_params'] / 1e3:.1f}k | {m:.2f} ± {s:.2f} | {vs_standard} | {vs_cut} | "
                     f"{mean_std([r['top5'] for r in rs])[0]:.2f} | {len(rs)} | {minutes:.1f} |")
    return '\n'.join(lines) + '\n'


def mixing_stats(mixing: torch.Tensor) -> tuple[float, float]:
    """For one layer's mixing matrix (Nh, Dk): the mean over heads of (i) the share of head h's squared mixing weights
    on the Dk/Nh shared dims that the concatenate init gives it (1 for concatenate, about 1/Nh for a dense random
    vector) and (ii) the participation ratio ``(sum m^2)^2 / sum m^4``, the number of shared dims a head effectively
    uses (Dk/Nh for concatenate, up to Dk when a head spreads evenly over all shared dims)."""
    m2 = mixing.double().pow(2)
    heads, key_dim = m2.shape
    block = key_dim // heads
    own = torch.stack([m2[h, h * block:(h + 1) * block].sum() for h in range(heads)]) / m2.sum(1)
    used = m2.sum(1) ** 2 / m2.pow(2).sum(1)
    return float(own.mean()), float(used.mean())


def mixing_table(records: list[dict], runs: Path) -> str:
    """Mixing structure of the collaborative cells, trained (each run's exported weights) and at initialisation (the
    same architecture built with the run's seed, as the trainer builds it), averaged over layers and seeds; beside it
    how far training moved the mixing entries and, for comparison, the shared query projections."""
    from safetensors.torch import load_file

    groups = defaultdict(lambda: defaultdict(list))
    for r in records:
        path = runs / r['name'] / 'model.safetensors'
        if r['attention'] != 'collaborative' or not path.exists():
            continue
        init, trained = initial_state(r['config'], r['seed']), load_file(path)
        g = groups[r['variant']]
        g['heads'] = [r['config']['model_kwargs']['num_heads']]
        for key in sorted(k for k in trained if k.endswith('.attn.mixing')):
            g['init'].append(mixing_stats(init[key]))
            g['trained'].append(mixing_stats(trained[key]))
            g['moved'].append(float((trained[key] - init[key]).abs().mean()))
            g['size'].append(float(init[key].abs().sum() / init[key].count_nonzero()))
            query = key.replace('.mixing', '.query.weight')
            g['query'].append(float((trained[query] - init[query]).norm() / init[query].norm()))
    lines = ['| key dim | mixing init | dims per head in the concatenate block | own-block share of mixing energy: '
             'init → trained | shared dims a head uses (participation ratio): init → trained | mean \\|Δ\\| of a '
             'mixing entry (mean \\|m\\| at init) | change of W~q, relative to its init norm | runs |',
             '|---:|---|---:|---:|---:|---:|---:|---:|']
    for name, _, key_dim, init in VARIANTS:
        if name not in groups:
            continue
        g = groups[name]
        own = [statistics.fmean(s[0] for s in g[k]) for k in ('init', 'trained')]
        used = [statistics.fmean(s[1] for s in g[k]) for k in ('init', 'trained')]
        lines.append(f'| {key_dim} | {init} | {key_dim // g["heads"][0]} | {own[0]:.2f} → {own[1]:.2f} | '
                     f'{used[0]:.1f} → {used[1]:.1f} | {statistics.fmean(g["moved"]):.3f} '
                     f'({statistics.fmean(g["size"]):.2f}) | {100 * statistics.fmean(g["query"]):.0f} % | '
                     f'{sum(1 for r in records if r["variant"] == name)} |')
    return '\n'.join(lines) + '\n'


def plot(records: list[dict], path: Path) -> None:
    fig = figure(6.4, 4.2)
    ax = fig.add_subplot()
    series = [('collaborative', 'concatenate', 'collaborative (concatenate init)', 'C0', 'o'),
              ('collaborative', 'random', 'collaborative (random init)', 'C2', 's'),
              ('collaborative', 'random, mixing lr x100', 'collaborative (random init, mixing lr x100)', 'C1', 'D'),
              ('concatenate (reduced)', '', 'standard, key dim cut', 'C3', 'v')]
    for attention, init, label, color, marker in series:
        by_dim = defaultdict(list)
        for r in records:
            if r['attention'] == attention and r['mixing_init'] == init:
                by_dim[r['key_dim']].append(r['top1'])
        if attention == 'concatenate (reduced)':  # the full-dim point of the cut baseline is the standard model
            by_dim[D] = [r['top1'] for r in records if r['variant'] == 'standard']
        dims = sorted(k for k, v in by_dim.items() if v)
        if not dims:
            continue
        stats = [mean_std(by_dim[k]) for k in dims]
        ax.errorbar(dims, [m for m, _ in stats], yerr=[s for _, s in stats], label=label, color=color,
                    marker=marker, capsize=3, lw=1.4)
    standard = [r['top1'] for r in records if r['variant'] == 'standard']
    if standard:
        m, s = mean_std(standard)
        ax.axhspan(m - s, m + s, color='0.8', alpha=0.6, lw=0, label=f'standard attention, Dk = {D} (± std)')
    ax.set_xscale('log', base=2)
    ticks = sorted({D // 8, D // 4, D // 2, D} | {r['key_dim'] for r in records})
    ax.set_xticks(ticks, [str(k) for k in ticks])
    ax.set_xlabel('key/query dim (shared dims for collaborative; all heads together for standard)')
    ax.set_ylabel('Fashion-MNIST top-1 (%)')
    ax.set_title('Trained from scratch: top-1 vs key/query dim (mean ± std over seeds)')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc='best')
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    p.add_argument('--jobs', type=int, default=2, help='runs side by side (each on cpu_threads of the config)')
    p.add_argument('--results', type=Path, default=ROOT / 'results' / 'from_scratch')
    p.add_argument('--runs', type=Path, default=ROOT / 'runs' / 'experiments' / 'from_scratch')
    p.add_argument('--config-dir', default='configs/fmnist')
    p.add_argument('--data-dir', default=None, help='overrides the configs\' data_dir')
    p.add_argument('--variants', nargs='+', choices=[v[0] for v in VARIANTS], help='a part of the grid (default: all)')
    p.add_argument('--train-flags', nargs=argparse.REMAINDER, default=[],
                   help='extra train.py flags for every cell (last on the command line)')
    args = p.parse_args()
    extra = (['--data-dir', args.data_dir] if args.data_dir else []) + args.train_flags
    records = run_cells(cells(args.seeds, args.config_dir, extra, args.variants), args.results, args.runs, args.jobs)
    (args.results / 'table.md').write_text(table(records))
    plot(records, args.results / 'top1_vs_key_dim.png')
    mixing = mixing_table(records, args.runs)
    (args.results / 'mixing.md').write_text(mixing)
    write_json(args.results / 'summary.json', {'machine': machine(), 'cells': len(records),
                                               'wall_seconds_sum': sum(r['seconds'] for r in records)})
    print(table(records))
    print(mixing)
    print(f'wrote {args.results}/table.md, top1_vs_key_dim.png and mixing.md')


if __name__ == '__main__':
    main()
