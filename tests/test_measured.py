"""Measured choices are never cached from a busy machine (:class:`tpengine.backends.cpu.measured.
Contention`): other processes that keep the cores busy during a measurement are seen in
``/proc/stat``, and a choice timed then is that run's only, in every cache that holds timings. A start
that finds the machine busy before measuring (:func:`~tpengine.backends.cpu.measured.probe_busy`) uses
cached quiet timings or takes each choice's default, measuring nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import QuietContention

from tpengine.backends.cpu import measured

# measured choices are this module's subject: no measuring budget (conftest's default is 0: nothing measured)
pytestmark = [pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux's /proc/stat"),
              pytest.mark.usefixtures("measuring")]


def test_spinning_processes_on_every_core_make_the_window_busy():
    cores = len(os.sched_getaffinity(0))
    # each spinner says when it spins, and spins until it is killed (at most a minute)
    spin = "import time\nprint('spinning', flush=True)\nt = time.monotonic() + 60\nwhile time.monotonic() < t: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True) for _ in range(cores)]
    try:
        assert [p.stdout.readline() for p in procs] == ["spinning\n"] * cores
        with measured.Contention(threads=1) as load:
            time.sleep(0.5)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    # `cores` spinners use about `cores` cores; this process (1 thread) leaves cores - 1 free
    assert load.busy and load.others_cores > cores - 1 + 0.5, load.others_cores


def test_only_this_process_busy_is_not_contention(monkeypatch):
    """The machine's busy time equal to this process's own CPU time: nobody else ran."""
    monkeypatch.setattr(measured, "_cpu_busy_s", lambda cpus=None: time.process_time())
    with measured.Contention() as load:
        t = time.perf_counter() + 0.15
        while time.perf_counter() < t:
            pass
    assert not load.busy and load.others_cores < 0.01
    with measured.Contention() as short:  # under min_s: not judged
        pass
    assert not short.busy


def test_timings_from_a_busy_machine_are_used_but_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measured, "probe_busy", lambda: False)  # quiet when the measurement starts
    busy = iter(range(0, 10 ** 6, 1000))  # 1000 CPU-seconds of other processes between two reads
    monkeypatch.setattr(measured, "_cpu_busy_s", lambda cpus=None: float(next(busy)))

    # given timings (us), not real ones: the rule is under test, not the clock
    monkeypatch.setattr(measured, "measure", lambda candidates, passes=5: {"a": [60.0], "b": [10.0]})
    real = measured.Contention
    monkeypatch.setattr(measured, "Contention", lambda **kw: real(min_s=0.0))  # every window is judged

    def never():
        raise AssertionError("measure() is faked: no candidate runs")

    times, how = measured.timings("k", {"a": [never], "b": [never]}, passes=1)
    assert how == measured.BUSY == "measured, machine busy (not cached)"
    assert times == {"a": [60.0], "b": [10.0]} and measured.read_cache(measured.cache_path()) == {}
    monkeypatch.setattr(measured, "_cpu_busy_s", lambda cpus=None: time.process_time())  # quiet: cached
    times, how = measured.timings("k", {"a": [never], "b": [never]}, passes=1)
    assert how == "measured" and measured.read_cache(measured.cache_path())["k"] == times == {"a": [60.0], "b": [10.0]}


def test_linear_layouts_skip_the_cache_when_busy(monkeypatch, tmp_path):
    from tpengine.backends.cpu import linear_layout

    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    busy = iter(range(0, 10 ** 6, 1000))
    monkeypatch.setattr(measured, "_cpu_busy_s", lambda cpus=None: float(next(busy)))
    monkeypatch.setattr(measured, "probe_busy", lambda: False)  # quiet when the measurement starts
    real = measured.Contention
    monkeypatch.setattr(measured, "Contention", lambda **kw: real(min_s=0.0))
    got = linear_layout.choose_layouts({(48, 32): 2}, torch.float32)
    assert got[(48, 32)].how == measured.BUSY
    assert measured.read_cache(measured.cache_path()) == {}


def test_a_busy_start_takes_each_default_and_measures_nothing(monkeypatch, tmp_path):
    """Without cached timings a machine found busy before measuring (a fake contention source here) takes
    each choice's default, described as such, measures nothing and caches nothing; timings cached from a
    quiet start are used whatever the load."""
    from tpengine.backends.cpu import linear_layout, qgemv_choice

    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measured, "probe_busy", lambda: True)
    ran = []
    monkeypatch.setattr(measured, "measure", lambda c, *_: ran.append(sorted(c)) or {k: [1.0] for k in c})
    got = measured.fastest("k", {"a": [lambda: None], "b": [lambda: None]}, default="b")
    assert (got.name, got.how, got.times_us) == ("b", measured.DEFAULT_BUSY, {})
    assert got.describe() == "b (default: machine busy, not measured)"
    assert measured.fastest("k", {"a": [lambda: None], "b": [lambda: None]}).name == "a"  # no default: the first
    monkeypatch.setattr(linear_layout, "measure", lambda *a: ran.append("layout") or {"plain": [1.0, 1.0, 1.0]})
    layout = linear_layout.choose_layouts({(48, 32): 2}, torch.float32)[(48, 32)]
    packable = linear_layout.prepack(torch.zeros(1, 1)) is not None
    assert (layout.layout, layout.how, layout.kernels) == ("packed" if packable else "plain", measured.DEFAULT_BUSY, ())

    class Int4Weight:
        dtype, group_size, gemv_rows, dequant_rows = torch.float32, 32, 0, 0
    monkeypatch.setattr(qgemv_choice, "_measure", lambda mods, dt=None: ran.append("quant") or {})
    q = qgemv_choice.choose({"int4 g32 64->96": [Int4Weight()]})["int4 g32 64->96"]
    assert (q["how"], q["gemv_rows"], q["dequant_rows"]) == (measured.DEFAULT_BUSY, 8, 64)
    assert ran == [] and measured.read_cache(measured.cache_path()) == {}
    measured.write_cache(measured.cache_path(), {"k": {"a": [2.0], "b": [1.0]}})  # a quiet start's timings
    assert measured.fastest("k", {"a": [lambda: None], "b": [lambda: None]}, default="a").how == "cached"
    assert measured.fastest("k", {"a": [lambda: None], "b": [lambda: None]}, default="a").name == "b"


def test_one_cache_version_in_the_package():
    """Every measured choice shares one timings file and one CACHE_VERSION (tpengine/backends/cpu/measured.py)."""
    import pathlib
    import re

    root = pathlib.Path(measured.__file__).resolve().parents[2]
    found = [p for p in root.rglob("*.py") if re.search(r"^CACHE_VERSION\b", p.read_text(), re.M)]
    assert found == [pathlib.Path(measured.__file__).resolve()]


def test_time_us_gives_up_after_the_warm_up_pass():
    """``give_up_us``: a warm-up pass slower than it is the timing (no timed pass runs); a faster one,
    or none given, is followed by the ``passes`` timed passes."""
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    assert measured.time_us(fns, passes=2, give_up_us=0.0) > 0 and calls == [0, 1, 2]
    calls.clear()
    measured.time_us(fns, passes=2, give_up_us=1e12)
    assert calls == [0, 1, 2] * 3
    calls.clear()
    measured.time_us(fns, passes=2)
    assert calls == [0, 1, 2] * 3


def test_a_third_pass_decides_between_two_that_disagree(tmp_path, monkeypatch):
    """measured.timed: two quiet passes that decide differently get a third; the two that agree are cached
    (the faster of their times), the first pass is this run's where the third agrees with neither or another
    process disturbed it; two that agree get no third."""
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measured, "probe_busy", lambda: False)
    monkeypatch.setattr(measured, "_spent_s", 0.0)
    monkeypatch.setattr(measured, "_busy_at", None)  # (restored after: a busy pass sets it)
    monkeypatch.setenv("TPENGINE_MEASURE_BUDGET_S", "inf")
    busy_at = []  # the passes (1-based) another process disturbs

    class Window(QuietContention):
        def __exit__(self, *exc):
            self.busy = len(passes) in busy_at
    monkeypatch.setattr(measured, "Contention", Window)

    def run(key, *results):
        it = iter(results)
        got = measured.timed(key, lambda: passes.append(1) or next(it), decide=lambda t: t["a"][0] < t["b"][0])
        return got, len(passes)
    passes = []
    assert run("k1", {"a": [1.0], "b": [2.0]}, {"a": [3.0], "b": [2.0]}, {"a": [0.5], "b": [2.5]}) == (
        ({"a": [0.5], "b": [2.0]}, "measured"), 3)
    passes = []
    assert run("k2", {"a": [1.0], "b": [2.0]}, {"a": [1.5], "b": [2.0]}) == (({"a": [1.0], "b": [2.0]}, "measured"), 2)
    passes, busy_at = [], [3]
    assert run("k3", {"a": [1.0], "b": [2.0]}, {"a": [3.0], "b": [2.0]}, {"a": [0.5], "b": [2.5]}) == (
        ({"a": [1.0], "b": [2.0]}, measured.NOISY), 3)
    assert sorted(measured.read_cache(measured.cache_path())) == ["k1", "k2"]


def test_time_us_times_long_calls_by_few():
    """Calls that take ``enough_us`` together: the warm-up stops after 2 of them (not a round of every
    callable), the timing after 3 (not ``passes`` rounds); each call still goes round the callables in order.
    Short ones: a round, then ``passes`` rounds."""
    calls = []

    def slow(i):
        calls.append(i)
        time.sleep(0.002)
    fns = [lambda i=i: slow(i) for i in range(6)]
    assert measured.time_us(fns, passes=4, enough_us=1000.0) >= 2000.0
    assert calls == [0, 1, 2, 3, 4]  # 2 warm-up calls, 3 timed
    calls.clear()
    measured.time_us(fns[:2], passes=4, enough_us=1e9)
    assert calls == [0, 1] * 5


def test_time_us_gives_up_only_where_every_warm_up_call_was_slower():
    """``give_up_us``: the warm-up takes 2 calls at least (the first of a new shape may pay set-up costs) unless
    the first alone took ``enough_us`` (a call that long rules: torch's int4 GEMM at prefill rows can take
    minutes), and the candidate is given up only where the fastest of them took longer than ``give_up_us``."""
    calls = []

    def first_slow(i):
        calls.append(i)
        if len(calls) == 1:
            time.sleep(0.005)
    measured.time_us([lambda: first_slow(0)], passes=2, give_up_us=1000.0)
    assert calls == [0] * 4  # 2 warm-up calls, the second fast: 2 timed
    calls.clear()
    assert measured.time_us([lambda: first_slow(0)], passes=2, give_up_us=0.0) > 0 and calls == [0, 0]
    calls.clear()
    assert measured.time_us([lambda: first_slow(0)], passes=2, give_up_us=1000.0, enough_us=4000.0) >= 5000.0
    assert calls == [0]


def test_linear_layouts_time_the_kernels_first_and_give_the_rest_up_past_4x(monkeypatch):
    """linear_layout.plain_timings times the GEMV and GEMM kernels first at each bucket, then F.linear and the
    widened GEMM with GIVE_UP times the fastest so far as their ``give_up_us``; the blocked layout and oneDNN's
    packed one (linear_layout.measure) with GIVE_UP times the fastest of all before them. The timings keep
    plain first (the load's log)."""
    from tpengine.backends.cpu import cpu_blocked, linear_layout

    asked = []

    def fake_time_us(fns, passes=4, give_up_us=None):
        asked.append(give_up_us)
        return 10.0 * len(asked)
    monkeypatch.setattr(linear_layout, "time_us", fake_time_us)
    monkeypatch.setattr(linear_layout.cpu_program, "runs", lambda: False)
    for mod in (linear_layout.cpu_gemv, linear_layout.cpu_gemm, linear_layout.cpu_widen):  # (on any CPU)
        monkeypatch.setattr(mod, "available", lambda w: True)
    assert linear_layout.cpu_gemv.MAX_ROWS == 8 and linear_layout.cpu_gemm.MIN_ROWS <= 64
    times = linear_layout.plain_timings([torch.zeros(8, 16, dtype=torch.bfloat16)], torch.bfloat16)
    g = measured.GIVE_UP
    assert list(times) == ["plain", "gemv", "gemm", "widen"]
    # gemv at 1 and 8 rows (10, 20), gemm at 64 (30), then plain at 1, 8, 64, then widen at 8, 64
    assert asked == [None, None, None, g * 10, g * 20, g * 30, g * 20, g * 30]
    assert times == {"plain": [40.0, 50.0, 60.0], "gemv": [10.0, 20.0, None], "gemm": [None, None, 30.0],
                     "widen": [None, 70.0, 80.0]}
    asked.clear()
    monkeypatch.setattr(cpu_blocked, "pack", lambda w: w)
    monkeypatch.setattr(linear_layout, "_blocked_rows", lambda b: lambda x: None)
    got = linear_layout.blocked_timing([torch.zeros(8, 16, dtype=torch.bfloat16)], 0, rivals=times)
    assert asked == [g * 10, g * 20, g * 30] and got == {"blocked": [10.0, 20.0, 30.0]}


def test_qgemv_measure_times_the_rival_first_and_gives_torch_up_past_4x(monkeypatch):
    """qgemv_choice._measure times these kernels (decode rows) and dequantize + GEMM (prefill rows)
    before torch's kernel at each bucket, and hands time_us GIVE_UP times their time as torch's
    ``give_up_us``; every path keeps one timing per bucket."""
    from tpengine.backends.cpu import qgemv_choice

    asked = []

    def fake_time_us(fns, passes=4, give_up_us=None):
        asked.append(give_up_us)
        return 10.0 * len(asked)
    monkeypatch.setattr(qgemv_choice, "time_us", fake_time_us)

    class Int4Weight:
        in_features, dtype, group_size, gemv_rows, dequant_rows = 64, torch.float32, 32, 0, 0

        def bind(self):  # (the bound call each path is timed through; time_us is faked here)
            return lambda x: None
    times = qgemv_choice._measure([Int4Weight(), Int4Weight()])
    g = qgemv_choice.GIVE_UP
    assert g == 4.0
    assert asked == [None, g * 10, None, g * 30, None, g * 50, None, g * 70, None, g * 90]
    assert times == {"torch": [20.0, 40.0, 60.0], "tpengine": [10.0, 30.0, 50.0],
                     "prefill_torch": [80.0, 100.0], "prefill_dequant": [70.0, 90.0]}


def test_qgemv_measure_runs_torch_no_more_at_prefill_rows_past_a_loss_by_over_4x(monkeypatch):
    """Once torch's kernel lost by over GIVE_UP at a prefill bucket (64 rows), it is not run at the larger
    one (512 rows: a call of torch's AVX2 bfloat16 int4 GEMM took minutes there); its time is the lost one
    times 512 / 64, so dequantize + GEMM is chosen from 64 rows."""
    from tpengine.backends.cpu import qgemv_choice

    asked = []

    def fake_time_us(fns, passes=4, give_up_us=None):
        asked.append(give_up_us)
        return {7: 10.0, 8: 50.0, 9: 20.0}.get(len(asked), 1.0)  # 64 rows: dequant 10 us, torch 50 us
    monkeypatch.setattr(qgemv_choice, "time_us", fake_time_us)

    class Int4Weight:
        in_features, dtype, group_size, gemv_rows, dequant_rows = 64, torch.float32, 32, 0, 0

        def bind(self):  # (the bound call each path is timed through; time_us is faked here)
            return lambda x: None
    times = qgemv_choice._measure([Int4Weight()])
    assert len(asked) == 3 * 2 + 3  # decode: 3 buckets x 2 paths; prefill: both at 64 rows, dequant at 512
    assert times["prefill_dequant"] == [10.0, 20.0] and times["prefill_torch"] == [50.0, 400.0]
    assert qgemv_choice.dequant_rows(times) == 64


def test_a_busy_first_measurement_is_not_taken_twice(monkeypatch, tmp_path):
    """A first measurement taken while the machine was busy is that run's only (BUSY, not cached), so no
    second one is taken: measured.timings, the linear layouts and the quantized kernels each measure once;
    on a quiet machine twice (the agreement check)."""
    from tpengine.backends.cpu import linear_layout, qgemv_choice

    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measured, "probe_busy", lambda: False)  # quiet when each measurement starts

    class Busy:
        busy = True

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Quiet(Busy):
        busy = False

    for contention, runs in ((Busy, 1), (Quiet, 2)):
        monkeypatch.setattr(measured, "Contention", contention)
        calls = []
        times, how = measured.timings(f"k{runs}", {"a": [lambda: calls.append("a")]}, passes=1)
        assert len(calls) == 2 * runs and (how == measured.BUSY) == (runs == 1)
        n = []
        got = linear_layout._timed(f"layout k{runs}", ("plain",), lambda: n.append(1) or {"plain": [1.0, 2.0, 3.0]})
        assert len(n) == runs and (got[1] == measured.BUSY) == (runs == 1)
        m = []
        monkeypatch.setattr(qgemv_choice, "_measure", lambda mods, dt=None: m.append(1) or {
            "torch": [10.0, 20.0, 30.0], "tpengine": [5.0, 10.0, 15.0]})

        class Mod:
            dtype, gemv_rows, dequant_rows = torch.float32, 0, 0
        c = qgemv_choice.choose({f"int4 g32 64->{96 * runs}": [Mod()]}, rank=0)[f"int4 g32 64->{96 * runs}"]
        assert len(m) == runs and c["how"] == (measured.BUSY if runs == 1 else "measured") and c["gemv_rows"] == 8


