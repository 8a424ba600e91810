"""Which CPU weight layout each linear shape runs in, chosen by measurement on the machine that runs.

A CPU linear layer holds its weight in ONE of two layouts (never both: that would be a second copy):

* ``plain``: the row-major ``[out, in]`` tensor, multiplied by ``F.linear`` (MKL's sgemm in float32,
  torch's oneDNN/cpublas GEMM in half precision);
  or, at up to a few rows, tpengine's own GEMV kernel (:mod:`tpengine.backends.cpu.cpu_gemv`), at a
  decode batch's rows tpengine's GEMM (:mod:`tpengine.backends.cpu.cpu_gemm`: float32, and bfloat16
  widened block by block on AVX2 builds), and for a half-precision weight torch's float32 GEMM on the
  weight widened slab by slab (:mod:`tpengine.backends.cpu.cpu_widen`: CPUs without a bfloat16 GEMM),
  where they measured faster;
* ``packed``: oneDNN's blocked layout (:func:`tpengine.model.layers.linear.prepack`), multiplied by
  ``torch.ops.mkldnn._linear_pointwise``.

Which one is faster depends on the CPU, the dtype, the shape and the number of rows, and the
order differs between CPU types (docs/notes/kernels.md). So nothing is hard-coded: :func:`choose_layouts` times
both layouts for every distinct ``(out, in)`` shape of the model, at the row buckets
:data:`ROW_BUCKETS`, over as many distinct weights of that shape as the model has (up to
:data:`MEASURE_BYTES`), so the weights stream from memory as they do in a step rather than sitting
in a cache. A shape takes the layout with the smaller sum over the buckets of its time relative to
the faster one (:func:`tpengine.backends.cpu.measured.pick`). The timings are taken, checked and
cached by :func:`tpengine.backends.cpu.measured.timed` (twice on a quiet machine, cached per machine
when they agree; a busy machine without cached timings takes the default layout, packed where oneDNN
packs the dtype, unmeasured), so a machine measures once. A job too short to repay a reorder
(:func:`tpengine.backends.cpu.measured.short_job`: a one-token batch job) keeps every weight plain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpengine.backends.cpu import cpu_blocked, cpu_gemm, cpu_gemv, cpu_moe, cpu_program, cpu_widen, measured
from tpengine.backends.cpu.measured import time_us
from tpengine.config import CPU_LINEAR_CHOICES

LAYOUTS = ("plain", "packed", "blocked")
#: Rows per call the choice is measured at: one decoding sequence, a small batch, a full decode batch.
ROW_BUCKETS = (1, 8, 64)
#: The most weight bytes (per shape and layout) one measurement allocates; larger single weights
#: are not measured (they keep ``packed``, the layout that saves the per-call reorder).
MEASURE_BYTES = 256 << 20


#: The plain layout's paths: ``F.linear``, and tpengine's kernels on the same plain weight.
PLAIN_PATHS = ("plain", "gemv", "gemm", "widen")


@dataclass(frozen=True)
class LayoutChoice:
    """The layout chosen for one weight shape: ``layout`` ("plain" or "packed"), ``how``
    ("measured", "cached", "forced", "default" for an unmeasurable one, or another of
    :mod:`~tpengine.backends.cpu.measured`'s descriptions), the microseconds per
    call of each path at each of :data:`ROW_BUCKETS` (empty unless measured or cached), and for a
    plain weight ``kernels``, the path each bucket runs (:func:`plain_kernels`; empty: ``F.linear``
    throughout)."""

    layout: str
    how: str
    times_us: dict[str, list]
    kernels: tuple[str, ...] = ()

    def describe(self, shape: tuple[int, int]) -> str:
        """``"576->960 plain (gemv/gemv/gemm at 1/8/64 rows) (plain 85/146/337 us, packed 128/126/439 us, ...)"``."""
        out, inp = shape
        buckets = "/".join(map(str, ROW_BUCKETS))
        s = f"{inp}->{out} {self.layout}"
        if any(k != "plain" for k in self.kernels):
            s += f" ({'/'.join(self.kernels)} at {buckets} rows)"
        if self.times_us:
            cols = ", ".join(f"{k} {'/'.join('-' if t is None else f'{t:.0f}' for t in v)} us"
                             for k, v in self.times_us.items())
            s += f" ({cols} at {buckets} rows)"
        return s


def in_program(times_us: dict[str, list]) -> dict[str, list]:
    """The timings as a model that runs a decode program (:mod:`tpengine.backends.cpu.cpu_program`) meets
    them: the one-row times of the paths that program makes (the GEMV kernel's, the blocked layout's),
    taken in a program (``"gemv_program"``, ``"blocked_program"``: their C call alone, no Python), in place
    of their times called from Python; every other time as it is (oneDNN's packed layout and ``F.linear``
    have no C call at one row: with either, the step runs the layers' loop)."""
    out = {k: list(v) for k, v in times_us.items() if not k.endswith("_program")}
    for k in ("gemv", "blocked"):
        t = (times_us.get(f"{k}_program") or [None])[0]
        if t is not None and k in out:
            out[k][0] = t
    return out


def plain_kernels(times_us: dict[str, list]) -> tuple[str, ...]:
    """The plain layout's path at each of :data:`ROW_BUCKETS`: the fastest of ``F.linear`` ("plain")
    and the kernels timed there ("gemv" up to :data:`tpengine.backends.cpu.cpu_gemv.MAX_ROWS` rows, "gemm"
    from :data:`tpengine.backends.cpu.cpu_gemm.MIN_ROWS` (float32; bfloat16 on AVX2 builds), "widen" for
    a half-precision weight; None where
    a kernel does not take the bucket's rows); a tie keeps ``F.linear``."""
    out = []
    for i, p in enumerate(times_us["plain"]):
        best, name = p, "plain"
        for k in PLAIN_PATHS[1:]:
            t = (times_us.get(k) or [None] * len(ROW_BUCKETS))[i]
            if t is not None and t < best:
                best, name = t, k
        out.append(name)
    return tuple(out)


def kernel_at(kernels: tuple[str, ...], rows: int) -> str:
    """The path of :func:`plain_kernels` for a call of ``rows`` rows: that of the first bucket of at
    least ``rows`` rows; "plain" (``F.linear``) with no ``kernels`` and for the GEMM below
    :data:`tpengine.backends.cpu.cpu_gemm.MIN_ROWS` rows; past the last bucket (a prefill's rows) the
    last bucket's path where it is the GEMM (it runs any rows as passes of 64, at the rate it was
    timed at; docs/notes/avx2.md has it beside ``F.linear`` at 256 and 1024 rows) or the widened
    GEMM (its widening pass weighs less as rows grow), else "plain"."""
    for n, k in zip(ROW_BUCKETS, kernels):
        if rows <= n:
            return "plain" if k == "gemm" and rows < cpu_gemm.MIN_ROWS else k
    return kernels[-1] if kernels and kernels[-1] in ("gemm", "widen") else "plain"


def plain_times(times_us: dict[str, list]) -> list[float]:
    """The plain layout's time at each bucket, on the path :func:`plain_kernels` gives it."""
    return [times_us[k][i] for i, k in enumerate(plain_kernels(times_us))]


def pick(times_us: dict[str, list]) -> str:
    """The layout whose summed time relative to the faster layout, over the buckets, is smallest
    (:func:`tpengine.backends.cpu.measured.pick` of ``{"plain": [t1, t8, t64], "packed": [...], "gemv":
    [t1, t8, None], "gemm": [None, None, t64]}``, the plain layout timed on its fastest path per bucket,
    :func:`plain_times`, and ``"blocked"`` where it was timed); a tie keeps ``packed``, then ``plain``;
    "plain" where neither other layout was timed (oneDNN cannot pack the dtype here, no blocked kernels).
    Timings in a program's terms are :func:`in_program`'s."""
    others = {k: times_us[k] for k in ("packed", "blocked") if k in times_us}
    if not others:
        return "plain"
    return measured.pick({**({"packed": others.pop("packed")} if "packed" in others else {}),
                          "plain": plain_times(times_us), **others})


def c_at_one_row(layout: str, kernels: tuple[str, ...]) -> bool:
    """Whether a weight in ``layout`` with the plain ``kernels`` (:func:`plain_kernels`) makes a C call at
    one row (so a decode program can make it): the blocked layout, or plain on the GEMV kernel there."""
    return layout == "blocked" or (layout == "plain" and bool(kernels) and kernels[0] == "gemv")


def _give_up(times: dict[str, list], i: int) -> float | None:
    """The ``give_up_us`` of a path timed at bucket ``i`` after ``times`` (:func:`time_us`):
    :data:`~tpengine.backends.cpu.measured.GIVE_UP` times the fastest timed there so far (None: none yet)."""
    best = [v[i] for k, v in times.items() if not k.endswith("_program") and len(v) > i and v[i] is not None]
    return measured.GIVE_UP * min(best) if best else None


def plain_timings(weights: list[torch.Tensor], dtype: torch.dtype, kernels: tuple[str, ...] = ("gemv", "gemm", "widen"),
                  program: bool = False) -> dict[str, list]:
    """Microseconds per call at each of :data:`ROW_BUCKETS` rows of ``F.linear`` ("plain") and of
    each of tpengine's ``kernels`` that takes these weights (None at a bucket outside the
    kernel's rows), rotating over the ``weights`` (each ``[out, in]``, plain, ``dtype``); with ``program``,
    also the GEMV kernel's one-row time in a decode program (``"gemv_program"``,
    :func:`tpengine.backends.cpu.cpu_program.one_row_us`; None at the other buckets). The GEMV and GEMM
    kernels are timed first, and ``F.linear`` and the widened GEMM no further than their warm-up at a bucket
    where that took over :data:`~tpengine.backends.cpu.measured.GIVE_UP` times the fastest there (their
    warm-up is their time: they cannot be the bucket's path)."""
    inp = weights[0].shape[1]
    xs = [torch.full((rows, inp), 0.5, dtype=dtype) for rows in ROW_BUCKETS]
    paths = {"gemv": (cpu_gemv, cpu_gemv.gemv, lambda rows: rows <= cpu_gemv.MAX_ROWS),
             "gemm": (cpu_gemm, cpu_gemm.gemm, lambda rows: rows >= cpu_gemm.MIN_ROWS),
             "plain": (None, F.linear, lambda rows: True),
             "widen": (cpu_widen, cpu_widen.linear, lambda rows: rows > 1)}
    times: dict[str, list] = {}
    for name in paths:
        mod, fn, takes = paths[name]
        if name == "plain" or (name in kernels and mod.available(weights[0])):
            times[name] = []
            for i, x in enumerate(xs):
                times[name].append(time_us([lambda w=w: fn(x, w) for w in weights], give_up_us=_give_up(times, i))
                                   if takes(x.shape[0]) else None)
    times = {k: times[k] for k in ("plain", *kernels) if k in times}  # plain first, as it always was
    if program and "gemv" in times and cpu_program.runs():
        times["gemv_program"] = [cpu_program.one_row_us([cpu_gemv.bind(w).c_spec for w in weights], dtype),
                                 *[None] * (len(ROW_BUCKETS) - 1)]
    return times


def blocked_timing(weights: list[torch.Tensor], group: int, program: bool = False,
                   rivals: dict[str, list] | None = None) -> dict[str, list]:
    """``{"blocked": us}``: the blocked layout's microseconds per call at each of :data:`ROW_BUCKETS` (on the
    path a bound layer runs at those rows, :func:`_blocked_rows`: bfloat16 by AMX from the rows
    :func:`tpengine.backends.cpu.cpu_blocked.choose_amx` set, chosen first by :func:`choose_layouts`), on the plain
    ``weights`` packed
    (:func:`tpengine.backends.cpu.cpu_blocked.pack`; each plain one dropped from the list as its blocked copy is
    made, so the two layouts of all of them never coexist: the list is left empty). With ``group`` (a
    mixture-of-experts expert shape, the experts one token runs) its one-row time is that of the grouped call a
    decode step makes (:func:`tpengine.backends.cpu.cpu_moe.group_gemv` over ``group`` weights at a time), per
    expert (bfloat16; float32 experts have no grouped call and keep the one-call time). With ``program`` (and no
    ``group``), also ``"blocked_program"``: its one-row time in a decode program (:func:`plain_timings`). The
    rows multiplied are of the weights' dtype (bfloat16 or float32). ``rivals``: the other paths' timings taken
    before (:func:`plain_timings`'): at a bucket where its warm-up took over
    :data:`~tpengine.backends.cpu.measured.GIVE_UP` times their fastest, the warm-up is its time."""
    inp, dtype = weights[0].shape[1], weights[0].dtype
    blocked = []
    while weights:
        blocked.append(cpu_blocked.pack(weights.pop(0)))
    runs = [_blocked_rows(b) for b in blocked]  # what a bound layer runs at each row count
    rivals = rivals or {}
    times = [time_us([lambda r=r, x=torch.full((rows, inp), 0.5, dtype=dtype): r(x) for r in runs],
                     give_up_us=_give_up(rivals, i)) for i, rows in enumerate(ROW_BUCKETS)]
    if group > 1 and dtype == torch.bfloat16:  # float32 experts have no grouped call: one call each
        x = torch.full((1, inp), 0.5, dtype=dtype)
        sets = [[blocked[(i + j) % len(blocked)] for j in range(group)] for i in range(0, len(blocked), group)]
        times[0] = time_us([lambda s=s: cpu_moe.group_gemv(x, s) for s in sets]) / group
    out = {"blocked": times}
    if program and group <= 1 and cpu_program.runs():
        out["blocked_program"] = [cpu_program.one_row_us([cpu_blocked.bind(b).c_spec for b in blocked], dtype),
                                  *[None] * (len(ROW_BUCKETS) - 1)]
    return out


def measure(shape: tuple[int, int], count: int, dtype: torch.dtype, group: int = 0) -> dict[str, list[float]] | None:
    """Microseconds per call of each layout for a weight ``shape = (out, in)`` in ``dtype`` at each
    of :data:`ROW_BUCKETS` rows, rotating over ``min(count, MEASURE_BYTES // bytes)`` distinct
    synthetic weights (the plain layout's paths; oneDNN's packed one where it packs ``dtype`` here;
    the blocked layout where its kernels take the weight (:func:`blocked_timing`, ``group``: an expert
    shape's experts per token); but for an expert shape, the one-row times of the C paths in a decode
    program too). None where one weight exceeds :data:`MEASURE_BYTES`."""
    out, inp = shape
    nbytes = out * inp * torch.empty(0, dtype=dtype).element_size()
    if nbytes > MEASURE_BYTES:
        return None
    n = max(1, min(count, MEASURE_BYTES // nbytes))
    plain = [torch.full((out, inp), 0.01 * (i + 1), dtype=dtype) for i in range(n)]
    times = plain_timings(plain, dtype, program=not group)
    if cpu_blocked.available(plain[0]):
        times.update(blocked_timing(plain, group, program=not group, rivals=times))
        plain = [torch.full((out, inp), 0.01 * (i + 1), dtype=dtype) for i in range(n)]
    if prepack(plain[0]) is None:
        return times
    times["packed"] = []
    packed = []
    for i in range(n):  # replace as we go: never both layouts of all the synthetic weights
        packed.append(prepack(plain[i]))
        plain[i] = None
    for i, rows in enumerate(ROW_BUCKETS):
        x = torch.full((rows, inp), 0.5, dtype=dtype)
        times["packed"].append(time_us([lambda p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                         for p in packed], give_up_us=_give_up(times, i)))
    return times


def _decision(times_us: dict[str, list]) -> tuple:
    """What a layout or head choice takes from its timings, as the layers' loop and as a decode program meet
    them (:func:`in_program`): the layout (:func:`pick`) and, where that is plain, its path per bucket
    (:func:`plain_kernels`; with another layout the plain paths are not run, so a near-tie among them, e.g.
    ``F.linear`` against the GEMV kernel at one row of a bfloat16 head the blocked layout wins, does not make
    two passes disagree and the choice go uncached)."""
    def of(times: dict[str, list]) -> tuple:
        layout = pick(times)
        return layout, plain_kernels(times) if layout == "plain" else ()
    return of(times_us) + of(in_program(times_us))


def _timed(key: str, needs: tuple[str, ...], measure_fn) -> tuple[dict | None, str]:
    """:func:`tpengine.backends.cpu.measured.timed` of ``measure_fn`` under ``key``, cached timings
    serving where they hold every path in ``needs`` at every bucket; two passes agree where they
    give the same :func:`_decision`."""
    return measured.timed(key, measure_fn, lambda t: all(len(t.get(k) or ()) == len(ROW_BUCKETS) for k in needs),
                          _decision)


#: A tied head's ``((kernels, blocks), (times, how))`` measured before the layers' shapes (:func:`measure_head_first`),
#: by its :func:`choose_head` cache key, for this process's :func:`choose_head` of the loaded weight (a quiet
#: machine's timings are cached too; a noisy or busy one's serve this load only, as :func:`choose_head`'s own)
_heads_first: dict[str, tuple] = {}


def _head_paths(weight: torch.Tensor, cpu_kernels: bool) -> tuple[tuple[str, ...], bool, str]:
    """A tied head weight's plain kernels that take it, whether the blocked layout does, and its cache key."""
    blocks = cpu_kernels and cpu_blocked.available(weight)
    kernels = tuple(k for k, mod in (("gemv", cpu_gemv), ("gemm", cpu_gemm), ("widen", cpu_widen))
                    if mod.available(weight))
    key = f"linear head {str(weight.dtype).removeprefix('torch.')} {weight.shape[0]}x{weight.shape[1]}" + _amx_key(
        weight.dtype, blocks)
    return kernels, blocks, key


def _head_timed(weight: torch.Tensor, kernels: tuple[str, ...], blocks: bool, key: str) -> tuple[dict | None, str]:
    """:func:`_timed` of the head's paths on ``weight`` (the blocked one on a copy made and dropped)."""
    def measure_head() -> dict[str, list]:
        times = plain_timings([weight], weight.dtype, kernels)
        if blocks:
            times.update(blocked_timing([weight], 0, rivals=times))  # packs a copy; `weight` itself stays
        return times
    return _timed(key, ("plain", *kernels) + (("blocked",) if blocks else ()), measure_head)


def measure_head_first(shape: tuple[int, int], dtype: torch.dtype, cpu_kernels: bool = True) -> None:
    """Before the layers' shapes (:func:`choose_layouts`' ``head``): time a tied LM head of ``shape``
    ``(vocab_local, hidden)`` in ``dtype`` on a synthetic weight, so a fresh timing cache's measuring budget
    goes to the largest weight first (:func:`tpengine.backends.cpu.measured.measure_budget_s`: the layers
    after it take their defaults once it is spent, a later start measures them). Its timings serve
    :func:`choose_head` of the loaded weight in this process (and are cached on a quiet machine). Nothing
    where the weight exceeds :data:`MEASURE_BYTES` or no kernel takes it."""
    if shape[0] * shape[1] * dtype.itemsize > MEASURE_BYTES:
        return
    weight = torch.full(shape, 0.01, dtype=dtype)
    kernels, blocks, key = _head_paths(weight, cpu_kernels)
    if cpu_kernels and kernels:
        _heads_first[key] = ((kernels, blocks), _head_timed(weight, kernels, blocks, key))


def choose_head(weight: torch.Tensor, setting: str = "auto", cpu_kernels: bool = True) -> LayoutChoice:
    """The layout and kernels of a tied LM head's loaded CPU ``weight [vocab_local, hidden]``, whose rows are
    the embedding's too, so it is held in ONE layout: plain (``F.linear`` or, per bucket
    (:func:`plain_kernels`), the GEMV kernel, and the GEMM kernel for a float32 weight or the widened float32
    GEMM for a half-precision one), or blocked (:mod:`tpengine.backends.cpu.cpu_blocked`, bfloat16 and
    float32 on AVX-512 (bfloat16: with AVX512-BF16) and AVX2 builds; the embedding then reads its rows from it,
    :func:`tpengine.backends.cpu.cpu_blocked.rows`),
    timed on this weight itself at :data:`ROW_BUCKETS` (the blocked one on a copy made and dropped for the
    measurement; cached like :func:`choose_layouts`) and chosen by :func:`pick`. ``setting`` "blocked"
    forces the blocked layout where it takes the weight; other settings than "auto", ``cpu_kernels`` False,
    or a weight no kernel takes: plain ``F.linear`` with no timings."""
    kernels, blocks, key = _head_paths(weight, cpu_kernels)
    if setting == "blocked" and blocks:
        return LayoutChoice("blocked", "forced", {})
    if setting != "auto" or not cpu_kernels or not kernels:
        return LayoutChoice("plain", "default", {})
    first = _heads_first.pop(key, None)  # measured before the layers (measure_head_first), on the same paths
    times, how = first[1] if first is not None and first[0] == (kernels, blocks) else _head_timed(
        weight, kernels, blocks, key)
    if times is None:  # a busy machine: F.linear, the path every weight has
        return LayoutChoice("plain", how, {})
    layout = "plain" if measured.short_job() else pick(times)  # a short job: no reorder (choose_layouts)
    return LayoutChoice(layout, how, times, plain_kernels(times) if layout == "plain" else ())


def choose_layouts(shapes: dict[tuple[int, int], int], dtype: torch.dtype, setting: str = "auto",
                   cpu_kernels: bool = True, groups: dict[tuple[int, int], int] | None = None,
                   program: set[tuple[int, int]] | frozenset = frozenset(),
                   head: tuple[int, int] | None = None) -> dict[tuple[int, int], LayoutChoice]:
    """The layout of each weight shape ``(out, in)`` (``shapes`` maps it to how many layers of this
    rank have it) for CPU weights in ``dtype``: ``setting`` "plain" or "packed" forces it; "auto"
    measures (:func:`measure`) or reads the cached timings (:func:`_timed`). ``cpu_kernels`` False
    (``EngineConfig.cpu_kernels`` off) leaves the GEMV, GEMM and grouped kernels out of the choice.
    ``groups``: the mixture-of-experts expert shapes, each with how many experts one token runs on
    this rank (their blocked layout's one-row time is the grouped call's, :func:`blocked_timing`).

    A bfloat16 model with the blocked layout (``setting`` "auto" or "blocked") first has the blocked GEMM's AMX
    start measured on its shapes (:func:`tpengine.backends.cpu.cpu_blocked.choose_amx`, where the CPU has AMX-BF16;
    logged by :func:`summary`), so the blocked layout is timed, and runs, on it; the timings' cache key names it.

    ``program``: the shapes of the products a decode program would make, where the model's form takes one
    (:func:`tpengine.backends.cpu.cpu_program.product_shapes`): it runs a one-token step as one C call where
    every one of them makes a C call at one row (:func:`c_at_one_row`). Their choice is then made for the
    whole model: first with their one-row times as the program meets them (:func:`in_program`); if every
    one of them then takes a C path at one row, those choices stand (the program runs); else (a shape still
    faster on a path with no C call, so no program) each is chosen again with the loop's times. The other
    shapes (an untied LM head) are chosen by their loop times either way.

    ``head``: a tied LM head's shape ``(vocab_local, hidden)`` whose rows stay in ``dtype``, measured here
    (:func:`measure_head_first`, for :func:`choose_head` once loaded). The shapes and the head are measured
    in order of their bytes (a shape's: all its layers'), largest first, so a fresh cache's measuring budget
    goes to the weights a step reads most; those after it ran out take their defaults.

    Raises:
        ValueError: ``setting`` not in :data:`CPU_LINEAR_CHOICES`.
    """
    if setting not in CPU_LINEAR_CHOICES:
        raise ValueError(f"invalid cpu_linear={setting!r}: must be one of {', '.join(CPU_LINEAR_CHOICES)}")
    blocks = cpu_kernels and cpu_blocked.available(torch.zeros(16, 2, dtype=dtype))
    groups = groups or {}
    if blocks and dtype == torch.bfloat16 and setting in ("auto", "blocked"):
        # the blocked GEMM's AMX path from the rows measured faster, before the blocked layout is timed
        cpu_blocked.choose_amx([s for s in shapes if s not in groups])
    if setting != "auto":
        return {s: LayoutChoice(setting, "forced", {}) for s in shapes}
    packable = prepack(torch.zeros(1, 1, dtype=dtype)) is not None
    timings = {}
    # the largest weights' bytes first (a shape's layers together, the tied head alone): where a fresh cache's
    # measuring budget runs out, the smaller ones take the defaults
    for shape, count in sorted(shapes.items(), key=lambda sc: (-sc[1] * sc[0][0] * sc[0][1], sc[0])):
        if head is not None and head[0] * head[1] >= count * shape[0] * shape[1]:
            measure_head_first(head, dtype, cpu_kernels)
            head = None
        group = groups.get(shape, 0)
        key = f"linear {str(dtype).removeprefix('torch.')} {shape[0]}x{shape[1]}x{min(count, 1 << 20)}" + (
            f" group {group}" if group else "") + _amx_key(dtype, blocks)
        needs = ("plain",) + (("packed",) if packable else ()) + (("blocked",) if blocks else ())
        timings[shape] = _timed(key, needs, lambda: measure(shape, count, dtype, group))
    if head is not None:
        measure_head_first(head, dtype, cpu_kernels)
    program = set(program) & set(shapes) - set(groups) if cpu_kernels else set()
    if program:
        chosen = _choices(timings, packable, cpu_kernels, program)
        if all(c_at_one_row(chosen[s].layout, chosen[s].kernels) for s in program):
            return chosen
    return _choices(timings, packable, cpu_kernels, set())


def _choices(timings: dict, packable: bool, cpu_kernels: bool, program: set) -> dict[tuple[int, int], LayoutChoice]:
    """Each shape's :class:`LayoutChoice` from its ``(times, how)`` (:func:`_timed`), the times of the
    ``program`` shapes as a decode program meets them (:func:`in_program`)."""
    chosen = {}
    for shape, (times, how) in timings.items():
        times = in_program(times) if times is not None and shape in program else times
        if measured.short_job():  # a few forwards never repay a reorder: plain, its cached kernels if any
            chosen[shape] = LayoutChoice("plain", how, times or {}, plain_kernels(times) if times else ())
        elif times is None:  # too big to measure, or a busy machine: packed where oneDNN packs this dtype
            chosen[shape] = LayoutChoice("packed" if packable else "plain", how, {})
        else:
            if not cpu_kernels:
                times = {k: v for k, v in times.items()
                         if k not in ("gemv", "gemm", "blocked") and not k.endswith("_program")}
            layout = pick(times)
            chosen[shape] = LayoutChoice(layout, how, times, plain_kernels(times) if layout == "plain" else ())
    return chosen


def _amx_key(dtype: torch.dtype, blocks: bool) -> str:
    """The part of a bfloat16 timing's cache key that says which path the blocked layout was timed on at its
    rows (:func:`tpengine.backends.cpu.cpu_blocked.amx_rows`): ``" amx 8"`` from 8 rows on, "" for none."""
    rows = cpu_blocked.amx_rows() if blocks and dtype == torch.bfloat16 else 0
    return f" amx {rows}" if rows else ""


def summary(chosen: dict[tuple[int, int], LayoutChoice], dtype: torch.dtype) -> str:
    """The one line rank 0 logs: every shape's layout and the timings it was chosen on; for bfloat16, the
    blocked GEMM's AMX choice where it was made (:func:`tpengine.backends.cpu.cpu_blocked.choose_amx`)."""
    hows = sorted({c.how for c in chosen.values()})
    amx = cpu_blocked.amx_choice() if dtype == torch.bfloat16 else None
    return (f"tpengine: CPU linear layouts ({str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
            f"{'/'.join(hows)}): " + "; ".join(c.describe(s) for s, c in sorted(chosen.items()))
            + (f"; blocked bfloat16 GEMM {amx.describe()}" if amx is not None else ""))


def prepack(weight: torch.Tensor, layout: str = "packed") -> torch.Tensor | None:
    """``weight [out, in]`` reordered for oneDNN's CPU matmul (``layout`` "packed") or in tpengine's blocked
    layout ("blocked", :func:`tpengine.backends.cpu.cpu_blocked.pack`), or None where that is not available
    (not a CPU float32/bfloat16 tensor, no oneDNN, no bfloat16 support in this CPU, no blocked kernels)."""
    if layout == "blocked":
        return cpu_blocked.pack(weight) if cpu_blocked.available(weight) else None
    mkldnn = torch.ops.mkldnn
    if (weight.device.type != "cpu" or not torch.backends.mkldnn.is_available()
            or not hasattr(mkldnn, "_reorder_linear_weight") or not hasattr(mkldnn, "_linear_pointwise")):
        return None
    if weight.dtype == torch.bfloat16 and not mkldnn._is_mkldnn_bf16_supported():
        return None
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    return mkldnn._reorder_linear_weight(weight.detach())


def bind_linear(weight: torch.Tensor | None, bias: torch.Tensor | None, packed: torch.Tensor | None = None,
                quant=None, kernels: tuple[str, ...] = ()) -> Callable[[torch.Tensor], torch.Tensor]:
    """The one implementation a linear layer runs, bound once its weight is loaded:
    ``run(x [rows, in] contiguous, the weight's dtype) -> x @ weight.T + bias [rows, out]``.

    In order: a quantized weight (``quant``, :class:`~tpengine.model.quant.weights.QuantizedWeight`) runs
    its kernel (``quant.bind()``); a ``packed`` weight runs its layout's kernel (the blocked layout's,
    :func:`tpengine.backends.cpu.cpu_blocked.bind`, or oneDNN's matmul, :func:`prepack`); a
    plain weight whose ``kernels`` were measured (:func:`plain_kernels`) runs, per row count, the path
    measured fastest at that row bucket (:func:`kernel_at`: tpengine's GEMV kernel,
    :mod:`tpengine.backends.cpu.cpu_gemv`, its GEMM, :mod:`tpengine.backends.cpu.cpu_gemm`, the widened
    GEMM, :mod:`tpengine.backends.cpu.cpu_widen`, or ``F.linear``; with a bias ``F.linear`` in place of
    the GEMV and GEMM kernels, the bias added after the widened GEMM); anything else runs ``F.linear``.
    Every path computes the same product; the choice is speed only.
    """
    if quant is not None:
        q = quant.bind()
        return q if bias is None else (lambda x: q(x) + bias)
    if cpu_blocked.is_blocked(packed):
        b = _blocked_rows(packed)
        return b if bias is None else (lambda x: b(x) + bias)
    if packed is not None:
        op = torch.ops.mkldnn._linear_pointwise
        return lambda x: op(x, packed, bias, "none", [], "")
    if bias is not None:  # the GEMV and GEMM kernels take no bias
        kernels = tuple("plain" if k in ("gemv", "gemm") else k for k in kernels)
    if any(k != "plain" for k in kernels):
        binds = {"gemv": cpu_gemv.bind, "gemm": cpu_gemm.bind, "widen": cpu_widen.bind}
        paths = {"plain": lambda x: F.linear(x, weight, bias)}
        for k in set(kernels) - {"plain"}:
            paths[k] = binds[k](weight) if bias is None else (lambda x, f=binds[k](weight): f(x) + bias)
        by_rows = [paths["plain"]] + [paths[kernel_at(kernels, rows)] for rows in range(1, ROW_BUCKETS[-1] + 1)]
        last, past = len(by_rows), paths[kernel_at(kernels, ROW_BUCKETS[-1] + 1)]

        def run(x: torch.Tensor) -> torch.Tensor:
            rows = x.shape[0]
            return (by_rows[rows] if rows < last else past)(x)
        run.c_spec = getattr(by_rows[1], "c_spec", None)  # the one-row path's call in a decode program
        return run
    return lambda x: F.linear(x, weight, bias)


def _blocked_rows(blocked: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A blocked weight's ``run(x [rows, k] contiguous) -> [rows, n]``: :func:`tpengine.backends.cpu.cpu_blocked.bind`'s
    kernel (bfloat16: any rows, by AMX tiles from :func:`tpengine.backends.cpu.cpu_blocked.amx_rows` rows on where
    the CPU has AMX-BF16: a decode batch, a prefill), and for a float32 weight from
    :data:`tpengine.backends.cpu.cpu_gemm.MIN_ROWS` rows on (a decode batch,
    a prefill) :func:`tpengine.backends.cpu.cpu_gemm.bind_blocked`'s, where the library has it: the same
    products (equal outputs, bit for bit), its tiles run in chunks of rows whose ``x`` stays in the L2, where the
    former streams every row of ``x`` once per 32 outputs (docs/notes/kernels.md, "The float32 GEMM on the
    blocked layout at many rows"). ``run.c_spec``: the one-row call a decode program makes (the former's)."""
    small = cpu_blocked.bind(blocked)
    if not cpu_gemm.blocked_available(blocked):
        return small
    big, least = cpu_gemm.bind_blocked(blocked), cpu_gemm.MIN_ROWS

    def run(x: torch.Tensor) -> torch.Tensor:
        return (big if x.shape[0] >= least else small)(x)
    run.c_spec = small.c_spec
    return run


def bind_layer(layer, head: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """The CPU implementation of a linear ``layer`` (a :class:`~tpengine.model.layers.linear._Packable`)
    from its fields now: :func:`bind_linear` of its ``weight``, ``impl_bias``, ``packed``, ``quant`` and
    ``kernels``. A plain half-precision LM head (``head``) whose one-row path is
    ``F.linear`` reads one row with ``torch.mv`` instead, which streams a plain row-major weight faster.
    The caller binds it (``layer.bind(bind_layer(layer))``)."""
    impl = bind_linear(layer.weight, layer.impl_bias, layer.packed, layer.quant, layer.kernels)
    w = layer.weight
    if (head and layer.quant is None and layer.packed is None and w is not None
            and w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float16)
            and kernel_at(layer.kernels, 1) == "plain"):
        return lambda x: torch.mv(w, x[0]).unsqueeze(0) if x.shape[0] == 1 else impl(x)
    return impl
