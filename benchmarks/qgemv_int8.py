"""One-row int8 weight GEMVs side by side (issue 59): today's float kernel (``tpe_qgemv_int8``), torch's
``_weight_int8pack_mm`` and the int8 x int8 kernel (``tpe_qgemv_int8_q8``), at SmolLM2-135M's int8 shapes,
bfloat16 activations, each shape's weights rotated over copies past the last-level cache (so they stream
from memory, as in a decode step), interleaved rounds (each round times every kernel once, in turn).

    python -m benchmarks.qgemv_int8 [--rounds 5] [--threads N] [--rows 1] [--clock wall|cpu] [--resident]

Prints per shape and kernel the best round's microseconds per call and GB/s of weight read (bytes of
int8 weight + scales / time), and the load average at the start and end. Under a minute. ``--clock cpu``
(with ``--threads 1``) counts the process's CPU time, not wall time: on a loaded machine the time
slices lost to other processes are left out (the weights still stream from memory). ``--resident``: one
copy of each weight, read again and again from the caches (what the kernels' instructions cost, not the
memory's rate; the LM head still streams).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from tpengine.backends.cpu import cpu_qgemv

#: SmolLM2-135M's int8 weights at tp=1, (out, in): o, one of k and v alone, q/k/v's fused rows, the MLP's
#: gate/up (two of 1536, fused), down and the tied LM head.
SHAPES = ((576, 576), (192, 576), (960, 576), (3072, 576), (576, 1536), (49152, 576))
#: bytes of weight each shape's copies hold together (past a 32 MiB last-level cache)
ROTATE_BYTES = 96 << 20


def kernels(x: torch.Tensor) -> dict:
    """The candidates: ``name -> f(q, s)``."""
    return {"float (tpe_qgemv_int8)": lambda q, s: cpu_qgemv.int8(x, q, s),
            "torch _weight_int8pack_mm": lambda q, s: torch._weight_int8pack_mm(x, q, s),
            "int8 x int8 (tpe_qgemv_int8_q8)": lambda q, s: cpu_qgemv.int8(x, q, s, act_int8=True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--resident", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    print(f"load average {os.getloadavg()[0]:.2f}, {a.threads} threads, {a.rows} row(s), bfloat16 activations, "
          f"{a.clock} clock, weights {'resident' if a.resident else 'streamed'}")
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        copies = 1 if a.resident else max(2, ROTATE_BYTES // (n * k))
        ws = [(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
               (torch.rand(n, generator=g) * 0.01).bfloat16()) for _ in range(copies)]
        x = torch.randn(a.rows, k, generator=g).bfloat16()
        fs = kernels(x)
        calls = max(copies, 2000 * 576 * 576 // (n * k))
        best = {name: float("inf") for name in fs}
        for _ in range(a.rounds):
            for name, f in fs.items():
                for q, s in ws[:4]:
                    f(q, s)  # warm-up
                t = clock()
                for i in range(calls):
                    f(*ws[i % copies])
                best[name] = min(best[name], (clock() - t) / calls)
        for name, t in best.items():
            gbs = (n * k + 2 * n) / t / 1e9
            print(f"{k:5d} -> {n:5d}  {name:32s} {t * 1e6:9.1f} us  {gbs:6.1f} GB/s")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
