"""The CPU linear layout choice (issue 17, tpengine/backends/cpu/linear_layout.py): the decision rule,
forced settings, the per-machine timings cache, and what a loaded model holds for each choice."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import QuietContention, make_tiny_model

from tpengine.backends.cpu import cpu_blocked, cpu_gemm, cpu_gemv, cpu_library, measured
from tpengine.backends.cpu import linear_layout as L
from tpengine.backends.cpu.linear_layout import prepack
from tpengine.config import EngineConfig
from tpengine.distributed import TPInfo
from tpengine.model.loader import load_model

# measured choices are among this module's subjects: no measuring budget (conftest's default is 0: nothing
# measured)
pytestmark = pytest.mark.usefixtures("measuring")

cpu_gemv_ok = cpu_library.has("tpe_gemv_bf16", "tpe_gemv_f32")
cpu_gemm_ok = cpu_library.has("tpe_gemm_f32")
needs_kernels = pytest.mark.skipif(not cpu_gemv_ok, reason=str(cpu_library.missing("tpe_gemv_bf16", "tpe_gemv_f32")))
needs_gemm = pytest.mark.skipif(not cpu_gemm_ok, reason=str(cpu_library.missing("tpe_gemm_f32")))
needs_onednn = pytest.mark.skipif(prepack(torch.zeros(2, 2)) is None, reason="no oneDNN packing in this torch")


@pytest.fixture(autouse=True)
def quiet_start(monkeypatch):
    """The machine counts as quiet when a measurement starts (measured.probe_busy), whatever else runs
    beside the tests: the choices here are made from given timings."""
    monkeypatch.setattr(measured, "probe_busy", lambda: False)


def test_pick_uses_the_summed_relative_time_and_keeps_packed_on_a_tie():
    # plain: 1 + 1.5 + 1.2 = 3.7 vs packed 1.5 + 1 + 1 = 3.5 -> packed
    assert L.pick({"plain": [10, 30, 120], "packed": [15, 20, 100]}) == "packed"
    # one-row win of 2x outweighs two small losses: plain 1 + 1.1 + 1.1 = 3.2 vs packed 2 + 1 + 1 = 4
    assert L.pick({"plain": [10, 22, 110], "packed": [20, 20, 100]}) == "plain"
    assert L.pick({"plain": [1, 1, 1], "packed": [1, 1, 1]}) == "packed"


def test_forced_settings_and_bad_setting():
    shapes = {(960, 576): 30, (576, 1536): 30}
    for s in ("plain", "packed"):
        got = L.choose_layouts(shapes, torch.float32, s)
        assert {k: (v.layout, v.how) for k, v in got.items()} == {k: (s, "forced") for k in shapes}
    with pytest.raises(ValueError) as e:
        L.choose_layouts(shapes, torch.float32, "mkl")
    assert str(e.value) == "invalid cpu_linear='mkl': must be one of auto, plain, packed, blocked"
    with pytest.raises(ValueError) as e:
        EngineConfig(cpu_linear="onednn")
    assert str(e.value) == "invalid cpu_linear='onednn': must be one of auto, plain, packed, blocked"


@needs_onednn
def test_measure_times_every_path_at_every_bucket():
    t = L.measure((48, 32), 3, torch.bfloat16)
    # oneDNN without bfloat16 here (AVX2 only): no packed layout to time, the plain one's paths still are
    packed = set() if prepack(torch.zeros(2, 2, dtype=torch.bfloat16)) is None else {"packed"}
    # the widened float32 GEMM from 2 rows; the bfloat16 GEMM (an AVX2 build's) from 17 rows: 64 only
    bf16_gemm = cpu_library.has(cpu_gemm.KERNELS[torch.bfloat16])
    # the blocked layout where the build has AVX512-BF16 (48 rows: three blocks of 16), timed at every bucket
    blocked = {"blocked"} if cpu_library.has(*cpu_blocked.KERNELS) else set()
    # and the C paths' one-row times in a decode program (the GEMV's, the blocked layout's)
    gemv = {"gemv"} if cpu_gemv_ok else set()
    program = {f"{k}_program" for k in gemv | blocked} if cpu_library.has("tpe_program_run") else set()
    assert set(t) == {"plain", "widen"} | packed | blocked | gemv | program | ({"gemm"} if bf16_gemm else set())
    assert all(len(t[k]) == 3 and min(t[k]) > 0 for k in {"plain"} | packed | blocked)
    assert all(t[k][0] > 0 and t[k][1:] == [None, None] for k in program)
    if blocked:  # an expert shape: its one-row time is the grouped call's, per expert (and no program)
        grouped = L.measure((48, 32), 8, torch.bfloat16, group=4)
        assert len(grouped["blocked"]) == 3 and not any(k.endswith("_program") for k in grouped)
    assert t["widen"][0] is None and t["widen"][1] > 0 and t["widen"][2] > 0
    if cpu_gemv_ok:  # the GEMV takes up to 8 rows: timed at 1 and 8, not at 64
        assert t["gemv"][0] > 0 and t["gemv"][1] > 0 and t["gemv"][2] is None
    if bf16_gemm:
        assert t["gemm"][:2] == [None, None] and t["gemm"][2] > 0
    t = L.measure((48, 32), 3, torch.float32)  # float32 adds the GEMM, which takes from 17 rows: 64 only
    # and its blocked layout (AVX-512 and AVX2 builds), its rows float32
    blocked = {"blocked"} if cpu_library.has(*cpu_blocked.KERNELS_F32) else set()
    program = {f"{k}_program" for k in gemv | blocked} if cpu_library.has("tpe_program_run") else set()
    assert set(t) == {"plain", "packed"} | gemv | blocked | program | ({"gemm"} if cpu_gemm_ok else set())
    assert all(len(t[k]) == 3 and min(t[k]) > 0 for k in blocked)
    if cpu_gemm_ok:  # (an AVX-512 build's: cpu_library.has)
        assert t["gemm"][:2] == [None, None] and t["gemm"][2] > 0
    assert L.measure((1 << 16, 1 << 12), 1, torch.float32) is None  # 1 GiB: above MEASURE_BYTES, not measured


def test_auto_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    calls = []
    fake = {(48, 32): {"plain": [10, 20, 40], "packed": [20, 20, 30]},
            (32, 64): {"plain": [9, 9, 9], "packed": [3, 3, 3]}}
    monkeypatch.setattr(L, "measure", lambda *a: calls.append(a) or fake[a[0]])
    monkeypatch.setattr(L.cpu_blocked, "available", lambda w: False)  # (the fake times have no blocked layout)
    shapes = {(48, 32): 3, (32, 64): 2}
    first = L.choose_layouts(shapes, torch.float32)
    # each shape twice (a consistency check against another process taking the cores)
    # (0: no experts)
    assert sorted(calls) == [((32, 64), 2, torch.float32, 0)] * 2 + [((48, 32), 3, torch.float32, 0)] * 2
    assert {k: (v.layout, v.how) for k, v in first.items()} == {(48, 32): ("plain", "measured"),
                                                                (32, 64): ("packed", "measured")}
    stored = json.loads(measured.cache_path().read_text())
    assert stored == {"linear float32 48x32x3": fake[(48, 32)], "linear float32 32x64x2": fake[(32, 64)]}
    calls.clear()
    second = L.choose_layouts(shapes, torch.float32)
    assert calls == [] and {v.how for v in second.values()} == {"cached"}
    assert {k: v.layout for k, v in second.items()} == {k: v.layout for k, v in first.items()}
    # another dtype is another machine setting: measured again, under its own key
    L.choose_layouts({(48, 32): 3}, torch.bfloat16)
    assert calls == [((48, 32), 3, torch.bfloat16, 0)] * 2 and "linear bfloat16 48x32x3" in json.loads(
        measured.cache_path().read_text())
    # a damaged cache file is measured again, not trusted
    measured.cache_path().write_text("{not json")
    calls.clear()
    L.choose_layouts(shapes, torch.float32)
    assert len(calls) == 4


def test_inconsistent_timings_are_used_but_not_cached(tmp_path, monkeypatch):
    """Three quiet passes that choose three ways (two that disagree, then a third with neither): the first
    is used for this load, nothing cached; two that disagree and a third that sides with one: those two
    cached; two whose times are 4x apart at a bucket but choose alike: cached (the decision is what is
    kept)."""
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measured, "Contention", QuietContention)
    monkeypatch.setattr(measured, "probe_busy", lambda: False)
    packed = {"plain": [10, 20, 30], "gemv": [12, 22, None], "packed": [5, 10, 15]}
    plain_gemv = {"plain": [4, 8, 12], "gemv": [3, 7, None], "packed": [5, 10, 15]}  # plain, on the GEMV kernel
    plain_f = {"plain": [4, 8, 12], "gemv": [5, 9, None], "packed": [5, 10, 15]}  # plain, on F.linear
    runs = iter([packed, plain_gemv, plain_f])
    monkeypatch.setattr(L, "measure", lambda *a: next(runs))
    got = L.choose_layouts({(8, 32): 1}, torch.float32)[(8, 32)]
    assert got.how == "measured, noisy (not cached)" and got.times_us == packed
    assert not measured.cache_path().exists()
    runs = iter([packed, plain_gemv, {**packed, "plain": [11, 19, 33]}])
    got = L.choose_layouts({(8, 32): 1}, torch.float32)[(8, 32)]
    assert (got.layout, got.how) == ("packed", "measured")
    assert got.times_us == {"plain": [10, 19, 30], "gemv": [12, 22, None], "packed": [5, 10, 15]}  # 1st and 3rd
    assert next(runs, None) is None
    measured.cache_path().unlink()
    runs = iter([{"plain": [10, 20, 30], "packed": [5, 10, 15]}, {"plain": [40, 20, 30], "packed": [5, 10, 15]}])
    got = L.choose_layouts({(8, 32): 1}, torch.float32)[(8, 32)]
    assert (got.layout, got.how) == ("packed", "measured")
    assert got.times_us == {"plain": [10, 20, 30], "packed": [5, 10, 15]}  # the faster of the two per bucket
    assert "linear float32 8x32x1" in measured.read_cache(measured.cache_path())
    assert measured.consistent({"plain": [10, None]}, {"plain": [15, 3]})
    assert not measured.consistent({"plain": [10]}, {"plain": [16]})


def test_passes_that_differ_only_in_paths_the_chosen_layout_never_runs_agree(tmp_path, monkeypatch):
    """Two quiet passes that both choose the blocked layout but part on the plain layout's path at one row
    (F.linear against the GEMV kernel, a near-tie): cached, as the choice is the same (a bfloat16 SmolLM2's
    head on Zen 3 did this at every start, so with a 1 s budget its layers were never measured); where the
    plain layout is chosen, its paths are the choice and such passes disagree (a third pass decides)."""
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measured, "Contention", QuietContention)
    monkeypatch.setattr(measured, "probe_busy", lambda: False)
    blocked = {"plain": [40, 300, 2000], "gemv": [38, 100, None], "gemm": [None, None, 400], "blocked": [20, 50, 250]}
    runs = iter([blocked, {**blocked, "plain": [36, 300, 2000]}])
    monkeypatch.setattr(L, "measure", lambda *a: next(runs))
    got = L.choose_layouts({(8, 32): 1}, torch.float32)[(8, 32)]
    assert (got.layout, got.how) == ("blocked", "measured")
    assert "linear float32 8x32x1" in measured.read_cache(measured.cache_path())
    plain = {**blocked, "blocked": [60, 150, 750]}
    runs = iter([plain, {**plain, "plain": [36, 300, 2000]}, {**plain, "plain": [37, 300, 2000]}])
    got = L.choose_layouts({(8, 64): 1}, torch.float32)[(8, 64)]  # the plain paths are the choice: a third pass
    assert (got.layout, got.how, got.kernels) == ("plain", "measured", ("plain", "gemv", "gemm"))
    assert next(runs, None) is None


@pytest.mark.parametrize("packable", [True, False])
def test_an_unmeasured_shape_reports_the_layout_it_keeps(tmp_path, monkeypatch, packable):
    # too big to measure (measure() is None): packed where oneDNN packs this dtype, else plain, as
    # bind() leaves it (an AVX2-only CPU's oneDNN packs no bfloat16), so the log line is true
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(L, "measure", lambda *a: None)
    monkeypatch.setattr(L, "prepack", lambda w: w if packable else None)
    got = L.choose_layouts({(8, 32): 1}, torch.bfloat16)[(8, 32)]
    assert (got.layout, got.how, got.times_us) == ("packed" if packable else "plain", "default", {})


@needs_onednn
@pytest.mark.parametrize("setting", ["plain", "packed"])
def test_loaded_model_holds_each_weight_once_in_the_chosen_layout(tmp_path, setting):
    model_dir = make_tiny_model(tmp_path, "llama", seed=1)
    loaded = load_model(model_dir, TPInfo(0, 1, 0, torch.device("cpu")), torch.float32, cpu_linear=setting)
    model, layouts = loaded.module, loaded.profile.linear_layouts
    linears = [m for n, m in model.named_modules() if hasattr(m, "pack") and not n.endswith("lm_head")]
    assert len(linears) == 2 * 4  # 2 layers: qkv, o, gate_up, down
    assert all((m.packed is not None) == (setting == "packed") for m in linears)
    assert all((m.weight is None) == (setting == "packed") for m in linears)
    assert {c.layout for c in layouts.values()} == {setting}
    line = L.summary(layouts, torch.float32)
    assert line.startswith(f"tpengine: CPU linear layouts (float32, {torch.get_num_threads()} threads, forced): ")


def test_plain_kernels_and_pick_count_the_fastest_plain_path_per_bucket():
    # the GEMV beats F.linear at 1 and 8 rows, the GEMM at 64: plain takes those and wins (3 vs 3.88)
    t = {"plain": [100, 110, 140], "packed": [75, 76, 100], "gemv": [50, 55, None], "gemm": [None, None, 90]}
    assert L.plain_kernels(t) == ("gemv", "gemv", "gemm") and L.plain_times(t) == [50, 55, 90]
    assert L.pick(t) == "plain"
    # the GEMV wins at 1 row only, the GEMM loses at 64: packed stays faster overall
    t = {"plain": [100, 110, 140], "packed": [75, 76, 100], "gemv": [70, 120, None], "gemm": [None, None, 150]}
    assert L.plain_kernels(t) == ("gemv", "plain", "plain") and L.pick(t) == "packed"
    # each bucket on its own: F.linear at 1 row, the GEMV at 8 (issue 17: a near tie at 1 row no
    # longer keeps the GEMV from the 8-row bucket it wins)
    t = {"plain": [317, 730, 1471], "packed": [379, 495, 1201], "gemv": [333, 423, None], "gemm": [None, None, 1070]}
    assert L.plain_kernels(t) == ("plain", "gemv", "gemm") and L.pick(t) == "plain"
    assert L.plain_kernels({"plain": [1, 1, 1], "packed": [1, 1, 1]}) == ("plain",) * 3  # no kernels timed
    assert L.plain_kernels({"plain": [5, 5, 5], "gemv": [5, 5, None]}) == ("plain",) * 3  # a tie keeps F.linear


def test_kernel_at_maps_a_row_count_to_its_bucket():
    kernels = ("plain", "gemv", "gemm")
    got = {rows: L.kernel_at(kernels, rows) for rows in (1, 2, 8, 9, 16, 17, 64, 65, 512)}
    # 9..16 rows fall in the 64-row bucket but are below the GEMM's MIN_ROWS; past 64, the GEMM still
    assert got == {1: "plain", 2: "gemv", 8: "gemv", 9: "plain", 16: "plain", 17: "gemm", 64: "gemm", 65: "gemm",
                   512: "gemm"}
    assert [L.kernel_at(("plain", "gemv", "plain"), rows) for rows in (8, 64, 65)] == ["gemv", "plain", "plain"]
    assert L.kernel_at((), 1) == "plain"
    # the widened GEMM measured fastest at the last bucket keeps a prefill's rows past it
    kernels = ("gemv", "widen", "widen")
    assert [L.kernel_at(kernels, rows) for rows in (1, 2, 8, 9, 64, 65, 4096)] == ["gemv"] + ["widen"] * 6
    assert [L.kernel_at(("gemv", "widen", "plain"), rows) for rows in (8, 64, 65)] == ["widen", "plain", "plain"]


def test_a_dtype_onednn_cannot_pack_gets_its_plain_paths_measured(tmp_path, monkeypatch):
    """An AVX2-only CPU's oneDNN packs no bfloat16: the plain layout's paths are still timed and chosen
    per bucket (before, such a shape kept ``F.linear`` at every row count, unmeasured)."""
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(L, "prepack", lambda w: None)
    monkeypatch.setattr(L.cpu_blocked, "available", lambda w: False)  # (nor AVX512-BF16 for the blocked layout)
    fake = {"plain": [20, 700, 5800], "gemv": [30, 290, None], "widen": [None, 780, 1780]}
    monkeypatch.setattr(L, "plain_timings", lambda *a, **k: {k: list(v) for k, v in fake.items()})
    got = L.choose_layouts({(3072, 576): 1}, torch.bfloat16)[(3072, 576)]
    assert (got.layout, got.how, got.kernels) == ("plain", "measured", ("plain", "gemv", "widen"))
    again = L.choose_layouts({(3072, 576): 1}, torch.bfloat16)[(3072, 576)]  # cached without a packed time
    assert (again.how, again.kernels) == ("cached", ("plain", "gemv", "widen"))
    assert L.pick(fake) == "plain"
    # torch ops only (cpu_kernels False): the widened GEMM is torch's and stays; the GEMV is left out
    assert L.choose_layouts({(3072, 576): 1}, torch.bfloat16, cpu_kernels=False)[(3072, 576)].kernels == (
        "plain", "plain", "widen")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [2, 64, 300])
def test_widened_linear_is_the_float32_product_rounded_once(monkeypatch, dtype, rows):
    """cpu_widen.linear: x @ w.T of half-precision operands in float32, rounded once to x's dtype --
    also when the weight is widened in slabs (a small SCRATCH_BYTES: 7 slabs of 16 rows and one of 8)."""
    from tpengine.backends.cpu import cpu_widen

    g = torch.Generator().manual_seed(rows)
    w, x = (torch.randn(120, 96, generator=g).to(dtype), torch.randn(rows, 96, generator=g).to(dtype))
    want = (x.double() @ w.double().t()).to(dtype)
    got = cpu_widen.linear(x, w)
    assert got.dtype == dtype and got.shape == (rows, 120)
    # float32 sums of exact products: at most one ulp of the half-precision output from the exact result
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -10,
                               atol=1e-3)
    monkeypatch.setattr(cpu_widen, "SCRATCH_BYTES", 16 * 96 * 4)
    torch.testing.assert_close(cpu_widen.linear(x, w).float(), got.float(), rtol=2 ** -7, atol=1e-3)
    assert cpu_widen.linear(x.view(1, rows, 96), w).shape == (1, rows, 120)
    with pytest.raises(ValueError) as e:
        cpu_widen.linear(x, w.float())
    assert str(e.value) == ("widened linear: x [..., 96] on the CPU and a bfloat16/float16 CPU weight [out, in]; "
                            f"got x {dtype} ({rows}, 96) on cpu, weight torch.float32 (120, 96)")


def test_bound_linear_runs_the_widened_gemm_with_its_bias_and_keeps_f_linear_for_the_kernels():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 32, generator=g).to(torch.bfloat16), torch.randn(40, generator=g).to(torch.bfloat16)
    run = L.bind_linear(w, b, kernels=("gemv", "gemv", "widen"))
    for rows in (1, 8, 9, 64, 65, 200):
        x = torch.randn(rows, 32, generator=g).to(torch.bfloat16)
        if rows <= 8:  # the GEMV takes no bias: F.linear, exactly
            assert torch.equal(run(x), torch.nn.functional.linear(x, w, b)), rows
        else:
            want = ((x.double() @ w.double().t()).to(torch.bfloat16) + b).float()
            torch.testing.assert_close(run(x).float(), want, rtol=2 ** -7, atol=1e-2)


def test_half_gemm_choice_names_the_faster_and_float32_needs_none(tmp_path, monkeypatch):
    """The half GEMM choice on given timings (which path is faster on this machine is a benchmark's
    question): the faster one is named, and gemm_dtype follows it; float32 needs no choice."""
    from tpengine.backends.cpu import cpu_widen

    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    assert cpu_widen.gemm_dtype(torch.float32, None) == torch.float32
    for fake, want in (({"half": [100.0], "float32": [300.0]}, "half"), ({"half": [900.0], "float32": [300.0]},
                                                                          "float32")):
        monkeypatch.setattr(measured, "measure", lambda c, *_, fake=fake: {k: fake[k] for k in c})
        measured.cache_path().unlink(missing_ok=True)
        c = cpu_widen.gemm_choice(torch.bfloat16)
        assert (set(c.times_us), c.name, c.how) == ({"half", "float32"}, want, "measured")
        assert cpu_widen.gemm_dtype(torch.bfloat16, c) == (torch.float32 if want == "float32" else torch.bfloat16)
    assert cpu_widen.gemm_dtype(torch.bfloat16, None) == torch.bfloat16  # no choice: the dtype itself


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_gemv_equals_float32_matmul_rounded_once(rows):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(75, 96, generator=g) * 0.1).bfloat16()  # 75 rows: groups of 4 and a tail
    x = torch.randn(rows, 96, generator=g).bfloat16()
    got = cpu_gemv.gemv(x, w)
    want = (x.double() @ w.double().T)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 75)
    # one bfloat16 rounding of a float32 sum: within half an ulp of bf16 plus float32 sum error
    assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-6).all()
    with pytest.raises(ValueError, match=r"gemv: x \[\.\.\., 96\] with 1\.\.8 rows and a contiguous weight"):
        cpu_gemv.gemv(torch.zeros(9, 96, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"got x torch\.float32 \(2, 96\), weight torch\.bfloat16 \(75, 96\)$"):
        cpu_gemv.gemv(torch.zeros(2, 96), w)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_float32_gemv_equals_matmul(rows):
    """The float32 GEMV (16-lane FMA sums) equals a float64 product within float32 sum error,
    for 1..8 rows and an output count with a tail (75 = 18 groups of 4 + 3)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(75, 80, generator=g) * 0.1  # 80 = 5 steps of 16
    x = torch.randn(rows, 80, generator=g)
    got = cpu_gemv.gemv(x, w)
    want = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (rows, 75)
    assert ((got.double() - want).abs() <= (x.double().abs() @ w.double().abs().T) * 2 ** -20).all()
    assert cpu_gemv.available(w) and not cpu_gemv.available(torch.zeros(75, 72))  # 72 % 16


