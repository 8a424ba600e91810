"""float32 linears at a decode step's rows side by side (issue 59): the plain row-major weight's GEMV
(``tpe_gemv_f32``, a horizontal sum per output row), tpengine's float32 blocked layout (``tpe_blocked_gemm_f32``,
``[n/16][k][16]``: one sequential stream, no horizontal sums), oneDNN's packed layout and MKL's ``F.linear`` on
the plain weight, at SmolLM2-135M's float32 shapes (tp=1), each shape's weights rotated over copies past the
last-level cache (so they stream from memory, as in a decode step), interleaved rounds (each round times every
candidate once, in turn). At one row (wall clock) also the GEMV's and the blocked GEMM's time inside a decode
program (their C call alone, no Python: ``cpu_program.one_row_us``), what a step that runs one pays.

    python -m benchmarks.blocked_f32 [--rounds 5] [--threads N] [--rows 1] [--clock wall|cpu] [--dtype bfloat16]

``--dtype bfloat16`` runs the same candidates on bfloat16 weights (``tpe_gemv_bf16``, the bfloat16 blocked layout
``tpe_blocked_gemm_bf16``: on an AVX2 build, ``TPENGINE_ISA=avx2``, both widen pairs by shift / mask).
Prints per shape and candidate the best round's microseconds per call and GB/s of weight read (weight
bytes / time), and the load average at the start and end. About a minute at one row; ``--rows 64`` / ``512``
compare the prefill GEMMs (the GEMV takes up to 8 rows: left out there).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from tpengine.backends.cpu import cpu_blocked, cpu_gemv, cpu_program
from tpengine.backends.cpu.linear_layout import prepack

#: SmolLM2-135M's float32 weights at tp=1, (out, in): q/k/v fused, o, gate/up fused, down, the tied LM head.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))
#: bytes of weight each shape's copies hold together (past a 32 MiB last-level cache)
ROTATE_BYTES = 96 << 20


def candidates(x: torch.Tensor, plain: list, blocked: list, packed: list) -> dict:
    """``name -> (f(i), weights)``: one call on copy ``i``."""
    out, sfx = {}, "bf16" if x.dtype == torch.bfloat16 else "f32"
    if x.shape[0] <= cpu_gemv.MAX_ROWS:
        gemvs = [cpu_gemv.bind(w) for w in plain]
        out[f"plain GEMV (tpe_gemv_{sfx})"] = lambda i: gemvs[i](x)
    runs = [cpu_blocked.bind(b) for b in blocked]
    out[f"blocked (tpe_blocked_gemm_{sfx})"] = lambda i: runs[i](x)
    if packed:
        op = torch.ops.mkldnn._linear_pointwise
        out["oneDNN packed"] = lambda i: op(x, packed[i], None, "none", [], "")
    out["F.linear (MKL, plain)"] = lambda i: F.linear(x, plain[i])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    torch.set_num_threads(a.threads)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    print(f"load average {os.getloadavg()[0]:.2f}, {a.threads} threads, {a.rows} row(s), {a.dtype}, {a.clock} clock")
    if not cpu_blocked.available(torch.zeros(16, 16, dtype=dtype)):
        raise SystemExit(f"error: this build has no {a.dtype} blocked kernels")
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        copies = max(2, ROTATE_BYTES // (size * n * k)) if n * k * size < ROTATE_BYTES else 1
        plain = [(torch.randn(n, k, generator=g) * 0.05).to(dtype) for _ in range(copies)]
        blocked = [cpu_blocked.pack(w) for w in plain]
        packed = [q for q in (prepack(w) for w in plain) if q is not None]
        x = torch.randn(a.rows, k, generator=g).to(dtype)
        fs = candidates(x, plain, blocked, packed)
        calls = max(copies, 400 * 576 * 576 // (n * k * max(1, a.rows // 8)))
        best = {name: float("inf") for name in fs}
        prog = {}
        for _ in range(a.rounds):
            for name, f in fs.items():
                for i in range(min(copies, 4)):
                    f(i)  # warm-up
                t = clock()
                for i in range(calls):
                    f(i % copies)
                best[name] = min(best[name], (clock() - t) / calls)
            if a.rows == 1 and a.clock == "wall" and cpu_program.runs():  # (time_us: wall time)
                for name, specs in (("plain GEMV, in a program", [cpu_gemv.bind(w).c_spec for w in plain]),
                                    ("blocked, in a program", [cpu_blocked.bind(b).c_spec for b in blocked])):
                    prog[name] = min(prog.get(name, float("inf")), cpu_program.one_row_us(specs, dtype) / 1e6)
        for name, t in {**best, **prog}.items():
            print(f"{k:5d} -> {n:5d}  {name:32s} {t * 1e6:9.1f} us  {size * n * k / t / 1e9:6.1f} GB/s")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
