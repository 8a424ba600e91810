"""Microbenchmark: the paged decode attention kernel alone over an int8 KV cache against a bfloat16 one (issue 59).

    python -m benchmarks.bench_kv_kernel                         (4096 keys, SmolLM2's and TinyLlama-1.1B's shapes)
    python -m benchmarks.bench_kv_kernel --base HEAD~3           (also the int8 kernel of that git revision)

One call = one layer of a batch-1 decode step (one row, no RoPE, nothing stored), ``--context`` keys, ``--threads`` (1),
straight through ctypes (no Python checks): ``tpe_paged_decode_bf16`` over a bfloat16 cache (its AVX-512 path, not
AMX), ``tpe_paged_decode_i8_bf16`` over an int8 one. ``--layers`` separate caches are called in turn so that the rows
stream from memory as in a step (30 layers of SmolLM2's 3 KV heads of 64 at 4096 keys: 94 MB bfloat16, 50 MB
int8, beyond the L3). Shapes (one rank): SmolLM2-135M 9 query heads on 3 KV heads of 64, TinyLlama-1.1B 32 on 4 of
64. ``--base REV``: ``cpu_paged_i8.c`` and its headers of git revision REV built beside (same compiler and
flags, ``cpu_library.flags()``) and timed as a third candidate with the same arguments -- before / after in one
run. The candidates alternate within every round (a shared machine's load falls on all alike); per candidate:
the best and median over ``--rounds`` of microseconds per call and the GB/s of KV read (codes + scales, or the
bfloat16 rows) at that time. ``--cpu-time``: CPU time instead of wall time (on a loaded machine).
"""

from __future__ import annotations

import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Annotated

import torch
import typer

app = typer.Typer(add_completion=False)

