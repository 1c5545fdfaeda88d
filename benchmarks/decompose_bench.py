"""Time and error of collab_vit.conversion.weights.decompose against tensorly on one DeiT-B-sized attention layer.

The layer is synthetic (no pretrained weights here): heads share a query and a key basis with a decaying
spectrum, each head mixes it with its own Gaussian factor, plus 1% noise.

    python benchmarks/decompose_bench.py [--ranks 384 192] [--tensorly] [--threads 1] [--repeat 3] [--no-random]
"""

from __future__ import annotations

import argparse
import time

import torch

from collab_vit.conversion.weights import decompose as dec
import reference_decompose as ref


def planted_layer(nh: int = 12, d: int = 768, dh: int = 64, seed: int = 0, noise: float = 0.01):
    """(wq, wk) with a shared decaying-spectrum basis times per-head factors, plus noise (float32, like timm)."""
    g = torch.Generator().manual_seed(seed)
    spectrum = torch.exp(-torch.arange(d, dtype=torch.float64) / (d / 8))  # ~1/3 of the dims hold most energy

    def side():
        basis, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        heads = torch.randn(nh, d, dh, generator=g, dtype=torch.float64) / d**0.5
        w = (basis * spectrum) @ heads
        return w + noise * w.std() * torch.randn(nh, d, dh, generator=g, dtype=torch.float64)

    return side().float(), side().float()


def timed(fn, repeat: int = 1):
    """Result of ``fn`` and the least wall-clock and CPU seconds over ``repeat`` runs (the host may be shared)."""
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return out, min(walls), min(cpus)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="+", default=[384, 192])
    p.add_argument("--tensorly", action="store_true", help="also run tensorly parafac/tucker (slow, dense)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-iter", type=int, default=100)
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--no-random", action="store_true", help="skip cp_decompose with a random start")
    p.add_argument("--repeat", type=int, default=1, help="runs per method; the least time is reported")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    wq, wk = planted_layer()
    eq, ek = dec.energy_spectrum(wq, wk)
    print(f"rank for 90/99% energy: q {dec.rank_for_energy(eq, .9)}/{dec.rank_for_energy(eq, .99)}, "
          f"k {dec.rank_for_energy(ek, .9)}/{dec.rank_for_energy(ek, .99)}")
    print(f"{'method':<28}{'R':>5}{'wall s':>9}{'cpu s':>8}{'rel err':>10}{'iters':>7}")
    for rank in args.ranks:
        ours = [
            ("tucker_decompose", lambda: dec.tucker_decompose(wq, wk, rank, max_iter=args.max_iter)),
            ("cp_decompose svd", lambda: ref.cp_decompose(wq, wk, rank, max_iter=args.max_iter)),
        ]
        if not args.no_random:
            ours.append(
                ("cp_decompose random", lambda: ref.cp_decompose(wq, wk, rank, max_iter=args.max_iter, init="random"))
            )
        for name, fn in [] if args.skip_ours else ours:
            res, t, c = timed(fn, args.repeat)
            print(f"{name:<28}{rank:>5}{t:>9.2f}{c:>8.2f}{res.relative_error:>10.5f}{res.iterations:>7}", flush=True)
        if args.tensorly:
            import tensorly as tl
            from tensorly.decomposition import parafac, tucker

            tl.set_backend("pytorch")
            t_dense = dec.dense_tensor(wq.double(), wk.double())
            (w, (m, q, k)), t, c = timed(lambda: parafac(t_dense, rank, init="random", tol=1e-6))
            err = dec.relative_error(wq, wk, q * w, k, m)
            print(f"{'tensorly parafac random':<28}{rank:>5}{t:>9.2f}{c:>8.2f}{err:>10.5f}{'100':>7}", flush=True)
            (core, (m, q, k)), t, c = timed(lambda: tucker(t_dense, [wq.shape[0], rank, rank]))
            err = float((tl.tucker_to_tensor((core, [m, q, k])) - t_dense).norm() / t_dense.norm())
            print(f"{'tensorly tucker (no CP)':<28}{rank:>5}{t:>9.2f}{c:>8.2f}{err:>10.5f}", flush=True)


if __name__ == "__main__":
    main()
