"""The bfloat16 blocked layout's GEMM paths beside oneDNN's packed layout, at a decode batch's and a prefill's rows
(issue 59): the blocked kernel's ``vdpbf16ps`` path and its AMX path (``cpu_blocked.c``: the blocked weight loaded
as AMX's B tiles; :func:`tpengine.backends.cpu.cpu_blocked.set_amx_rows`), and ``torch.ops.mkldnn._linear_pointwise``
on oneDNN's packed weight (AMX where the CPU has it), on SmolLM2-135M's bfloat16 shapes (tp=1) with random weights,
each shape as several copies (up to ``--bytes`` per shape) called in turn so the weights stream from memory as in a
step; interleaved rounds (each round times every path in turn, the order alternating).

    python -m benchmarks.gemm_blocked_amx [--rows 1 8 64 2048] [--rounds 5] [--threads N] [--clock wall|cpu]
                                          [--shapes 960x576 ... (out x in; the tied head: 49152x576)]

Prints per shape and row count the best round's microseconds per call of each path, GFLOP/s, and AMX's ratio to
each other path; the load average at the start and end. Skips the AMX path where it does not run (no AMX-BF16, the
OS refuses tile data, an AVX2 build). About a minute at the defaults.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch

from benchmarks.kernel_timing import best_interleaved
from tpengine.backends.cpu import cpu_blocked, linear_layout

#: SmolLM2-135M's bfloat16 weights at tp=1, (out, in): q/k/v fused, o, gate/up fused, down.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 2048])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--bytes", type=int, default=32 << 20, help="synthetic weight bytes per shape (copies)")
    p.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES],
                   help="weight shapes, out x in (default: SmolLM2-135M's four; its tied head is 49152x576)")
    a = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes]
    torch.set_num_threads(a.threads)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    amx = cpu_blocked.amx_available()
    old = cpu_blocked.amx_rows()
    print(f"load average {os.getloadavg()[0]:.2f}, {a.threads} threads, {a.clock} clock, AMX path "
          f"{'runs' if amx else 'does not run here'}")
    try:
        for n, k in shapes:
            copies = max(1, a.bytes // (2 * n * k))
            plain = [torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for _ in range(copies)]
            blocked = [cpu_blocked.bind(cpu_blocked.pack(w)) for w in plain]
            packed = [linear_layout.prepack(w) for w in plain]
            del plain

            def blocked_path(min_rows: int):
                def run(x: torch.Tensor) -> None:
                    cpu_blocked.set_amx_rows(min_rows)
                    for f in blocked:
                        f(x)
                return run

            def onednn(x: torch.Tensor) -> None:
                for w in packed:
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            runs = {"vdpbf16ps": blocked_path(0), **({"amx": blocked_path(1)} if amx else {}),
                    **({"packed": onednn} if packed[0] is not None else {})}
            for rows in a.rows:
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                flop = 2 * rows * n * k * copies
                reps = max(1, int(2e8 / flop))
                best = {name: t / copies for name, t in best_interleaved(
                    {name: functools.partial(f, x) for name, f in runs.items()}, a.rounds, reps, clock).items()}
                cells = ", ".join(f"{name} {t * 1e6:.0f} us ({2 * rows * n * k / t / 1e9:.0f} GFLOP/s)"
                                  for name, t in best.items())
                ratios = "; ".join(f"{o} / amx {best[o] / best['amx']:.2f}x" for o in runs if o != "amx") if amx else ""
                print(f"{k}->{n} at {rows} rows ({copies} copies): {cells}; {ratios}", flush=True)
    finally:
        cpu_blocked.set_amx_rows(old)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
