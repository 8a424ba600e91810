"""The measured choice among the quantized weights' paths (:mod:`tpengine.backends.cpu.cpu_qgemv`'s C
kernels, torch's weight-only kernels, a dequantized copy and one float GEMM) per weight shape and row
count, as :mod:`tpengine.backends.cpu.linear_layout` is the float weights' layout choice.

Whether the C kernels are faster is measured per weight shape on the machine that runs
(:func:`choose`), at :data:`ROW_BUCKETS` rows, on the model's own quantized weights, once per
machine (cached like the linear layouts); a weight uses them up to the largest bucket where they
were faster at every bucket up to it (``QuantizedWeight.gemv_rows``), and for more rows torch's
kernel, or from ``dequant_rows`` rows on (prefill) a dequantized scratch copy of one layer's
weight and one float GEMM, where that measured faster (in float32 where this machine's
half-precision GEMM measured slower than the widened one: the profile's half GEMM dtype,
:func:`tpengine.backends.cpu.cpu_widen.gemm_choice`). The int8-activation kernels are taken up to
``q8_rows`` rows where they measured faster than the float kernel; the products a decode program makes
are decided on their one-row times inside a program where every one then has a C call at one row
(:func:`in_program`, ``choose(program=...)``).
"""

from __future__ import annotations

import torch

from tpengine.backends.cpu import cpu_qgemv, measured
from tpengine.backends.cpu.measured import time_us

#: Rows per call the choice is measured at.
ROW_BUCKETS = (1, 4, 8)
#: Rows per call the prefill choice (torch's kernel or dequantize + GEMM) is measured at, on at most
#: :data:`PREFILL_WEIGHTS` weights of a shape (a prefill GEMM is bound by arithmetic, not by memory).
PREFILL_BUCKETS = (64, 512)
PREFILL_WEIGHTS = 4
#: torch's kernel is timed no further at a bucket where its warm-up calls all took this many times the time
#: of the path it is weighed against (:data:`tpengine.backends.cpu.measured.GIVE_UP`): one call ranks it,
#: where its full timing cost minutes a load (torch's int4 GEMM, 512 rows of SmolLM2's LM head: about a
#: minute a call on 2 busy cores).
GIVE_UP = measured.GIVE_UP


def gemv_rows(torch_us: list[float], kernel_us: list[float]) -> int:
    """The largest of :data:`ROW_BUCKETS` up to which ``kernel_us`` (these kernels) beat
    ``torch_us`` at every bucket (0: never)."""
    rows = 0
    for n, t, c in zip(ROW_BUCKETS, torch_us, kernel_us):
        if c >= t:
            break
        rows = n
    return rows


def _kernel_us(times: dict[str, list[float]]) -> list[float]:
    """The faster of these kernels at each bucket: the float one's times, or the int8-activation one's
    where measured and faster."""
    return [min(t, q) for t, q in zip(times["tpengine"], times.get("tpengine_q8", times["tpengine"]))]


def q8_rows(times: dict[str, list[float]]) -> int:
    """The largest of :data:`ROW_BUCKETS`, up to :func:`gemv_rows`'s, up to which the int8-activation
    kernel (``times["tpengine_q8"]``: int4 x int8 or int8 x int8) beat the float one at every bucket (0:
    never, or not measured)."""
    if "tpengine_q8" not in times:
        return 0
    limit = gemv_rows(times["torch"], _kernel_us(times))
    return min(limit, gemv_rows(times["tpengine"], times["tpengine_q8"]))