@needs_kernels
def test_linears_through_the_gemv_match_f_linear(tmp_path):
    """A bfloat16 model whose plain linears take the GEMV at <= 8 rows gives the logits of F.linear
    within bfloat16 rounding, and the layers hold their plain weights only."""
    model_dir = make_tiny_model(tmp_path, "llama", seed=1, hidden_size=64, intermediate_size=128)
    model = load_model(model_dir, TPInfo(0, 1, 0, torch.device("cpu")), torch.bfloat16, cpu_linear="plain").module
    linears = [m for n, m in model.named_modules() if hasattr(m, "pack") and not n.endswith("lm_head")]
    x = torch.randn(5, 64).bfloat16()
    plain = [m(x) for m in linears if m.in_features == 64]
    for m in linears:
        m.kernels = ("gemv", "gemv", "plain")
    via = [m(x) for m in linears if m.in_features == 64]
    for a, b in zip(via, plain):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    assert all(m.packed is None and m.weight is not None for m in linears)


def test_a_changed_kernel_build_is_measured_again(tmp_path, monkeypatch):
    """The timings name the C kernels' build: another build (a changed kernel source, compiler or
    flags) reads another file, so it is measured, not served the old kernel's timings."""
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_library, "library_key", lambda: "aaaa")
    path = measured.cache_path()  # the one timings file: the linear layouts', the quantized kernels', ...
    monkeypatch.setattr(cpu_library, "library_key", lambda: "bbbb")
    assert measured.cache_path() != path
    monkeypatch.setattr(cpu_library, "library_key", lambda: "aaaa")
    assert measured.cache_path() == path


