"""A batch-1 decode step's weight products alone, as the decode program makes them (issue 59): SmolLM2-135M's
120 linears (30 layers of q/k/v fused 576 -> 960, o 576 -> 576, gate/up 576 -> 3072, down 1536 -> 576) and,
with ``--head``, the tied 576 -> 49152 LM head, one program of one-row C calls (``cpu_program.Program``, the
"lin" / "q8" / "q4" ops), for each weight kind: bfloat16 in the blocked layout (the yardstick: it reads at the
triad's rate), int8 per channel (``tpe_qgemv_int8``, and ``tpe_qgemv_int8_q8``: int8 activations) and int4
group 32 with zero codes (``tpe_qgemv_int4``, ``tpe_qgemv_int4_q8``). Random weights of the model's shapes,
a whole model of each (~135-270 MB: read from memory, not the caches); bfloat16 activations.

    python -m benchmarks.qgemv_step [--rounds 5] [--threads N] [--clock wall|cpu] [--head] [--only NAME ...]
                                    [--ab-lib SO ...] [--huge-pages]

Interleaved rounds (each round runs every kind's program once, a few steps each, in turn, every other round
in the opposite order); prints per kind the best round's milliseconds a step (and the median round's), the
weight bytes it read, GB/s, and the load average at the start and end. ``--clock cpu`` (with ``--threads 1``)
counts the process's CPU time (a loaded machine's lost time slices left out). ``--ab-lib`` adds, for each
quantized kind run, the same program calling each given library's function of the same name instead of the
build's (a kernel's before / after in one process, interleaved), e.g. the commit before's source built alone:

    git show HEAD~1:tpengine/backends/cpu/csrc/cpu_qgemv.c > /tmp/old.c
    gcc -O3 -march=native -fopenmp -shared -fPIC -Itpengine/backends/cpu/csrc /tmp/old.c -o /tmp/old.so

with ``-march=x86-64-v3`` for ``TPENGINE_ISA=avx2``. ``--huge-pages`` adds, for each kind, a second model's
weights moved into 2 MiB transparent huge pages (``memory.collapse_huge_pages``, as a long job's engine does),
run interleaved with the first's 4 KiB pages. About a minute.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time

import torch

from tpengine.backends.cpu import cpu_blocked, cpu_program, cpu_qgemv, memory
from tpengine.model.quant.weights import Int4CodedWeight

#: (out, in) of one layer's products at tp=1, and the tied head
LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD = (49152, 576)
LAYERS = 30


def _int8(n: int, k: int, g: torch.Generator):
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    return q, (torch.rand(n, generator=g) * 0.01 + 1e-3).bfloat16()


def _int4(n: int, k: int, g: torch.Generator) -> Int4CodedWeight:
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    s = (torch.rand(k // 32, n, generator=g) * 0.01 + 1e-3).bfloat16()
    return Int4CodedWeight(q, s, torch.randint(-128, 128, (k // 32, n), dtype=torch.int8, generator=g), 32)


def specs(kind: str, shapes: list[tuple[int, int]], g: torch.Generator) -> tuple[list, list, int]:
    """``(c_specs, keep-alive tensors, weight bytes)`` of one bound one-row call per shape for ``kind``."""
    out, keep, nbytes = [], [], 0
    for n, k in shapes:
        if kind == "bfloat16 blocked":
            w = cpu_blocked.pack((torch.randn(n, k, generator=g) * 0.02).bfloat16())
            keep.append(w)
            out.append(cpu_blocked.bind(w).c_spec)
            nbytes += w.numel() * 2
        elif kind.startswith("int8"):
            q, s = _int8(n, k, g)
            keep += [q, s]
            out.append(cpu_qgemv.bind_int8(q, s, act_int8="x int8" in kind).c_spec)
            nbytes += q.numel() + 2 * n
        else:
            m = _int4(n, k, g)
            keep.append(m)
            out.append(cpu_qgemv.bind_int4(m.packed, m.scales, 32, n, m.zero_codes, act_int8="x int8" in kind).c_spec)
            nbytes += m.packed.numel() + 3 * m.scales.numel()
    return out, keep, nbytes


def program(spec_list: list, lib: ctypes.CDLL | None = None) -> tuple[cpu_program.Program, torch.Tensor]:
    """One program of the calls, each reading the same input row (a step's products back to back); with
    ``lib``, each op calls ``lib``'s function of its name instead of the build's."""
    prog = cpu_program.Program(576, torch.bfloat16)
    x = torch.randn(1, 1536).bfloat16()
    nt = torch.get_num_threads()
    y = None
    for spec in spec_list:
        kind, name, *c = spec
        if kind == "lin":
            k, wp, n = c
            y = prog.buffer(n, f"y{n}")
            prog.add(kind, name, [x.data_ptr(), 1, k, wp, n, y.data_ptr(), nt])
        elif kind == "q8":
            k, qp, sp, n, bf = c
            y = prog.buffer(n, f"y{n}")
            prog.add(kind, name, [x.data_ptr(), 1, k, qp, sp, n, y.data_ptr(), bf, nt])
        else:
            k, pp, sp, zp, gs, n, n_pad, block, bf = c
            y = prog.buffer(n, f"y{n}")
            prog.add(kind, name, [x.data_ptr(), 1, k, pp, sp, zp, gs, n, n_pad, block, y.data_ptr(), bf, nt])
        if lib is not None:  # the op's function word (cpu_program's row: signature, mask, function, arguments)
            prog.rows[-1][2] = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    return prog.finish(y), x


KINDS = ("bfloat16 blocked", "int8", "int8 x int8", "int4", "int4 x int8")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--head", action="store_true", help="add the tied LM head (576 -> 49152) to the step")
    p.add_argument("--steps", type=int, default=5, help="steps a round")
    p.add_argument("--only", nargs="*", choices=KINDS, default=list(KINDS))
    p.add_argument("--ab-lib", nargs="*", default=[], metavar="SO",
                   help="also run each quantized kind with these libraries' functions (a kernel's before / after)")
    p.add_argument("--huge-pages", action="store_true",
                   help="also run each kind on a copy of its weights in transparent huge pages (4 KiB pages / 2 MiB)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    shapes = [s for _ in range(LAYERS) for s in LAYER] + ([HEAD] if a.head else [])
    g = torch.Generator().manual_seed(0)
    runs = {}
    for kind in a.only:
        sl, keep, nbytes = specs(kind, shapes, g)
        prog, x = program(sl)
        runs[kind] = (prog, (keep, x), nbytes)
        for so in a.ab_lib if kind.startswith("int") else []:
            lib = ctypes.CDLL(os.path.abspath(so))
            prog, x2 = program(sl, lib)
            runs[f"{kind} [{os.path.basename(so)}]"] = (prog, (keep, x2, lib), nbytes)
        if a.huge_pages:
            sl2, keep2, _ = specs(kind, shapes, g)
            tensors = [t for o in keep2 for t in ([o] if isinstance(o, torch.Tensor) else o.buffers())]
            done, regions = memory.collapse_huge_pages(tensors)
            print(f"{kind}: {done} of {regions} 2 MiB regions in huge pages")
            prog, x2 = program(sl2)
            runs[f"{kind} [huge pages]"] = (prog, (keep2, x2), nbytes)
    print(f"load average {os.getloadavg()[0]:.2f}, {a.threads} threads, {a.clock} clock, {len(shapes)} products "
          f"a step, bfloat16 activations")
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(a.rounds):
        for kind, (prog, _, _) in runs.items() if r % 2 == 0 else reversed(runs.items()):
            fn = prog.run_fn
            fn(prog.ops_p, prog.n_ops, prog.params_p, 0)  # warm-up
            t = clock()
            for _ in range(a.steps):
                fn(prog.ops_p, prog.n_ops, prog.params_p, 0)
            times[kind].append((clock() - t) / a.steps)
    for kind, ts in times.items():
        nbytes, t, med = runs[kind][2], min(ts), sorted(ts)[len(ts) // 2]
        print(f"{kind:18s} {t * 1e3:8.3f} ms a step (median {med * 1e3:.3f})  {nbytes / 1e6:7.1f} MB  "
              f"{nbytes / t / 1e9:6.1f} GB/s")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
