"""The one way tpengine measures a choice on the machine that runs (issue 17: no constant tuned on
one CPU): every measured decision of the CPU platform goes through :func:`timed` (linear layouts,
the tied head, the quantized kernels, the greedy pick's block or C argmax, the greedy path, the half
GEMM dtype, the paged kernel's AMX path).

The rule, per choice (a cache key saying what was timed):

1. timings cached from a quiet machine are used ("cached");
2. without them, the machine is checked for other processes first (:func:`probe_busy`, a short
   ``/proc/stat`` window, :class:`Contention`); a busy machine measures nothing: the caller takes its
   safe default, described as :data:`DEFAULT_BUSY` and not cached, so a start on a loaded machine is
   not made slower still and the next quiet start measures (a busy verdict holds
   :data:`BUSY_HOLD_S`: one probe serves the load's other choices);
3. a process that has spent its measuring budget (:func:`measure_budget_s`, 1 s unless
   ``$TPENGINE_MEASURE_BUDGET_S`` says otherwise) measures nothing more: the caller takes its default
   (:data:`DEFAULT_BUDGET`, not cached) and a later start measures it, so a new shape never costs a
   short first job more than the budget and one choice; a batch job that states its work
   (``$TPENGINE_JOB_TOKENS``) gets a budget in proportion (:func:`job_budget_s`), none for a
   one-token job (:func:`short_job`);
4. on a quiet machine the candidates are timed twice, each pass under :class:`Contention`; timings
   whose passes agree (:func:`consistent`: within 1.5x at every workload, or, where the caller says
   what it decides from them, the same decision from each pass) and that no other process disturbed
   are cached ("measured"); where two quiet passes disagree, a third decides: the two of the three
   that agree are cached (a pass another process slowed, or a near-tie either side of which is as
   good); else the timings are used for this run only (:data:`NOISY`, :data:`BUSY`; no further pass
   after a busy one). A decision two quiet passes agree on is kept though its times jitter (a
   memory-bound call on a shared machine moves 2x between passes): measuring it again at every start
   would find the same decision and cost seconds each time -- and, under the budget, keep the
   choices after it from ever being measured.

The cache is one file per machine (:func:`cache_path`: the CPU model and flags, the C kernels' build,
the torch version and the thread count; one :data:`CACHE_VERSION`) in ``$TPENGINE_CACHE_DIR``. Each
choice's line in the load's log comes from its caller's ``describe`` with the ``how`` given here.
On top of :func:`timed`, :func:`fastest` times named candidates and takes the one with the smallest
summed relative time (:func:`pick`).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tpengine.backends.cpu import cpu_library
from tpengine.backends.cpu.cpu_library import cache_root, cpu_id

#: The one version of every cached timing (the file name holds it): raised when what a key's timings
#: mean changes. 8: one file for every measured choice (the linear layouts' were version 7, the
#: quantized kernels' 4, the others' 2). 9: the linear layouts' timings hold the C paths' one-row times in
#: a decode program (linear_layout.in_program).
CACHE_VERSION = 9


@dataclass(frozen=True)
class Choice:
    """``name``: the candidate chosen; ``how``: "measured", "cached", :data:`NOISY`, :data:`BUSY` or
    :data:`DEFAULT_BUSY` (then ``times_us`` is empty); ``times_us``: each candidate's microseconds per
    call at each workload."""

    name: str
    how: str
    times_us: dict[str, list[float]] = field(default_factory=dict)

    def describe(self) -> str:
        """``"512 (measured: 512 20/410 us, max 31/890 us)"``; ``"512 (default: machine busy, not
        measured)"`` without timings."""
        if not self.times_us:
            return f"{self.name} ({self.how})"
        times = ", ".join(f"{k} {'/'.join(f'{t:.0f}' for t in v)} us" for k, v in self.times_us.items())
        return f"{self.name} ({self.how}: {times})"


#: Microseconds of calls that time a candidate well enough (:func:`time_us`): past it, the warm-up stops
#: after 2 calls and the timing after 3, where full rounds of every weight would take longer (expensive
#: calls, mostly losers': ``F.linear`` at 64 rows of a bfloat16 LM head where the CPU has no bfloat16
#: arithmetic; docs/notes/benchmarks.md, "Measuring a fresh cache, cheaper", has what this saves a load).
ENOUGH_US = 50_000.0

#: A candidate is timed no further at a workload where its warm-up calls all took this many times the
#: time of the best path timed before it there (:func:`time_us`'s ``give_up_us``): it cannot be chosen
#: there, and its warm-up ranks it (the quantized kernels' torch path, the linear layouts' ``F.linear``,
#: widened GEMM, blocked and packed layouts).
GIVE_UP = 4.0