def _measure(mods: list, dequant_dtype: torch.dtype | None = None, program: bool = False) -> dict[str, list[float]]:
    """Microseconds per call of torch's kernel and these at :data:`ROW_BUCKETS` rows (rotating over
    ``mods``; each path's bound call, :meth:`~tpengine.model.quant.weights.QuantizedWeight.bind`), and
    where the kind has a dequantize-then-GEMM path (int4, int8 per channel) of
    torch's kernel and that path at :data:`PREFILL_BUCKETS` rows (on at most :data:`PREFILL_WEIGHTS`).
    At each bucket the path torch's kernel is weighed against is timed first, and torch's is timed no
    further than its warm-up calls where each took over :data:`GIVE_UP` times as long (their time
    is its timing: only the faster path at each bucket decides :func:`gemv_rows` and :func:`dequant_rows`);
    at the prefill buckets past one where torch's kernel lost so, it is not run at all (its time there:
    the one it lost with, times the ratio of the rows). ``dequant_dtype``: the dequantized weight's
    dtype (the profile's half GEMM dtype; None: the activations'). ``program``: the weights are products a
    decode program makes (:mod:`tpengine.backends.cpu.cpu_program`): each C kernel's one-row call is also
    timed as the program makes it (:func:`~tpengine.backends.cpu.cpu_program.one_row_us`, no Python),
    ``"tpengine_program"`` and ``"tpengine_q8_program"`` (one time each, at one row; :func:`in_program`)."""
    q8 = cpu_qgemv.q8_takes(mods[0])
    times: dict[str, list[float]] = {"torch": [], "tpengine": [], **({"tpengine_q8": []} if q8 else {})}
    for m in mods:
        m.gemv_rows, m.dequant_rows, m.q8_rows = 0, 0, 0
        m.dequant_dtype = dequant_dtype
    most = cpu_qgemv.MAX_ROWS
    paths = (("tpengine", most, 0),) + ((("tpengine_q8", most, most),) if q8 else ()) + (("torch", 0, 0),)
    # each path timed through the weight's bound call (QuantizedWeight.bind, what a layer runs), not the
    # forward's per-call checks, which only the C kernels' path pays (a few us, as much as a small product)
    bound = {}
    for path, use, use_q8 in paths:
        for m in mods:
            m.gemv_rows, m.q8_rows = use, use_q8
        bound[path] = [m.bind() for m in mods]
    for rows in ROW_BUCKETS:
        x = torch.full((rows, mods[0].in_features), 0.01, dtype=mods[0].dtype)
        for path, _, _ in paths:  # torch's given up past GIVE_UP x ours
            give_up = GIVE_UP * min(v[-1] for k, v in times.items() if k != "torch") if path == "torch" else None
            times[path].append(time_us([lambda f=f: f(x) for f in bound[path]], give_up_us=give_up))
    if program:  # (the C paths' bound calls carry their c_spec: QuantizedWeight.bind's _one_row)
        from tpengine.backends.cpu import cpu_program

        for path, _, _ in paths[:-1]:
            times[f"{path}_program"] = [cpu_program.one_row_us([f.c_spec for f in bound[path]], mods[0].dtype)]
    for m in mods:
        m.q8_rows = 0
    if _has_prefill_path(mods[0]):
        times["prefill_torch"], times["prefill_dequant"] = [], []
        few = mods[:PREFILL_WEIGHTS]
        for m in few:
            m.gemv_rows = 0
        lost_at = None  # the bucket where torch's kernel lost by over GIVE_UP
        for n in PREFILL_BUCKETS:
            x = torch.full((n, mods[0].in_features), 0.01, dtype=mods[0].dtype)
            for path, use in (("prefill_dequant", 1), ("prefill_torch", 0)):
                if path == "prefill_torch" and lost_at is not None:
                    # a GEMM's time grows at least with its rows: torch's kernel, which lost by over GIVE_UP
                    # at fewer rows, is not run here (a call could take minutes: its AVX2 build's bfloat16
                    # int4 GEMM), its time taken as the rows' share of that one
                    times[path].append(times[path][-1] * n / lost_at)
                    continue

                def run(m, use=use):
                    m.dequant_rows = use
                    return m(x)
                give_up = GIVE_UP * times["prefill_dequant"][-1] if path == "prefill_torch" else None
                times[path].append(time_us([lambda m=m: run(m) for m in few], passes=2, give_up_us=give_up))
            if lost_at is None and times["prefill_torch"][-1] > GIVE_UP * times["prefill_dequant"][-1]:
                lost_at = n
    return {k: times[k] for k in ("torch", "tpengine", "tpengine_q8", "prefill_torch", "prefill_dequant",
                                  "tpengine_program", "tpengine_q8_program") if k in times}


def dequant_rows(times: dict[str, list[float]]) -> int:
    """The smallest of :data:`PREFILL_BUCKETS` from which dequantize + GEMM was faster than torch's
    kernel at every larger bucket (0: never, or not measured)."""
    rows = 0
    for n, t, d in reversed(list(zip(PREFILL_BUCKETS, times.get("prefill_torch", ()),
                                     times.get("prefill_dequant", ())))):
        if d >= t:
            break
        rows = n
    return rows


