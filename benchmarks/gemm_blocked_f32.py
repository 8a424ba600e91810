"""The float32 blocked layout's two GEMMs side by side at a decode batch's and a prefill's rows (issue 59): the
blocked kernel (``tpe_blocked_gemm_f32``, ``cpu_blocked.c``: every row of x per panel of 32 outputs) and
``cpu_gemm.c``'s ``tpe_gemm_blocked_f32`` (the rows in L2-sized chunks, 6-row tiles), on SmolLM2-135M's float32
shapes (tp=1) with random weights, interleaved rounds (each round times both, in turn, the order alternating),
the two checked equal bit for bit first.

    python -m benchmarks.gemm_blocked_f32 [--rows 64 8192] [--rounds 7] [--threads N] [--clock wall|cpu]

Prints per shape and row count the best round's microseconds per call of each, GFLOP/s, and the ratio, and the
load average at the start and end. ``--clock cpu`` (process CPU time) at ``--threads 1`` holds on a loaded machine.
A few minutes at the defaults (the head is left out past 512 rows: its prefill rows are the last tokens only).
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch

from benchmarks.kernel_timing import best_interleaved
from tpengine.backends.cpu import cpu_blocked, cpu_gemm

#: SmolLM2-135M's float32 weights at tp=1, (out, in): q/k/v fused, o, gate/up fused, down, the tied LM head.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 8192])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    print(f"load average {os.getloadavg()[0]:.2f}, {a.threads} threads, {a.clock} clock")
    for n, k in SHAPES:
        b = cpu_blocked.pack(torch.randn(n, k) * 0.05)
        runs = {"blocked kernel": cpu_blocked.bind(b), "blocked gemm": cpu_gemm.bind_blocked(b)}
        for rows in a.rows:
            if n > 16384 and rows > 512:
                continue
            x = torch.randn(rows, k)
            assert torch.equal(*(f(x) for f in runs.values())), (n, k, rows)
            flop = 2 * rows * n * k
            reps = max(1, int(2e8 / flop))
            best = best_interleaved({name: functools.partial(f, x) for name, f in runs.items()}, a.rounds, reps, clock)
            cells = ", ".join(f"{name} {t * 1e6:.0f} us ({flop / t / 1e9:.0f} GFLOP/s)" for name, t in best.items())
            print(f"{k}->{n} at {rows} rows: {cells}; {best['blocked kernel'] / best['blocked gemm']:.2f}x", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