def time_us(fns: list[Callable[[], object]], passes: int = 4, give_up_us: float | None = None,
            enough_us: float = ENOUGH_US) -> float:
    """Microseconds per call over ``fns``: the calls go round ``fns`` in order (so a call's operands were
    last used ``len(fns)`` calls before), each timed alone: a warm-up round, then ``passes`` timed rounds,
    and the median timed call taken (so a call that another process preempted does not count). Where the
    calls are long, fewer serve: the warm-up stops once 2 calls (at least) took ``enough_us`` together
    (:data:`ENOUGH_US`), the timing once 3 did. ``give_up_us``: when even the fastest warm-up call took
    longer (2 calls at least, unless the first alone took ``enough_us``), the warm-up's median is returned
    and nothing is timed (a candidate far slower than its rival is ranked by its warm-up: torch's int4 GEMM
    at 512 rows of SmolLM2's LM head takes a minute a call on 2 cores)."""
    n, enough_s = len(fns), enough_us * 1e-6
    calls = 0

    def run(want: int, least: int) -> list[float]:
        nonlocal calls
        out = []
        while len(out) < want and not (len(out) >= least and sum(out) >= enough_s):
            f = fns[calls % n]
            start = time.perf_counter()
            f()
            out.append(time.perf_counter() - start)
            calls += 1
        return out

    warm = run(n, 2)
    if give_up_us is not None and len(warm) < 2 and sum(warm) < enough_s:
        warm += run(1, 1)  # a short first call may carry set-up costs: a second one rules on the give-up
    if give_up_us is not None and min(warm) * 1e6 > give_up_us:
        return statistics.median(warm) * 1e6
    return statistics.median(run(passes * n, 3)) * 1e6


