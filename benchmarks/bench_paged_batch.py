"""Microbenchmark: the paged decode attention kernel alone at a decode batch (``make bench``'s decode steps).

    python -m benchmarks.bench_paged_batch                          (float32, 64 sequences, this tree's library)
    python -m benchmarks.bench_paged_batch --base 1f004eb~1         (also cpu_paged.c of that git revision)
    TPENGINE_ISA=avx2 python -m benchmarks.bench_paged_batch ...    (the AVX2 class's build)

One call = one layer of a decode step of ``--batch`` sequences, SmolLM2-135M's heads (9 query heads on 3 KV heads
of 64), block size 16, no RoPE, nothing stored: sequence ``b`` attends to ``129 + (2 b + step) % 128`` keys (the
contexts of the bench's 64 x 128 -> 128 workload, about 192 on average), its first 8 blocks allocated in order
(the prefill's) and the rest round-robin over the sequences (the decode's), as the engine's allocator leaves
them. ``--layers`` separate caches (30: ~750 MB of float32 K/V, beyond the last-level cache) are called in turn
so that the rows stream from memory as in a step; ``--layers 1 --batch 8`` measures the kernel on rows in cache.
Straight through ctypes (no Python checks); bfloat16's AMX path with ``--amx-min-batch 1``.
``--base REV``: ``cpu_paged.c`` and its headers of git revision REV
built beside (same compiler and flags, :func:`cpu_library.flags`) and timed as a second candidate: before / after
in one run, the outputs compared bit for bit. The candidates alternate within every round (a shared machine's
load falls on all alike); per candidate the best and median microseconds per layer over ``--rounds`` and the
GB/s of K/V read at the best. Default clock: the calling thread's CPU time at 1 thread (a loaded machine's
time-slicing does not inflate it), wall time at more.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

CSRC = "tpengine/backends/cpu/csrc"
HEADERS = ("cpu_paged.c", "bf16.h", "paged.h", "amx.h")


def build_base(rev: str, folder: Path, name: str) -> ctypes._CFuncPtr:
    """``cpu_paged.c`` (with its headers) of git revision ``rev`` built in ``folder`` with
    :func:`cpu_library.flags` -> its C function ``name``. Raises subprocess.CalledProcessError if git or the
    compiler fails."""
    from tpengine.backends.cpu import cpu_library

    root = Path(__file__).resolve().parent.parent
    for f in HEADERS:
        text = subprocess.run(["git", "show", f"{rev}:{CSRC}/{f}"], cwd=root, check=True, capture_output=True).stdout
        (folder / f).write_bytes(text)
    out = folder / "base.so"
    subprocess.run(["cc", *cpu_library.flags(), str(folder / "cpu_paged.c"), "-o", str(out), "-lm"], check=True)
    fn = getattr(ctypes.CDLL(str(out)), name)
    fn.argtypes, fn.restype = cpu_library.SIGNATURES[name], ctypes.c_int64
    return fn


def run(dtype: torch.dtype, batch: int, layers: int, rounds: int, threads: int, step: int,
        base: str | None, amx_min_batch: int = 0) -> dict:
    """The timings (module docstring): ``{candidate: {"us_best", "us_median", "gbs_best"}, "speed vs base",
    "equal to base"}``. Raises RuntimeError without the C kernel."""
    from tpengine.backends.cpu import cpu_library

    name = {torch.float32: "tpe_paged_decode_f32", torch.bfloat16: "tpe_paged_decode_bf16"}[dtype]
    if cpu_library.missing(name) is not None:
        raise RuntimeError(str(cpu_library.missing(name)))
    cands = {"this tree": getattr(cpu_library.load(), name)}
    tmp = tempfile.TemporaryDirectory()
    if base:
        cands[f"@ {base}"] = build_base(base, Path(tmp.name), name)
    hq, hkv, d, bs, per = 9, 3, 64, 16, 16  # per: blocks a sequence's table holds (256 keys)
    lens = [129 + (2 * b + step) % 128 for b in range(batch)]
    tables, nxt = [[0] * per for _ in range(batch)], 0
    for b in range(batch):  # the prefill's 8 blocks a sequence, in order
        for j in range(8):
            tables[b][j], nxt = nxt, nxt + 1
    for j in range(8, per):  # the decode's, round-robin
        for b in range(batch):
            tables[b][j], nxt = nxt, nxt + 1
    g = torch.Generator().manual_seed(0)
    bt, lens_t = torch.tensor(tables), torch.tensor(lens)
    slots, qmap = torch.full((batch,), -1), torch.tensor([h // (hq // hkv) for h in range(hq)])
    caches = [tuple(torch.randn(nxt, bs, hkv, d, generator=g).to(dtype) for _ in "kv") for _ in range(layers)]
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    outs = {c: torch.empty(batch, hq, d, dtype=dtype) for c in cands}

    def call(c: str, kc: torch.Tensor, vc: torch.Tensor) -> None:
        p = q.data_ptr()
        bad = cands[c](p, hq * d, p, hq * d, p, hq * d, None, None, slots.data_ptr(), bt.data_ptr(), per,
                       lens_t.data_ptr(), kc.data_ptr(), vc.data_ptr(), nxt, bs, qmap.data_ptr(), hq, hkv, d,
                       d ** -0.5, outs[c].data_ptr(), batch, amx_min_batch, threads, 0, 0.0)
        assert bad == -1

    clock = time.thread_time if threads == 1 else time.perf_counter
    times = {c: [] for c in cands}
    for r in range(rounds + 1):
        for c in (list(cands) if r % 2 == 0 else list(cands)[::-1]):
            t0 = clock()
            for kc, vc in caches:
                call(c, kc, vc)
            if r:  # round 0: warm-up
                times[c].append((clock() - t0) / layers * 1e6)
    kv_bytes = sum(2 * n * hkv * d * dtype.itemsize for n in lens)
    res = {c: {"us_best": round(min(t), 1), "us_median": round(statistics.median(t), 1),
               "gbs_best": round(kv_bytes / min(t) / 1e3, 2)} for c, t in times.items()}
    if base:
        call("this tree", *caches[0])
        call(f"@ {base}", *caches[0])
        res["speed vs base"] = round(res[f"@ {base}"]["us_best"] / res["this tree"]["us_best"], 3)
        res["equal to base"] = torch.equal(outs["this tree"], outs[f"@ {base}"])
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--batch", type=int, default=64, help="sequences a call")
    p.add_argument("--layers", type=int, default=30, help="separate caches called in turn")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds")
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads a call")
    p.add_argument("--step", type=int, default=63, help="decode step: the contexts 129 + (2 b + step) %% 128")
    p.add_argument("--base", default=None, help="git revision whose cpu_paged.c is timed beside")
    p.add_argument("--amx-min-batch", type=int, default=0,
                   help="bfloat16: the kernel's AMX path from this many sequences (0: never; make bench's measured "
                        "choice on an AMX machine takes it at 64)")
    a = p.parse_args()
    res = run(getattr(torch, a.dtype), a.batch, a.layers, a.rounds, a.threads, a.step, a.base, a.amx_min_batch)
    res["isa"], res["load average"] = os.environ.get("TPENGINE_ISA", "native"), os.getloadavg()[0]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