#: name -> q_to_kv at one rank (head size 64 in both)
SHAPES = {"smollm2-135m": [h // 3 for h in range(9)], "tinyllama-1.1b": [h // 8 for h in range(32)]}
CSRC = "tpengine/backends/cpu/csrc"


def build_base(rev: str, folder: Path) -> ctypes.CDLL:
    """``cpu_paged_i8.c`` (with ``bf16.h`` and ``paged.h``) of git revision ``rev`` as a library in ``folder``,
    built with :func:`cpu_library.flags`. Raises subprocess.CalledProcessError if git or the compiler fails."""
    from tpengine.backends.cpu import cpu_library

    root = Path(__file__).resolve().parent.parent
    for name in ("cpu_paged_i8.c", "bf16.h", "paged.h"):
        text = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=root, check=True, capture_output=True).stdout
        (folder / name).write_bytes(text)
    out = folder / "base.so"
    subprocess.run(["cc", *cpu_library.flags(), str(folder / "cpu_paged_i8.c"), "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.tpe_paged_decode_i8_bf16.argtypes = cpu_library.SIGNATURES["tpe_paged_decode_i8_bf16"]
    lib.tpe_paged_decode_i8_bf16.restype = ctypes.c_int64
    return lib


def run(context: int, layers: int, rounds: int, calls: int, shapes: list[str], base: str | None,
        clock=time.perf_counter, threads: int = 1) -> dict:
    """The timings (module docstring): ``{shape: {candidate: {"us_best", "us_median", "gbs_best"}, "int8 speed":
    bfloat16's best / int8's best, ...}}``. Raises RuntimeError without the C kernels."""
    from tpengine.backends import kv_quant
    from tpengine.backends.cpu import cpu_library, cpu_paged  # cpu_paged: the block tables' index

    if cpu_library.missing("tpe_paged_decode_bf16", "tpe_paged_decode_i8_bf16") is not None:
        raise RuntimeError(str(cpu_library.missing("tpe_paged_decode_bf16", "tpe_paged_decode_i8_bf16")))
    tmp = tempfile.TemporaryDirectory()
    base_lib = build_base(base, Path(tmp.name)) if base else None
    result = {}
    for shape in shapes:
        q_to_kv, d, bs = SHAPES[shape], 64, 16
        g = torch.Generator().manual_seed(0)
        hkv, nb = max(q_to_kv) + 1, -(-context // bs) + 1
        qmap = torch.tensor(q_to_kv)
        index = cpu_paged.paged_index(torch.full((1,), -1), torch.randperm(nb - 1, generator=g)[None, : nb - 1],
                                      torch.tensor([context]))
        q = torch.randn(1, len(q_to_kv), d, generator=g).to(torch.bfloat16)
        kv = torch.randn(1, hkv, d, generator=g).to(torch.bfloat16)
        caches = {"bfloat16": [], "int8": []}
        for _ in range(layers):
            kc, vc = (torch.randn(nb, bs, hkv, d, generator=g).to(torch.bfloat16) for _ in "kv")
            caches["bfloat16"].append((kc, vc, None))
            (kq, ks), (vq, vs) = kv_quant.quantize(kc), kv_quant.quantize(vc)
            caches["int8"].append((kq, vq, (ks, vs)))
        out = torch.empty(1, len(q_to_kv), d, dtype=torch.bfloat16)

        def caller(fn, int8, q=q, kv=kv, index=index, qmap=qmap, hkv=hkv, nb=nb, bs=bs, out=out):
            """One layer's call of C function ``fn`` (an int8 kernel if ``int8``) straight through ctypes."""
            bt, hq = index.block_tables, len(q_to_kv)
            head = (q.data_ptr(), hq * d, kv.data_ptr(), hkv * d, kv.data_ptr(), hkv * d, None, None,
                    index.slot_mapping.data_ptr(), bt.data_ptr(), bt.shape[1], index.context_lens.data_ptr())
            tail = (nb, bs, qmap.data_ptr(), hq, hkv, d, d ** -0.5, out.data_ptr(), 1)

            def call(kc, vc, scales):
                if int8:
                    bad = fn(*head, kc.data_ptr(), vc.data_ptr(), scales[0].data_ptr(), scales[1].data_ptr(), *tail,
                             threads, 0, 0.0)
                else:
                    bad = fn(*head, kc.data_ptr(), vc.data_ptr(), *tail, 0, threads, 0, 0.0)
                assert bad == -1
            return call

        lib = cpu_library.load()
        cands = {"bfloat16": (caller(lib.tpe_paged_decode_bf16, False), "bfloat16"),
                 "int8": (caller(lib.tpe_paged_decode_i8_bf16, True), "int8")}
        if base_lib is not None:
            cands[f"int8 @ {base}"] = (caller(base_lib.tpe_paged_decode_i8_bf16, True), "int8")
        kv_bytes = {"bfloat16": 2 * context * hkv * d * 2, "int8": 2 * context * hkv * (d + 4)}
        times = {c: [] for c in cands}
        for r in range(rounds + 1):
            for c in (list(cands) if r % 2 == 0 else list(cands)[::-1]):
                fn, cache = cands[c]
                t0 = clock()
                for i in range(calls):
                    fn(*caches[cache][i % layers])
                if r:  # round 0: warm-up
                    times[c].append((clock() - t0) / calls * 1e6)
        res = {}
        for c, t in times.items():
            b = kv_bytes[cands[c][1]]
            res[c] = {"us_best": round(min(t), 1), "us_median": round(statistics.median(t), 1),
                      "gbs_best": round(b / min(t) / 1e3, 2)}
        res["int8 speed"] = round(res["bfloat16"]["us_best"] / res["int8"]["us_best"], 3)
        if base_lib is not None:
            res["int8 vs base"] = round(res[f"int8 @ {base}"]["us_best"] / res["int8"]["us_best"], 3)
        result[shape] = res
    return result


@app.command()
def main(context: Annotated[int, typer.Option(help="keys per call")] = 4096,
         layers: Annotated[int, typer.Option(help="separate caches called in turn")] = 30,
         rounds: Annotated[int, typer.Option(help="alternating rounds")] = 7,
         calls: Annotated[int, typer.Option(help="calls per timing")] = 60,
         shape: Annotated[list[str], typer.Option(help=f"one of {', '.join(SHAPES)} (repeatable)")] = None,
         base: Annotated[str | None, typer.Option(help="git revision whose int8 kernel is timed beside")] = None,
         threads: Annotated[int, typer.Option(help="OpenMP threads per call")] = 1,
         cpu_time: Annotated[bool, typer.Option(help="time.process_time (CPU time, which a loaded machine's time-"
                                                     "slicing does not inflate) instead of wall time")] = False):
    """Time the paged decode kernels (module docstring) and print the result as JSON with the load average."""
    shapes = shape or list(SHAPES)
    for s in shapes:
        if s not in SHAPES:
            raise typer.BadParameter(f"invalid shape {s!r}: must be one of {', '.join(SHAPES)}")
    res = run(context, layers, rounds, calls, shapes, base, time.process_time if cpu_time else time.perf_counter,
              threads)
    res["clock"] = "process_time" if cpu_time else "perf_counter"
    import os
    res["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    app()