@needs_gemm
@pytest.mark.parametrize("rows,n,k", [(64, 75, 80), (17, 30, 48), (130, 7, 33), (40, 24, 576), (1, 5, 3),
                                    (70, 1001, 96)])
def test_float32_gemm_equals_matmul_and_each_row_is_batch_independent(rows, n, k):
    """The float32 GEMM (cpu_gemm.c: one FMA chain over k per output) equals a float64 product within
    float32 sum error for every tail (weight rows not a multiple of the block, x rows not a multiple
    of 16 or past 64, odd k; the last, 1001 x 96, split between threads), and a row's output does not
    depend on the rows around it."""
    g = torch.Generator().manual_seed(rows + n)
    w = torch.randn(n, k, generator=g) * 0.1
    x = torch.randn(rows, k, generator=g)
    got = cpu_gemm.gemm(x, w)
    want = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert ((got.double() - want).abs() <= (x.double().abs() @ w.double().abs().T) * k * 2 ** -23).all()
    for lo, hi in ((0, 1), (rows // 2, rows), (rows - 1, rows)):
        assert torch.equal(cpu_gemm.gemm(x[lo:hi], w), got[lo:hi])
    assert torch.equal(cpu_gemm.gemm(x.view(1, rows, k), w), got.view(1, rows, n))  # leading dims
    kinds = "float32/bfloat16" if cpu_library.has("tpe_gemm_bf16") else "float32"
    with pytest.raises(ValueError, match=rf"gemm: x \[\.\.\., {k}\] on the CPU and a contiguous weight \[n, k\] of "
                                         rf"its dtype \({kinds} in this build\); got x torch\.bfloat16 \({rows}, "
                                         rf"{k}\) on cpu, weight torch\.float32 \({n}, {k}\)"):
        cpu_gemm.gemm(x.bfloat16(), w)
    assert cpu_gemm.available(w) and not cpu_gemm.available(w.t())
    assert cpu_gemm.available(w.bfloat16()) == cpu_library.has("tpe_gemm_bf16") == (cpu_library.isa() == "avx2")


@pytest.mark.skipif(not cpu_library.has("tpe_gemm_bf16"), reason=str(cpu_library.missing("tpe_gemm_bf16")))
@pytest.mark.parametrize("rows,n,k", [(64, 75, 80), (17, 30, 48), (130, 7, 33), (40, 24, 576), (1, 5, 3),
                                    (70, 1001, 96)])
def test_bfloat16_gemm_is_the_float32_gemm_of_the_widened_operands_rounded_once(rows, n, k):
    """The AVX2 build's bfloat16 GEMM (cpu_gemm.c: each block of 6 weight rows widened to float32,
    then the float32 micro-kernel) equals the float32 GEMM of the widened x and weight rounded once
    to bfloat16, bit for bit, for every tail (weight rows not a multiple of 6, x rows not a multiple
    of 16 or past 64, odd k); a row's output does not depend on the rows around it."""
    g = torch.Generator().manual_seed(rows * n)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    got = cpu_gemm.gemm(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.equal(got, cpu_gemm.gemm(x.float(), w.float()).bfloat16())
    for lo, hi in ((0, 1), (rows // 2, rows), (rows - 1, rows)):
        assert torch.equal(cpu_gemm.gemm(x[lo:hi], w), got[lo:hi])
    with pytest.raises(ValueError, match=r"got x torch\.float32 .* weight torch\.bfloat16"):
        cpu_gemm.gemm(x.float(), w)


@needs_kernels
@pytest.mark.parametrize("path", ["plain", "gemv", pytest.param("gemm", marks=needs_gemm)])
def test_each_forced_float32_path_gives_hf_tokens(tmp_path, path):
    """float32 greedy tokens equal HF's whichever plain path the linears and the tied LM head take,
    forced on every bucket (the GEMV up to 8 rows, the GEMM from 17), at 1 and at 24 sequences."""
    from transformers import AutoModelForCausalLM

    from tpengine.entrypoints.llm import LLM
    from tpengine.sampling_params import SamplingParams

    model_dir = make_tiny_model(tmp_path, "llama", seed=3, hidden_size=64, intermediate_size=128,
                                tie_word_embeddings=True)
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=24, cpu_linear="plain")
    model = llm.llm_engine.runner.model
    kernels = {"plain": ("plain",) * 3, "gemv": ("gemv", "gemv", "plain"), "gemm": ("plain", "plain", "gemm")}[path]
    mods = [m for m in model.modules() if hasattr(m, "pack")]
    assert len(mods) == 2 * 4 + 1  # 2 layers x (qkv, o, gate_up, down) and the tied head
    for m in mods:
        m.kernels = kernels
        m.bind(L.bind_layer(m, head=m is model.lm_head))  # the layer's implementation, bound again
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (24, 7), generator=g).tolist()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                                                ignore_eos=True))]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, 7:].tolist()
                for p in prompts]
    assert got == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_blocked_tied_head_holds_the_one_copy_and_decodes_the_plain_tokens(tmp_path, dtype):
    """``--cpu-linear blocked`` puts a tied head in the blocked layout (a SmolLM2-shaped tiny model:
    tied, vocabulary and hidden size multiples of 16): the head and the embedding hold no plain table, the
    embedding's rows gathered from the blocked one equal the plain rows bit for bit, the head's logits are the
    float32 product (bfloat16: rounded once; cpu_blocked's bounds), and greedy tokens at 1 and 6 sequences equal
    those of the same model with the head put back plain (F.linear and the greedy pick's measured paths); in
    float32 (AVX2 builds too), with every linear blocked, they are HF's ``generate``."""
    import torch.nn.functional as F

    from tpengine.backends.cpu import greedy as G
    from tpengine.entrypoints.llm import LLM
    from tpengine.sampling_params import SamplingParams

    if not cpu_blocked.available(torch.zeros(16, 2, dtype=dtype)):
        pytest.skip(f"no blocked {dtype} kernels in this build ({cpu_library.isa()})")
    model_dir = make_tiny_model(tmp_path, "llama", seed=5, vocab_size=1024, intermediate_size=128,
                                tie_word_embeddings=True)
    llm = LLM(str(model_dir), dtype=str(dtype).removeprefix("torch."), max_num_seqs=6, cpu_linear="blocked")
    model = llm.llm_engine.runner.model
    head, emb = model.lm_head, model.get_input_embeddings()
    assert cpu_blocked.is_blocked(head.packed) and head.weight is None and emb.weight is None
    assert all(cpu_blocked.is_blocked(m.packed) for m in model.modules() if hasattr(m, "pack"))
    plain = cpu_blocked.unpack(head.packed).contiguous()
    ids = torch.tensor([[0, 15, 16, 1023], [511, 7, 7, 640]])
    assert torch.equal(emb(ids), F.embedding(ids, plain))
    x = torch.randn(3, 64).to(dtype)
    exact = F.linear(x.double(), plain.double())
    bound = (exact.abs() * 2 ** -8 + 1e-3 * 64 ** 0.5 if dtype == torch.bfloat16
             else F.linear(x.abs().double(), plain.abs().double()) * 64 * 2 ** -24)
    assert ((head(x).double() - exact).abs() <= bound).all()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 1024, (6, 7), generator=g).tolist()
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def tokens():
        return ([o.outputs[0].token_ids for o in llm.generate(prompts[:1], sp)],
                [o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
    blocked = tokens()
    if dtype == torch.float32:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.inference_mode():
            want = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, 7:].tolist()
                    for p in prompts]
        assert blocked == (want[:1], want)
        return  # (the plain head's tokens are HF's in the tests above)
    head.packed, head.weight, emb.weight, emb.lookup = None, torch.nn.Parameter(plain, requires_grad=False), None, None
    emb.weight = head.weight
    head.bind(L.bind_layer(head, head=True))
    G.bind_head(head, dtype, True)
    assert tokens() == blocked