def test_a_busy_verdict_holds_for_the_loads_next_choices(monkeypatch):
    """One busy probe (or a disturbed measurement pass) serves the choices after it for BUSY_HOLD_S:
    they take their defaults without a probe window each; after the hold the machine is probed again."""
    windows = []

    class Busy:
        def __init__(self, min_s=None):
            self.busy = True

        def __enter__(self):
            windows.append(1)
            return self

        def __exit__(self, *exc):
            return False

    clock = [1000.0]
    monkeypatch.setattr(measured, "Contention", Busy)
    monkeypatch.setattr(measured.time, "sleep", lambda s: None)
    monkeypatch.setattr(measured.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(measured, "_busy_at", None)
    assert measured.probe_busy() and len(windows) == 1
    clock[0] += measured.BUSY_HOLD_S / 2
    assert measured.probe_busy() and len(windows) == 1  # held: no second window
    clock[0] += measured.BUSY_HOLD_S
    assert measured.probe_busy() and len(windows) == 2  # the hold is over: probed again


def test_a_spent_measuring_budget_takes_defaults_and_caches_nothing(monkeypatch, tmp_path):
    """Once a process's measurements took its budget ($TPENGINE_MEASURE_BUDGET_S), a choice without
    cached timings takes its default (not cached, a later start measures it); cached ones still serve,
    and the choice measured when the budget ran out completes (both passes)."""
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measured, "probe_busy", lambda: False)
    monkeypatch.setattr(measured, "Contention", QuietContention)
    monkeypatch.setattr(measured, "_spent_s", 0.0)
    calls = []

    def slow(candidates, passes=5):  # each pass "takes" 0.3 s of the budget
        calls.append(1)
        measured._spent_s += 0.3
        return {"a": [60.0], "b": [10.0]}

    monkeypatch.setattr(measured, "measure", slow)
    monkeypatch.setenv("TPENGINE_MEASURE_BUDGET_S", "0.5")
    assert measured.measure_budget_s() == 0.5
    first = measured.fastest("budget one", {"a": [lambda: 1], "b": [lambda: 1]})
    assert (first.name, first.how, len(calls)) == ("b", "measured", 2)  # started under the budget: both passes
    second = measured.fastest("budget two", {"a": [lambda: 1], "b": [lambda: 1]})
    assert (second.name, second.how, second.times_us, len(calls)) == ("a", measured.DEFAULT_BUDGET, {}, 2)
    assert "budget two" not in measured.read_cache(measured.cache_path())
    again = measured.fastest("budget one", {"a": [lambda: 1], "b": [lambda: 1]})
    assert (again.name, again.how) == ("b", "cached")
    monkeypatch.setattr(measured, "_spent_s", 0.0)  # a later start: measures the rest
    assert measured.fastest("budget two", {"a": [lambda: 1], "b": [lambda: 1]}).how == "measured"
    monkeypatch.setenv("TPENGINE_MEASURE_BUDGET_S", "0")
    monkeypatch.setattr(measured, "_spent_s", 0.0)
    assert measured.fastest("budget three", {"a": [lambda: 1], "b": [lambda: 1]}).how == measured.DEFAULT_BUDGET
    monkeypatch.setenv("TPENGINE_MEASURE_BUDGET_S", "inf")
    assert measured.measure_budget_s() == float("inf")
    monkeypatch.delenv("TPENGINE_MEASURE_BUDGET_S")
    assert measured.measure_budget_s() == measured.MEASURE_BUDGET_S
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv("TPENGINE_MEASURE_BUDGET_S", bad)
        with pytest.raises(ValueError, match=f"TPENGINE_MEASURE_BUDGET_S='{bad}': must be a number of seconds"):
            measured.measure_budget_s()