def _cpus() -> list[int]:
    """The CPUs this process may run on (its affinity; every CPU where that cannot be read)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _cpu_busy_s(cpus: list[int] | None = None) -> float | None:
    """Seconds of CPU time the CPUs ``cpus`` (default :func:`_cpus`) have spent busy since boot
    (``/proc/stat``'s ``cpuN`` lines: user, nice, system, irq, softirq and steal, the hypervisor's
    share), None where there is no ``/proc/stat``."""
    want = set(_cpus() if cpus is None else cpus)
    try:
        with open("/proc/stat") as f:
            lines = [ln.split() for ln in f if ln.startswith("cpu") and ln[3:4].isdigit()]
    except OSError:
        return None
    ticks = 0
    for fields in lines:
        if int(fields[0][3:]) in want and len(fields) >= 9:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK") if lines else None


class Contention:
    """Whether other processes kept this process's CPUs busy while a measurement ran: a context
    manager that, on exit, sets ``busy`` when the CPU time the rest of the machine spent on the
    CPUs this process may use (their busy time from ``/proc/stat`` minus this process's own,
    ``time.process_time``) exceeds what the ones its ``threads`` leave free could give, plus
    ``slack`` cores, plus the uncertainty of ``/proc/stat``'s clock ticks (two ticks per CPU over
    the window). ``others_cores``: that time over the window, in cores. Such timings are not this
    machine's: a choice measured then is used for that run only. Windows shorter than ``min_s``
    seconds, and machines without ``/proc/stat``, are never judged busy (the two-pass
    :func:`consistent` check stays)."""

    def __init__(self, threads: int | None = None, slack: float = 0.5, min_s: float = 0.1) -> None:
        self.threads = torch.get_num_threads() if threads is None else threads
        self.slack, self.min_s = slack, min_s
        self.busy = False
        self.others_cores = 0.0

    def __enter__(self) -> Contention:
        self._cpus = _cpus()
        self._start = (time.perf_counter(), time.process_time(), _cpu_busy_s(self._cpus))
        return self

    def __exit__(self, *exc: object) -> None:
        wall0, own0, busy0 = self._start
        busy = _cpu_busy_s(self._cpus)
        wall, own = time.perf_counter() - wall0, time.process_time() - own0
        if busy0 is None or busy is None or wall < self.min_s:
            return
        n = len(self._cpus)
        self.others_cores = max(0.0, (busy - busy0) - own) / wall
        ticks = 2 * n / os.sysconf("SC_CLK_TCK") / wall
        self.busy = self.others_cores > max(0, n - self.threads) + self.slack + ticks


def consistent(a: dict[str, list], b: dict[str, list], ratio: float = 1.5) -> bool:
    """Whether two measurements (name -> times per workload, None for one not timed) agree within
    ``ratio`` at every workload (a time-slice lost to another process makes one call several
    times slower)."""
    return all(x is None or y is None or max(x, y) <= ratio * min(x, y)
               for k in a for x, y in zip(a[k], b.get(k, a[k])))


#: How a choice timed while the machine was busy (:class:`Contention`) is described.
BUSY = "measured, machine busy (not cached)"

#: How a choice is described whose three quiet measurements disagreed (no two :func:`consistent`, or of the
#: same decision), or whose third, after two that disagreed, another process disturbed.
NOISY = "measured, noisy (not cached)"

#: How a choice is described that took its default because the machine was busy before any timings
#: were cached (:func:`probe_busy`): nothing measured, nothing cached.
DEFAULT_BUSY = "default: machine busy, not measured"

#: How a choice is described that took its default because this process had spent its measuring
#: budget (:func:`measure_budget_s`): nothing measured, nothing cached; a later start measures it.
DEFAULT_BUDGET = "default: measuring budget spent, not measured"

#: How a choice is described that took its default because this process's job is too short to earn a
#: measurement back (:func:`short_job`): nothing measured, nothing cached; a longer job measures it.
DEFAULT_SHORT = "default: short job, not measured"

#: Seconds of measuring one process spends on choices without cached timings, unless
#: ``$TPENGINE_MEASURE_BUDGET_S`` or the job's expected work (:func:`job_budget_s`) says otherwise
#: (:func:`measure_budget_s`).
MEASURE_BUDGET_S = 1.0

#: Seconds of measuring each token a job is expected to generate pays for (:func:`job_budget_s`): what
#: a measured choice may save a decode step, so that measuring costs a job no more than it saves it.
MEASURE_S_PER_TOKEN = 0.002

#: A job's measuring budget below this many seconds is none at all: measuring one choice takes longer.
MIN_JOB_BUDGET_S = 0.25

#: Seconds this process has spent in measurements (:func:`timed`'s ``measure_fn`` calls).
_spent_s = 0.0


def measure_budget_s(unstated: float = MEASURE_BUDGET_S) -> float:
    """The measuring budget of this process, in seconds: ``$TPENGINE_MEASURE_BUDGET_S`` (a number >= 0;
    ``inf``: no limit; 0: nothing new is measured), else the job's (:func:`job_budget_s` of
    :func:`job_tokens`, where the process runs a job that stated its work), else ``unstated``
    (:data:`MEASURE_BUDGET_S`; the huge-page move at load passes ``inf``).
    Once a process's measurements have taken that long, every further choice without cached timings takes its default
    (:data:`DEFAULT_BUDGET`, not cached) and a later start measures it, so a new shape costs a start at
    most the budget plus the one choice measured when the budget ran out (a one-token job would never
    earn back a full measurement; the cache fills over a few starts). Raises ValueError (naming the
    variable) for a value that is not a number >= 0."""
    text = os.environ.get("TPENGINE_MEASURE_BUDGET_S", "").strip()
    if not text:
        tokens = job_tokens()
        return unstated if tokens is None else job_budget_s(tokens)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise ValueError(f"TPENGINE_MEASURE_BUDGET_S={text!r}: must be a number of seconds >= 0 (inf: no limit)")
    return value


def job_tokens() -> int | None:
    """The tokens this process's job is expected to generate, ``$TPENGINE_JOB_TOKENS`` (the batch job
    sets it from its requests' ``max_tokens`` while its engine loads, :func:`tpengine.entrypoints.run.run_engine`);
    None where unset (a server, ``LLM()``, a job with an unbounded request). Raises ValueError (naming
    the variable) for a value that is not a whole number >= 0."""
    text = os.environ.get("TPENGINE_JOB_TOKENS", "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"TPENGINE_JOB_TOKENS={text!r}: must be a whole number of tokens >= 0")
    return int(text)


def job_budget_s(tokens: int) -> float:
    """The measuring budget, in seconds, of a job expected to generate ``tokens`` tokens:
    :data:`MEASURE_S_PER_TOKEN` each, none below :data:`MIN_JOB_BUDGET_S` (a one-token job measures
    nothing new: its choices take their defaults, not cached; a long job measures in proportion)."""
    budget = tokens * MEASURE_S_PER_TOKEN
    return budget if budget >= MIN_JOB_BUDGET_S else 0.0


def short_job() -> bool:
    """Whether this process runs a job too short to earn back anything done for speed at load: its
    stated work (:func:`job_tokens`) gives no measuring budget (:func:`job_budget_s`) and the user set
    none (``$TPENGINE_MEASURE_BUDGET_S``). Such a job measures nothing new (:data:`DEFAULT_SHORT`) and
    keeps its weights in the layout they load in (no reorder: its few forwards never repay one)."""
    tokens = job_tokens()
    return (tokens is not None and not os.environ.get("TPENGINE_MEASURE_BUDGET_S", "").strip()
            and job_budget_s(tokens) == 0)


def _measure_timed(measure_fn: Callable[[], dict[str, list] | None]) -> dict[str, list] | None:
    """``measure_fn()``, its seconds added to this process's measuring time (:func:`measure_budget_s`)."""
    global _spent_s
    start = time.perf_counter()
    try:
        return measure_fn()
    finally:
        _spent_s += time.perf_counter() - start