def test_a_model_that_runs_a_decode_program_is_chosen_for_as_a_whole(tmp_path, monkeypatch):
    """Issue 59: a float32 shape whose packed layout beat the GEMV by a few percent at one row, called from
    Python, cost the whole step its decode program (cpu_program: one C call, no Python between the
    kernels). For the program's shapes the GEMV's and blocked layout's one-row times are then taken as
    the program meets them (``*_program``); where every one of them then takes a C path at one row those
    choices stand, else every shape is chosen again on the loop's times. An untied head's shape, outside
    the program, keeps its loop times."""
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(L.cpu_blocked, "available", lambda w: False)
    qkv = {"plain": [200, 230, 590], "gemv": [105, 150, None], "gemm": [None, None, 370],
           "packed": [100, 125, 400], "gemv_program": [80, None, None]}
    down = {"plain": [260, 320, 800], "gemv": [150, 210, None], "gemm": [None, None, 560],
            "packed": [190, 190, 640], "gemv_program": [140, None, None]}
    fakes = {(960, 576): qkv, (576, 1536): down, (49152, 576): qkv}
    monkeypatch.setattr(L, "measure", lambda shape, *a: {k: list(v) for k, v in fakes[shape].items()})
    assert L.in_program(qkv) == {"plain": [200, 230, 590], "gemv": [80, 150, None], "gemm": [None, None, 370],
                                 "packed": [100, 125, 400]}
    assert L.pick(qkv) == "packed" and L.pick(L.in_program(qkv)) == "plain"  # 1 + 1.2 + 1 vs 1.25 + 1 + 1.08
    shapes = {(960, 576): 30, (576, 1536): 30, (49152, 576): 1}
    loop = L.choose_layouts(shapes, torch.float32)
    assert {s: c.layout for s, c in loop.items()} == {(960, 576): "packed", (576, 1536): "plain",
                                                     (49152, 576): "packed"}
    both = L.choose_layouts(shapes, torch.float32, program={(960, 576), (576, 1536)})
    assert {s: (c.layout, c.kernels) for s, c in both.items()} == {
        (960, 576): ("plain", ("gemv", "gemv", "gemm")), (576, 1536): ("plain", ("gemv", "gemv", "gemm")),
        (49152, 576): ("packed", ())}
    assert both[(960, 576)].times_us["gemv"][0] == 80 and "gemv_program" not in both[(960, 576)].times_us
    assert all(L.c_at_one_row(both[s].layout, both[s].kernels) for s in ((960, 576), (576, 1536)))
    # one program shape still faster packed with the program's times: no program, so the loop's choices
    fakes[(576, 1536)] = {**down, "gemv_program": [260, None, None], "gemv": [300, 210, None]}
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path / "b"))
    again = L.choose_layouts(shapes, torch.float32, program={(960, 576), (576, 1536)})
    assert {s: c.layout for s, c in again.items()} == {(960, 576): "packed", (576, 1536): "packed",
                                                      (49152, 576): "packed"}
    assert not L.c_at_one_row("packed", ()) and not L.c_at_one_row("plain", ("plain", "gemv", "gemm"))
    assert L.c_at_one_row("blocked", ())