def test_a_short_job_measures_nothing_and_keeps_its_weights_plain(monkeypatch, tmp_path):
    """The batch job states its work ($TPENGINE_JOB_TOKENS, from its requests' max_tokens x n): a budget
    in proportion (none under MIN_JOB_BUDGET_S), the user's $TPENGINE_MEASURE_BUDGET_S first; a short job
    takes every layout plain (no reorder) even where cached timings chose another, keeping their kernels."""
    from tpengine.backends.cpu import linear_layout
    from tpengine.entrypoints.run import stated_work
    from tpengine.frontend.request_file import RequestFile

    monkeypatch.delenv("TPENGINE_MEASURE_BUDGET_S", raising=False)
    monkeypatch.delenv("TPENGINE_JOB_TOKENS", raising=False)
    monkeypatch.setattr(measured, "_spent_s", 0.0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x", "max_tokens": 1}\n{"id": "b", "prompt": "y", "n": 3}\n')
    assert RequestFile(prompts).max_new_tokens == 1 + 16 * 3  # the simple lines' default max_tokens is 16
    assert RequestFile(prompts, {"max_tokens": None}).max_new_tokens is None
    with stated_work(49):
        assert (measured.job_tokens(), measured.measure_budget_s(), measured.short_job()) == (49, 0.0, True)
        assert measured.fastest("short", {"a": [lambda: 1], "b": [lambda: 1]}).how == measured.DEFAULT_SHORT
        times = {"plain": [30.0, 30.0, 90.0], "gemv": [10.0, 20.0, None], "packed": [20.0, 20.0, 40.0]}
        monkeypatch.setattr(linear_layout, "_timed", lambda key, needs, fn: (times, "cached"))
        got = linear_layout.choose_layouts({(32, 16): 2}, torch.float32)[(32, 16)]
        assert (got.layout, got.kernels, got.how) == ("plain", linear_layout.plain_kernels(times), "cached")
        assert got.kernels[0] == "gemv"
        monkeypatch.setenv("TPENGINE_MEASURE_BUDGET_S", "inf")  # the user's budget wins: no short job
        assert (measured.measure_budget_s(), measured.short_job()) == (float("inf"), False)
        assert linear_layout.choose_layouts({(32, 16): 2}, torch.float32)[(32, 16)].layout == "packed"
        monkeypatch.delenv("TPENGINE_MEASURE_BUDGET_S")
    assert "TPENGINE_JOB_TOKENS" not in os.environ  # stated for the load only
    assert measured.job_budget_s(1000) == 1000 * measured.MEASURE_S_PER_TOKEN >= measured.MIN_JOB_BUDGET_S
    with stated_work(None):
        assert measured.measure_budget_s() == measured.MEASURE_BUDGET_S  # unbounded: the default budget
    monkeypatch.setenv("TPENGINE_JOB_TOKENS", "many")
    with pytest.raises(ValueError, match="TPENGINE_JOB_TOKENS='many': must be a whole number of tokens"):
        measured.measure_budget_s()


def test_wins_from_is_the_first_size_winning_at_every_larger_one():
    sizes = [1, 8, 16, 64]
    old = [4.0, 5.0, 2.0, 3.0]
    assert measured.wins_from({"new": [5.0, 4.0, 1.0, 1.0], "old": old}, sizes, "new", "old") == 8
    assert measured.wins_from({"new": [1.0, 6.0, 1.0, 1.0], "old": old}, sizes, "new", "old") == 16  # lost at 8
    assert measured.wins_from({"new": [1.0, 1.0, 1.0, 3.0], "old": old}, sizes, "new", "old") == 0  # a tie at 64


def test_a_tied_head_is_measured_before_the_layers_shapes(monkeypatch, tmp_path):
    """A fresh cache's measuring budget goes to the largest weights first, the tied LM head among them
    (choose_layouts' ``head``, on a synthetic weight of its shape): the layers' shapes measured after the
    budget ran out take their defaults, and choose_head of the loaded weight takes the head's timings (no
    second measurement)."""
    from tpengine.backends.cpu import cpu_library, linear_layout

    cpu_library.load()  # the kernels from the usual cache (the timings' cache below is a fresh folder)
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measured, "probe_busy", lambda: False)
    monkeypatch.setattr(measured, "Contention", QuietContention)
    monkeypatch.setattr(measured, "_spent_s", 0.0)
    monkeypatch.setenv("TPENGINE_MEASURE_BUDGET_S", "1e-9")  # the first choice measured spends it
    timed = []

    def plain_timings(weights, dtype, kernels=("gemv", "gemm", "widen"), program=False):
        timed.append(tuple(weights[0].shape))
        return {"plain": [50.0, 60.0, 70.0], **{k: [5.0, 6.0, 7.0] for k in kernels}}
    monkeypatch.setattr(linear_layout, "plain_timings", plain_timings)
    monkeypatch.setattr(linear_layout, "blocked_timing", lambda weights, group, program=False, rivals=None: {
        "blocked": [90.0, 90.0, 90.0]})
    head = (256, 64)
    got = linear_layout.choose_layouts({(64, 64): 2}, torch.float32, head=head)
    assert timed == [head, head]  # the head's two passes, then the budget was spent
    assert got[(64, 64)].how == measured.DEFAULT_BUDGET
    choice = linear_layout.choose_head(torch.zeros(head), "auto", True)
    assert (choice.layout, choice.how, timed) == ("plain", "measured", [head, head])
    assert choice.kernels and set(choice.kernels) <= {"gemv", "gemm", "widen"}
    # with budget for all: by bytes, largest first (4 layers of 128 x 64, the head, 2 layers of 64 x 64)
    monkeypatch.setenv("TPENGINE_MEASURE_BUDGET_S", "inf")
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path / "second"))
    timed.clear()
    linear_layout.choose_layouts({(64, 64): 2, (128, 64): 4}, torch.float32, head=head)
    assert timed == [(128, 64), (128, 64), head, head, (64, 64), (64, 64)]