def read_cache(path: Path) -> dict:
    """A timings file's JSON object; {} for a missing, unreadable or damaged file (then measured
    again)."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_cache(path: Path, data: dict) -> None:
    """Write a timings file atomically (a concurrent rank sees the whole file or none); a cache
    that cannot be written only means measuring again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".timings-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass


def cache_path() -> Path:
    """The timings file for this CPU (model and flags), build of the C kernels, torch version and
    thread count."""
    key = "\0".join(["choices", str(CACHE_VERSION), cpu_id(), cpu_library.library_key(), torch.__version__,
                     str(torch.get_num_threads())])
    return cache_root() / f"choices-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def pick(times_us: dict[str, list[float]]) -> str:
    """The candidate with the smallest sum over workloads of its time / the fastest time there (the
    first listed among equals)."""
    best = [min(ts) for ts in zip(*times_us.values())]
    score = {k: sum(t / max(b, 1e-9) for t, b in zip(v, best)) for k, v in times_us.items()}
    return min(score, key=lambda k: score[k])


def wins_from(times: dict[str, list[float]], sizes: list[int], new: str, old: str) -> int:
    """The smallest of ``sizes`` (ascending, one per entry of ``times[new]`` and ``times[old]``) from which
    ``new`` is faster than ``old`` at every larger size too; 0 where it is not faster at the largest (the
    start of a path that pays from some batch or row count on: the paged kernel's AMX path, the blocked
    GEMM's)."""
    start = 0
    for i in reversed(range(len(sizes))):
        if times[new][i] >= times[old][i]:
            break
        start = sizes[i]
    return start


def measure(candidates: dict[str, list[Callable[[], object]]], passes: int = 5) -> dict[str, list[float]]:
    """Microseconds per call of each candidate at each of its workloads (one callable per
    workload, the same count for every candidate): the median of ``passes`` timed calls after a
    warm-up call (3 where they take :data:`ENOUGH_US` together, :func:`time_us`)."""
    return {k: [time_us([f], passes) for f in fns] for k, fns in candidates.items()}


#: Seconds :func:`probe_busy` watches the machine for.
PROBE_S = 0.2

#: Seconds a busy verdict holds (:func:`probe_busy`, or a measurement pass found disturbed): the
#: choices of one load that find no cached timings on a busy machine then wait for one probe, not
#: one each (a SmolLM2 load has about ten such choices per rank).
BUSY_HOLD_S = 10.0

#: ``time.monotonic()`` of this process's last busy verdict (None: none yet).
_busy_at: float | None = None


def _saw_busy() -> None:
    """Note a busy verdict now (:data:`BUSY_HOLD_S`)."""
    global _busy_at
    _busy_at = time.monotonic()


def probe_busy() -> bool:
    """Whether other processes keep this process's CPUs busy now: a :data:`PROBE_S` window of
    :class:`Contention` while this process sleeps (so every core it could use counts as free);
    within :data:`BUSY_HOLD_S` of this process's last busy verdict, busy without a new window.
    False where ``/proc/stat`` cannot be read."""
    if _busy_at is not None and time.monotonic() - _busy_at < BUSY_HOLD_S:
        return True
    with Contention(min_s=0.0) as load:
        time.sleep(PROBE_S)
    if load.busy:
        _saw_busy()
    return load.busy


def _numbers(times: object) -> bool:
    """Whether ``times`` is timings as :func:`timed` caches them: name -> a list of non-negative numbers
    (or None where a path was not timed)."""
    return isinstance(times, dict) and bool(times) and all(
        isinstance(v, list) and all(t is None or (isinstance(t, (int, float)) and t >= 0) for t in v)
        for v in times.values())


def _faster(a: dict[str, list], b: dict[str, list]) -> dict[str, list]:
    """The faster of two measurements per name and workload (None where a path was not timed)."""
    return {k: [None if x is None or y is None else min(x, y) for x, y in zip(v, b[k])] for k, v in a.items()}