@needs_kernels
def test_a_gemv_timed_in_a_decode_program_is_the_kernel_itself(monkeypatch):
    """cpu_program.one_row_us runs the bound GEMVs' own C calls (their ``c_spec``) as a program makes them,
    and measure() records it beside the Python-called timings; mixed shapes are refused by name."""
    from tpengine.backends.cpu import cpu_program

    if not cpu_program.runs():
        pytest.skip("no C program runner in this build")
    ws = [torch.full((32, 64), 0.01 * (i + 1)) for i in range(3)]
    calls = []
    monkeypatch.setattr(measured, "time_us", lambda fns, *a, **k: calls.extend(f() for f in fns) or 30.0)
    assert cpu_program.one_row_us([cpu_gemv.bind(w).c_spec for w in ws], torch.float32) == 30.0
    assert calls == [-1] * 3  # a program of one op per weight, each run whole (tpe_program_run's "all done")
    with pytest.raises(ValueError, match=r"^cpu program timing: need one-row product calls of one kind and shape"):
        cpu_program.one_row_us([cpu_gemv.bind(ws[0]).c_spec, cpu_gemv.bind(torch.zeros(16, 64)).c_spec],
                               torch.float32)
    monkeypatch.undo()
    times = L.measure((32, 64), 2, torch.float32)
    assert len(times["gemv_program"]) == len(L.ROW_BUCKETS) and times["gemv_program"][0] > 0
    assert times["gemv_program"][1:] == [None] * (len(L.ROW_BUCKETS) - 1)