def in_program(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """The timings as a model that runs a decode program meets them: the C kernels' one-row times taken in a
    program (``"tpengine_program"``, ``"tpengine_q8_program"``: their C call alone, no Python; :func:`_measure`)
    in place of their bound calls' from Python; every other time as it is (torch's kernel has no C call: with
    it at one row the step runs the layers' loop). Timings without program times are returned as they are."""
    out = {k: list(v) for k, v in times.items() if not k.endswith("_program")}
    for k in ("tpengine", "tpengine_q8"):
        t = (times.get(f"{k}_program") or [None])[0]
        if t is not None and k in out:
            out[k][0] = t
    return out


def rows_of(times: dict[str, list[float]]) -> tuple[int, int, int]:
    """``(gemv_rows, dequant_rows, q8_rows)`` of a measurement (:func:`gemv_rows`, :func:`dequant_rows`,
    :func:`q8_rows`)."""
    return gemv_rows(times["torch"], _kernel_us(times)), dequant_rows(times), q8_rows(times)


def _decision(times: dict[str, list[float]]) -> tuple:
    """What :func:`choose` takes from a measurement (two passes agree where it is the same): :func:`rows_of`
    as the layers' loop and as a decode program meet the timings (:func:`in_program`)."""
    return rows_of(times), rows_of(in_program(times))


def _valid(times) -> bool:
    """Whether cached ``times`` have the shape :func:`_measure` writes (numbers at every bucket)."""
    def numbers(v, n):
        return isinstance(v, list) and len(v) == n and all(isinstance(t, (int, float)) for t in v)
    return (isinstance(times, dict) and numbers(times.get("torch"), len(ROW_BUCKETS))
            and numbers(times.get("tpengine"), len(ROW_BUCKETS))
            and ("tpengine_q8" not in times or numbers(times["tpengine_q8"], len(ROW_BUCKETS)))
            and all(numbers(times[k], 1) for k in ("tpengine_program", "tpengine_q8_program") if k in times)
            and all(numbers(times[k], len(PREFILL_BUCKETS)) for k in ("prefill_torch", "prefill_dequant")
                    if k in times))


def _one_row_c_call(mod) -> bool:
    """Whether ``mod``'s one-row path on these kernels is one C call a decode program can make (its bound
    call's ``c_spec``: int4, int8 per channel; a grouped int8 weight runs two int4 products in Python)."""
    return getattr(mod, "group_size", None) is None or type(mod).__name__.startswith("Int4")


def _has_prefill_path(mod) -> bool:
    """Whether ``mod``'s kind has the dequantize-then-GEMM path (int4, int8 per channel)."""
    return getattr(mod, "group_size", None) is None or type(mod).__name__.startswith("Int4")


def default_times(mod) -> dict[str, list[float]]:
    """The choice a busy machine takes without cached timings (nothing measured): these kernels at
    every decode bucket (torch's are written for many rows) and, where the kind has it, dequantize +
    GEMM from the first prefill bucket (torch's int4 GEMM can take minutes a call there), as timings
    that rank the paths so (1 us for the path taken, 2 us for the other); where :func:`q8_takes`, the
    int8-activation kernel at every decode bucket (0.5 us: it reads the same bytes with fewer instructions)."""
    times = {"torch": [2.0] * len(ROW_BUCKETS), "tpengine": [1.0] * len(ROW_BUCKETS)}
    if cpu_qgemv.q8_takes(mod):
        times["tpengine_q8"] = [0.5] * len(ROW_BUCKETS)
    if _has_prefill_path(mod):
        times["prefill_torch"], times["prefill_dequant"] = [2.0] * len(PREFILL_BUCKETS), [1.0] * len(PREFILL_BUCKETS)
    return times


def choose(groups: dict[str, list], rank: int = 0, dequant_dtype: torch.dtype | None = None,
           program: set[str] | frozenset = frozenset()) -> dict[str, dict]:
    """For each group of quantized weights of one shape and kind (``groups``: a key such as ``"int4
    g32 576->3072"`` -> its :class:`~tpengine.model.quant.weights.QuantizedWeight` modules), the timings
    of torch's kernels and these (:func:`_measure`, on the modules themselves, rotating over all of them
    so the weights stream from memory) under :func:`tpengine.backends.cpu.measured.timed` (cached per
    machine and ``rank``; on a busy machine without them :func:`default_times`), and set each module's
    ``gemv_rows`` (:func:`gemv_rows`), ``q8_rows`` (:func:`q8_rows`), ``dequant_rows``
    (:func:`dequant_rows`) and ``dequant_dtype`` (``dequant_dtype``: the dtype the dequantized weight's
    GEMM runs in, the profile's half GEMM dtype; None: the activations'). Cached timings without the int4 x
    int8 kernel's, where it is a candidate (:func:`q8_takes`), are measured again.

    ``program``: the keys of the groups whose weights are the products of a decode program (where the model's
    form takes one: :func:`tpengine.backends.cpu.cpu_program.form_why_not`), which runs a one-token step as one
    C call only where every one of them has a C call at one row (``gemv_rows`` >= 1). Their choice is made for
    the whole model, as the float layouts' (:func:`tpengine.backends.cpu.linear_layout.choose_layouts`): first
    on their one-row times as the program meets them (:func:`in_program`; these keys' cached timings without the
    program times are measured again); if every one of them then takes a C kernel at one row, those choices
    stand; else (torch's kernel still faster for one, so no program) each is chosen on the loop's times, as
    every group is where one of them has no C call at one row at all (a grouped int8 weight). (What
    the program also saves outside the products is not counted: the rule leans to the loop in a close call.)
    Returns ``{key: {"torch": [us...], "tpengine": [us...], ["tpengine_q8": [us...],] ..., "gemv_rows": n,
    "q8_rows": n, "dequant_rows": n, "how": ..., "dequant_dtype": name}}``, ``how`` one of
    :mod:`~tpengine.backends.cpu.measured`'s descriptions."""
    program = set(program) & set(groups)
    if not all(_one_row_c_call(groups[k][0]) for k in program):
        program = set()  # a product the program cannot call (a grouped int8 weight): no program either way
    timings = {}
    for key, mods in sorted(groups.items()):
        dtype = str(mods[0].dtype).removeprefix("torch.")
        q8, prog = cpu_qgemv.q8_takes(mods[0]), key in program

        def valid(t, q8=q8, prog=prog):
            return (_valid(t) and (not q8 or "tpengine_q8" in t) and (not prog or "tpengine_program" in t)
                    and (not (q8 and prog) or "tpengine_q8_program" in t))
        def measure(mods=mods, prog=prog):
            return _measure(mods, dequant_dtype, program=True) if prog else _measure(mods, dequant_dtype)
        times, how = measured.timed(f"quant {dtype} {key} rank {rank}", measure, valid, _decision)
        timings[key] = (default_times(mods[0]) if times is None else times, how)
    decided = {k: rows_of(in_program(t) if k in program else t) for k, (t, _) in timings.items()}
    if not all(decided[k][0] >= 1 for k in program):  # no program either way: the loop's times decide
        decided = {k: rows_of(t) for k, (t, _) in timings.items()}
    chosen = {}
    for key, mods in sorted(groups.items()):
        times, how = timings[key]
        rows, deq, rows8 = decided[key]
        for m in mods:
            m.gemv_rows, m.dequant_rows, m.dequant_dtype, m.q8_rows = rows, deq, dequant_dtype, rows8
        chosen[key] = {**times, "gemv_rows": rows, "q8_rows": rows8, "dequant_rows": deq, "how": how,
                       "dequant_dtype": str(dequant_dtype or mods[0].dtype).removeprefix("torch.")}
    return chosen


def summary(chosen: dict[str, dict]) -> str:
    """``"int4 g32 576->3072 tpengine up to 8 rows (torch 120/200/300 us, tpengine 60/90/150 us at
    1/4/8 rows), dequantize (bfloat16) + GEMM from 64 rows (torch 900/7000 us, dequantized 300/1500 us at
    64/512 rows)"`` for each key, ``"; "``-separated."""
    def us(v):
        return "/".join(f"{t:.0f}" for t in v)

    def one(k, c):
        q8 = c.get("q8_rows", 0)
        s = (f"{k} {'tpengine up to ' + str(c['gemv_rows']) + ' rows' if c['gemv_rows'] else 'torch'}"
             f"{' (int8 activations up to ' + str(q8) + ')' if q8 else ''} "
             f"(torch {us(c['torch'])} us, tpengine {us(c['tpengine'])} us"
             f"{', int8 activations ' + us(c['tpengine_q8']) + ' us' if 'tpengine_q8' in c else ''}"
             f" at {'/'.join(map(str, ROW_BUCKETS))} rows"
             f"{'; in a decode program ' + us(c['tpengine_program']) if 'tpengine_program' in c else ''}"
             f"{'/' + us(c['tpengine_q8_program']) if 'tpengine_q8_program' in c else ''}"
             f"{' us at 1 row' if 'tpengine_program' in c else ''})")
        if "prefill_torch" in c:
            deq = f"dequantize ({c.get('dequant_dtype', '')}) + GEMM from {c['dequant_rows']} rows"
            s += (f", {deq if c['dequant_rows'] else 'torch'}"
                  f" (torch {us(c['prefill_torch'])} us, dequantized {us(c['prefill_dequant'])} us at "
                  f"{'/'.join(map(str, PREFILL_BUCKETS))} rows)")
        return s
    return "; ".join(one(k, c) for k, c in sorted(chosen.items()))