def timed(key: str, measure_fn: Callable[[], dict[str, list] | None],
          valid: Callable[[dict], bool] | None = None,
          decide: Callable[[dict], object] | None = None) -> tuple[dict[str, list] | None, str]:
    """``(times, how)`` for the choice cached as ``key`` (say what is timed: the kind, shapes and dtype),
    by the rule of this module: ``measure_fn()`` gives name -> microseconds per workload (None where a
    path was not timed; a None result: nothing measurable). ``valid(times)``: whether cached timings
    serve this call (default: any well-formed ones). ``decide(times)``: what the caller takes from
    the timings (compared with ``==``); two passes agree where their decisions are equal (default:
    their times within :func:`consistent`'s ratio; where the two disagree, a third pass and the two that
    agree). Returns the cached timings ("cached"); None and
    :data:`DEFAULT_BUSY` when the machine is busy before measuring (the caller takes its default); else
    the measurement ("measured", cached: the faster of the agreeing passes' times; :data:`NOISY` or
    :data:`BUSY`, not cached: the first pass's); None and
    :data:`DEFAULT_BUDGET` once this process has spent its measuring budget (:func:`measure_budget_s`;
    :data:`DEFAULT_SHORT` where that is a short job's none, :func:`short_job`)."""
    path = cache_path()
    times = read_cache(path).get(key)
    if _numbers(times) and (valid is None or valid(times)):
        return times, "cached"
    if _spent_s >= measure_budget_s():
        return None, DEFAULT_SHORT if short_job() else DEFAULT_BUDGET
    if probe_busy():
        return None, DEFAULT_BUSY
    with Contention() as load:  # a busy first measurement is this run's only: no second one could cache it
        first = _measure_timed(measure_fn)
    if first is None:
        return None, "default"  # nothing measurable: the caller's default, not for lack of a quiet machine
    if load.busy:
        _saw_busy()
        return first, BUSY

    def agree(a: dict[str, list], b: dict[str, list]) -> bool:
        return consistent(a, b) if decide is None else decide(a) == decide(b)

    with Contention() as load:
        second = _measure_timed(measure_fn)
    if load.busy:
        _saw_busy()
    if load.busy or second is None:
        return first, BUSY
    if not agree(first, second):  # a third pass decides (a disturbed pass, or a near-tie)
        with Contention() as load:
            third = _measure_timed(measure_fn)
        if load.busy:
            _saw_busy()
        pair = None if load.busy or third is None else next(
            ((a, third) for a in (first, second) if agree(a, third)), None)
        if pair is None:
            return first, NOISY
        first, second = pair
    times = _faster(first, second)
    cache = read_cache(path)  # another process may have written meanwhile
    cache[key] = times
    write_cache(path, cache)
    return times, "measured"


def timings(key: str, candidates: dict[str, list[Callable[[], object]]], passes: int = 5,
            decide: Callable[[dict], object] | None = None) -> tuple[dict[str, list[float]] | None, str]:
    """:func:`timed` of ``candidates`` (name -> one callable per workload, the same count for each),
    each timed by :func:`measure` (the median of ``passes`` timed calls per workload); cached timings
    serve only for exactly these names and workloads. ``decide``: what the caller takes from the
    timings, for :func:`timed` (default :func:`pick`).
    Raises ValueError for no candidates or unequal workload counts."""
    if not candidates or len({len(v) for v in candidates.values()}) != 1 or not next(iter(candidates.values())):
        raise ValueError(f"measured choice {key!r}: need candidates with the same number (>= 1) of workloads, "
                         f"got {({k: len(v) for k, v in candidates.items()})}")

    def valid(times: dict) -> bool:
        return sorted(times) == sorted(candidates) and all(
            len(v) == len(candidates[k]) and None not in v for k, v in times.items())
    return timed(key, lambda: measure(candidates, passes), valid, decide or pick)


def fastest(key: str, candidates: dict[str, list[Callable[[], object]]], passes: int = 5,
            default: str | None = None) -> Choice:
    """The measured choice among ``candidates`` (every candidate must give the same result): the
    :func:`pick` of their :func:`timings` under ``key``; on a busy machine without cached timings
    ``default`` (the first candidate where None), described as :data:`DEFAULT_BUSY`. Raises
    ValueError as :func:`timings`."""
    times, how = timings(key, candidates, passes)
    if times is None:
        return Choice(default if default is not None else next(iter(candidates)), how, {})
    return Choice(pick(times), how, times)
