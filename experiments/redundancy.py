"""Claim (c), paper section 3.1 in miniature: a trained model's heads share most of their key/query subspace, and that
structure is learned, not present at initialisation.

    python experiments/redundancy.py      # needs the post-hoc experiment's source model (experiments/post_hoc.py)

Runs ``collab-vit analyze`` on the trained standard model (``runs/experiments/post_hoc/source/model.safetensors``)
and on the same architecture at its initialisation (same seed, built as the trainer builds it), and writes
``results/redundancy/{trained,init}.json`` (cumulative energy per layer, dims for 90/95/99 %), ``table.md`` and one
PNG with both spectra.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from runner import ROOT, env_for_children, git_commit, machine, write_json


def initial_weights(trained: Path, out: Path) -> Path:
    """The trained file's architecture at its initialisation: seeded as the trainer seeds (timm's ``random_seed``)."""
    import yaml
    from timm.utils import random_seed

    sys.path.insert(0, str(ROOT))
    from collab_vit.training.build import build_model
    from collab_vit.weights_io import export_safetensors, read_weights

    _, meta = read_weights(str(trained))
    config = yaml.safe_load((trained.parent / 'config.yaml').read_text())
    random_seed(config['seed'], 0)
    kwargs = dict(meta['model_kwargs'])
    model = build_model(meta['model_name'], kwargs.pop('num_classes'), kwargs.pop('img_size'), 0.0, kwargs)
    export_safetensors(model.state_dict(), str(out), meta['model_name'], meta['model_kwargs'])
    return out


def per_head_dims(model) -> list[dict[str, list[int]]]:
    """Per layer and head: dims holding 90/95/99 % of that head's own ``W_q,i W_k,i^T`` energy. If the heads used
    orthogonal subspaces, the concatenation would need about the SUM of these; if they share one, about the MAX."""
    import torch

    from collab_vit.conversion.weights.decompose import energy_spectrum, rank_for_energy, split_qkv_heads
    from collab_vit.conversion.reparam import timm_attention_layers
    out = []
    for _, attn in timm_attention_layers(model):
        wq, wk = split_qkv_heads(attn.qkv.weight.detach().to(torch.float64), attn.num_heads)
        spectra = [energy_spectrum(wq[i:i + 1], wk[i:i + 1])[0] for i in range(attn.num_heads)]
        out.append({f'{t:.2f}': [rank_for_energy(e, t) for e in spectra] for t in (0.9, 0.95, 0.99)})
    return out


def heads_table(spectra: list, heads: list) -> str:
    lines = ['| layer | concatenated over heads: dims for 90 % | each head alone: dims for 90 % | sum over heads | '
             'max over heads |', '|---|---:|---|---:|---:|']
    for s, h in zip(spectra, heads):
        per = h['0.90']
        lines.append(f"| {s.name} | {s.dims_needed[0.9]} | {' / '.join(map(str, per))} | {sum(per)} | {max(per)} |")
    return '\n'.join(lines) + '\n'


def analyze(checkpoint: Path, out: Path, log: Path) -> None:
    """``collab-vit analyze`` into the folder ``out`` (its spectrum.md and spectrum.png)."""
    with open(log, 'a') as f:
        subprocess.run([sys.executable, '-m', 'collab_vit.cli', 'analyze', '--checkpoint', str(checkpoint), '--out',
                        str(out)], cwd=ROOT, env=env_for_children(), stdout=f, stderr=subprocess.STDOUT, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--trained', type=Path, default=ROOT / 'runs' / 'experiments' / 'post_hoc' / 'source' /
                   'model.safetensors')
    p.add_argument('--results', type=Path, default=ROOT / 'results' / 'redundancy')
    args = p.parse_args()
    if not args.trained.exists():
        raise SystemExit(f'error: {args.trained} not found: run experiments/post_hoc.py first (it trains the model)')
    sys.path.insert(0, str(ROOT))
    from collab_vit.conversion.files.commands import load_source
    from collab_vit.conversion.files.spectrum import THRESHOLDS, format_spectrum_table, layer_spectra

    args.results.mkdir(parents=True, exist_ok=True)
    init = initial_weights(args.trained, args.results / 'init.safetensors')
    tables, spectra, heads = {}, {}, {}
    for name, checkpoint in (('trained', args.trained), ('init', init)):
        analyze(checkpoint, args.results / f'{name}_analyze', args.results / 'analyze.log')  # the CLI's output
        model, model_name, kwargs, _ = load_source(None, str(checkpoint))
        spectra[name] = layer_spectra(model)
        heads[name] = per_head_dims(model)
        tables[name] = format_spectrum_table(spectra[name]) + '\n' + heads_table(spectra[name], heads[name])
        write_json(args.results / f'{name}.json', {
            'checkpoint': str(checkpoint.relative_to(ROOT)) if checkpoint.is_relative_to(ROOT) else str(checkpoint),
            'model': model_name, 'model_kwargs': kwargs, 'command': f'collab-vit analyze --checkpoint {checkpoint}',
            'layers': [{'name': s.name, 'dims_needed': {f'{t:.2f}': s.dims_needed[t] for t in THRESHOLDS},
                        'per_head_dims_needed': h, 'total_dims': s.total_dims,
                        'cumulative_energy': [round(float(e), 6) for e in s.cumulative_energy]}
                       for s, h in zip(spectra[name], heads[name])],
            'commit': git_commit(), 'machine': machine()})
    (args.results / 'table.md').write_text(
        '**Trained** (standard attention, D = 64, 4 heads):\n\n' + tables['trained'] +
        '\n**At initialisation** (same architecture and seed):\n\n' + tables['init'])
    plot(spectra, args.results / 'spectrum_trained_vs_init.png')
    args.results.joinpath('init.safetensors').unlink()  # derived, rebuilt on demand
    print((args.results / 'table.md').read_text())


def plot(spectra: dict, path: Path) -> None:
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.6, 4.3), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, style in (('trained', '-'), ('init', ':')):
        layers = spectra[name]
        for depth, s in enumerate(layers):
            energy = s.cumulative_energy.double().numpy()
            color = colormaps['viridis'](depth / max(len(layers) - 1, 1))
            ax.plot(range(1, len(energy) + 1), energy, ls=style, color=color, lw=1.5,
                    label=f'{name}, {s.name}')
    for t in (0.9, 0.95, 0.99):
        ax.axhline(t, color='0.5', lw=0.7, ls='--')
    ax.set_xlabel('number of shared query dims kept (top singular directions)')
    ax.set_ylabel('cumulative energy of $[W_{q,i} W_{k,i}^T]_i$')
    ax.set_title('Shared key/query subspace: trained (solid) vs init (dotted)')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, ncol=2, loc='lower right')
    fig.tight_layout()
    fig.savefig(path)


if __name__ == '__main__':
    main()
