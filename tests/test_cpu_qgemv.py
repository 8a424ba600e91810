"""tpengine's int8 / int4 weight-only kernels (tpengine/backends/cpu/csrc/cpu_qgemv.c): the few-row GEMVs and
the int4 dequantization and row lookup, against the dequantized reference, on the storage the quantized layers
hold, in float32 and bfloat16, including a last int4 block of fewer than 64 rows and rows padded
to 16; the measured choice between them and torch's kernels."""

from __future__ import annotations

import pytest
import torch

from tpengine.backends.cpu import cpu_library, cpu_qgemv, measured, qgemv_choice
from tpengine.model.quant.apply import quantize_weight
from tpengine.model.quant.arith import _int4_values, int4_pack_layout
from tpengine.model.quant.weights import Int4Weight, Int8Weight, QuantScheme

# measured choices are among this module's subjects: no measuring budget (conftest's default is 0: nothing
# measured)
pytestmark = pytest.mark.usefixtures("measuring")

# the kernels' tests; the int4-with-codes storage and torch's kernel on it run on every machine
needs_kernels = pytest.mark.skipif(cpu_library.missing(*cpu_qgemv.KERNELS) is not None,
                                   reason=str(cpu_library.missing(*cpu_qgemv.KERNELS)))
needs_int4 = pytest.mark.skipif(cpu_library.missing(*cpu_qgemv.INT4_KERNELS) is not None,
                                reason=str(cpu_library.missing(*cpu_qgemv.INT4_KERNELS)))
#: int4z: int4 with int8 zero codes (--quantization int4's); int4: float zeros (GGUF Q4_1's)
SCHEMES = [("int8", None), ("int8", 32), ("int4", 32), ("int4", 128), ("int4z", 32), ("int4z", 128)]
#: 472: 7 blocks of 64 and a last one of 24 (padded to 32); in torch's AVX2 layout 15 blocks of 32 (the
#: last one alone, not in a pair); 104 (padded to 112): one block of 64 and one of 48, or 3 of 32 and one of 16
SHAPES = [(960, 256), (472, 256), (80, 128), (104, 128)]


def weight(name, group, shape, dtype, seed=0):
    """A quantized weight given the C kernels, as the CPU platform binds it."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05
    scheme = QuantScheme("int4", group, zero_codes=True) if name == "int4z" else QuantScheme(name, group)
    q = quantize_weight(w, scheme, dtype)
    q.set_kernels(cpu_qgemv)
    return q


@pytest.fixture(autouse=True)
def quiet_start(monkeypatch):
    """The machine counts as quiet when a measurement starts (measured.probe_busy), whatever else runs
    beside the tests."""
    monkeypatch.setattr(measured, "probe_busy", lambda: False)


def bound(x, q):
    """|x| @ |w|.T: the scale of a product's float32 rounding error."""
    return x.double().abs() @ q.dequantize().double().abs().T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name, group", SCHEMES)
@pytest.mark.parametrize("shape", SHAPES)
def test_few_rows_equal_the_dequantized_product(name, group, shape, dtype):
    # int8 per channel: the int8 kernel; grouped int8 (two int4 products) and int4: the int4 ones
    why = cpu_library.missing(*(cpu_qgemv.INT8_KERNELS if name == "int8" and group is None else cpu_qgemv.INT4_KERNELS))
    if why:
        pytest.skip(why)
    q = weight(name, group, shape, dtype)
    assert q.kernels_take
    for rows in (1, 2, 3, 5, 8):
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
        want = x.double() @ q.dequantize().double().T
        q.gemv_rows = 8
        got = q(x)
        assert got.dtype == dtype and got.shape == (rows, shape[0])
        # float32 sums; bfloat16: each output rounded once (grouped int8: two int4 products, each
        # rounded at its own magnitude, up to |x| @ |w|, then added)
        tol = bound(x, q) * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -18)
        assert ((got.double() - want).abs() <= tol + 1e-30).all(), (rows, (got.double() - want).abs().max())
        if q.gemv_rows and not (name == "int8" and group):
            assert torch.equal(q.bind()(x.contiguous()), got)  # the decode program's bound call


@needs_int4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["int4", "int4z"])
def test_int4_dequantize_is_the_stored_weight_transposed(name, shape, dtype):
    q = weight(name, 32, shape, dtype)
    if name == "int4z":
        wt, n_pad = cpu_qgemv.dequant_int4(q.packed, q.scales, 32, q.zero_codes), q.scales.shape[1]
    else:
        wt, n_pad = cpu_qgemv.dequant_int4(q.packed, q.scales_and_zeros, 32), q.scales_and_zeros.shape[1]
    assert wt.shape == (shape[1], n_pad) and wt.dtype == dtype
    want = q.dequantize()  # float32 (q - 8) * scale + zero
    got = wt[:, : shape[0]].T.double()
    # float32: q * scale + (zero - 8 scale) in one fused multiply-add, a few ulps of the weight's range
    # from (q - 8) * scale + zero; bfloat16: that, rounded once
    tol = (want.double().abs() * 2 ** -8 if dtype == torch.bfloat16 else 0) + want.abs().max().item() * 2 ** -21
    assert ((got - want.double()).abs() <= tol).all()
    x = torch.randn(70, shape[1], generator=torch.Generator().manual_seed(2)).to(dtype)
    q.gemv_rows, q.dequant_rows = 0, 64  # 70 rows: dequantize + one GEMM
    torch.testing.assert_close(q(x).float(), (x.float() @ want.T), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def pack_int4(q: torch.Tensor, block: int) -> torch.Tensor:
    """``q [n_pad, k]`` (0..15) in torch's packed layout of ``block``-row blocks (64: its AVX-512
    code's, 32: its AVX2 code's): column by column, row ``j`` of a block in the low nibble of byte ``j``
    and row ``j + block / 2`` in its high one; a last block of ``nb`` rows with rows ``2j`` and
    ``2j + 1`` in byte ``j``."""
    n_pad, k = q.shape
    full, parts = n_pad // block * block, []
    for b in range(0, full, block):
        blk = q[b:b + block].T  # [k, block]
        parts.append(blk[:, : block // 2] | blk[:, block // 2:] << 4)
    if full < n_pad:
        tail = q[full:].T
        parts.append(tail[:, 0::2] | tail[:, 1::2] << 4)
    return torch.cat([p.reshape(-1) for p in parts]).to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["int4", "int4z"])
def test_int4_kernels_read_the_other_layout(name, shape, dtype, monkeypatch):
    """An AVX2 build reads torch's packed int4 layout of either CPU capability: 64-row blocks (an AVX-512
    CPU without AVX512-BF16 runs the AVX2 path on them) and 32-row ones (an AVX2 CPU's). The weight is
    repacked in the layout torch does not pack here and read as if torch did: the GEMV at 1..8 rows
    and the dequantization give the same results as on torch's own packing, the rows' lookup too."""
    here = cpu_qgemv.torch_int4_block()
    assert here == int4_pack_layout(96).block  # the backend's probe agrees with the full layout's
    other = {64: 32, 32: 64}[here]
    if other not in cpu_qgemv.int4_blocks():
        pytest.skip(f"this build ({cpu_library.isa()}) reads int4 blocks of "
                    f"{', '.join(map(str, cpu_qgemv.int4_blocks())) or 'no'} rows")
    q = weight(name, 32, shape, dtype)
    scales, codes = (q.scales, q.zero_codes) if name == "int4z" else (q.scales_and_zeros, None)
    n_pad, k = scales.shape[1], shape[1]
    values = _int4_values(q.packed, int4_pack_layout(n_pad), torch.arange(n_pad), k)
    assert torch.equal(pack_int4(values, here), q.packed.reshape(-1))  # the layout as torch packs it here
    repacked = pack_int4(values, other).reshape(q.packed.shape)
    mine = [cpu_qgemv.dequant_int4(q.packed, scales, 32, codes)]
    xs = [torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype) for rows in range(1, 9)]
    mine += [cpu_qgemv.int4(x, q.packed, scales, 32, shape[0], codes) for x in xs]
    rows = cpu_qgemv.int4_rows(q.packed, scales, 32, torch.arange(n_pad), codes)
    monkeypatch.setattr(cpu_qgemv, "torch_int4_block", lambda: other)
    theirs = [cpu_qgemv.dequant_int4(repacked, scales, 32, codes)]
    theirs += [cpu_qgemv.int4(x, repacked, scales, 32, shape[0], codes) for x in xs]
    assert torch.equal(mine[0], theirs[0])  # element by element, the same arithmetic
    assert torch.equal(cpu_qgemv.int4_rows(repacked, scales, 32, torch.arange(n_pad), codes), rows)
    want = q.dequantize().double()
    for x, a, b in zip(xs, mine[1:], theirs[1:]):  # the sums in another order, well within the bound
        tol = bound(x, q) * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -18)
        assert ((b.double() - x.double() @ want.T).abs() <= tol + 1e-30).all(), x.shape[0]
        assert ((a.double() - b.double()).abs() <= tol + 1e-30).all(), x.shape[0]


@needs_int4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["int4", "int4z"])
def test_int4_rows_are_the_torch_lookup_bit_for_bit(name, shape, dtype):
    """An embedding lookup in an int4 vocabulary (``rows``): the C kernel gives, bit for bit, what the
    torch ops give (the product rounded before the zero is added), for ids in every block, the last,
    shorter block and the padding rows, in any shape of ids; an id outside the rows is refused by name."""
    q = weight(name, 32, shape, dtype)
    n_pad = q.packed.shape[0]
    ids = torch.tensor([[0, 1, 31, 32], [33, 63, 64, shape[0] - 1], [n_pad - 1, n_pad - 2, shape[0] - 2, 5]])
    want = q._rows_f32(ids.reshape(-1)).to(dtype).reshape(3, 4, shape[1])
    assert q.kernels_take
    got = q.rows(ids)
    assert got.dtype == dtype and got.shape == (3, 4, shape[1]) and torch.equal(got, want)
    assert torch.equal(q.rows(torch.arange(n_pad)), q._rows_f32(torch.arange(n_pad)).to(dtype))
    assert torch.equal(q.rows(ids.int()), want)  # int32 ids, as F.embedding takes them
    scales, codes = (q.scales, q.zero_codes) if name == "int4z" else (q.scales_and_zeros, None)
    with pytest.raises(IndexError) as e:
        cpu_qgemv.int4_rows(q.packed, scales, 32, torch.tensor([3, n_pad]), codes)
    assert str(e.value) == f"int4 rows: id {n_pad} is outside the weight's rows 0..{n_pad - 1}"
    assert "_rows_run" in q.__dict__  # the lookups above ran bound: a decode step's one id too
    assert torch.equal(q.rows(torch.tensor([shape[0] - 1])), want[1, 3:])
    with pytest.raises(IndexError) as bound:
        q.rows(torch.tensor([3, n_pad]))
    assert str(bound.value) == str(e.value)


@needs_kernels
def test_layout_check_and_argument_errors():
    assert cpu_qgemv.int4_layout_ok(int4_pack_layout(472 + 8))  # 480 rows: 7 blocks of 64, one of 32
    q8, q4 = weight("int8", None, (64, 128), torch.float32), weight("int4", 32, (64, 128), torch.float32)
    with pytest.raises(ValueError, match=r"^qgemv int8: x must be bfloat16 or float32 \[\.\.\., 128\] with 1\.\.8 "):
        cpu_qgemv.int8(torch.zeros(9, 128), q8.qweight, q8.scales)
    with pytest.raises(ValueError, match=r"^qgemv int8: need a contiguous int8 \[n, 128\] weight and \[n\] scales in "
                                         r"torch\.bfloat16"):
        cpu_qgemv.int8(torch.zeros(1, 128, dtype=torch.bfloat16), q8.qweight, q8.scales)
    with pytest.raises(ValueError, match=r"^qgemv int4: need uint8 packed \[64, 64\]"):
        cpu_qgemv.int4(torch.zeros(1, 128), q4.packed, q4.scales_and_zeros, 32, 65)
    z = weight("int4z", 32, (64, 128), torch.float32)
    with pytest.raises(ValueError) as e:
        cpu_qgemv.int4(torch.zeros(1, 128), z.packed, z.scales, 32, 64, z.zero_codes[:, :32].contiguous())
    assert str(e.value) == ("qgemv int4: with zero codes, scales must be [groups, n_pad] and zero_codes a contiguous "
                            "int8 tensor of that shape; got scales (4, 64), zero_codes torch.int8 (4, 32)")
    with pytest.raises(ValueError, match=r"^dequant int4: scales_and_zeros must be \[groups, n_pad, 2\]; got "
                                         r"\(4, 64\)$"):
        cpu_qgemv.dequant_int4(z.packed, z.scales, 32)
    assert qgemv_choice.gemv_rows([10, 20, 30], [5, 25, 10]) == 1
    assert qgemv_choice.gemv_rows([10, 20, 30], [11, 1, 1]) == 0
    assert qgemv_choice.gemv_rows([10, 20, 30], [9, 19, 29]) == 8
    # the int4 x int8 kernel: up to the buckets where it beat the float kernel, within gemv_rows
    times = {"torch": [10, 20, 30], "tpengine": [5, 10, 15], "tpengine_q8": [4, 12, 1]}
    kernel_us = qgemv_choice._kernel_us(times)
    assert (qgemv_choice.q8_rows(times), qgemv_choice.gemv_rows(times["torch"], kernel_us)) == (1, 8)
    times = {"torch": [10, 20, 30], "tpengine": [50, 50, 50], "tpengine_q8": [4, 12, 31]}
    assert (qgemv_choice.q8_rows(times), qgemv_choice.rows_of(times)[0]) == (4, 4)
    assert qgemv_choice.q8_rows({"torch": [10, 20, 30], "tpengine": [5, 10, 15]}) == 0


@needs_kernels
def test_choose_sets_every_weight_of_a_shape():
    mods = [weight("int4", 32, (192, 128), torch.bfloat16, seed=i) for i in range(3)]
    per_channel = [weight("int8", None, (192, 128), torch.bfloat16, seed=i) for i in range(2)]
    chosen = qgemv_choice.choose({"int4 g32 128->192": mods, "int8 per channel 128->192": per_channel})
    for key, group in (("int4 g32 128->192", mods), ("int8 per channel 128->192", per_channel)):
        c = chosen[key]
        assert len(c["torch"]) == len(c["tpengine"]) == 3 and len(c["prefill_torch"]) == 2
        assert c["gemv_rows"] == qgemv_choice.gemv_rows(c["torch"], qgemv_choice._kernel_us(c))
        assert c["dequant_rows"] in (0, 64, 512)
        assert c["q8_rows"] == qgemv_choice.q8_rows(c) <= c["gemv_rows"]
        # bfloat16 int4 and per-channel int8: the int8-activation kernels
        assert ("tpengine_q8" in c) == cpu_library.has(*(cpu_qgemv.INT4_Q8_KERNELS if group is mods
                                                         else cpu_qgemv.INT8_Q8_KERNELS))
        assert {(m.gemv_rows, m.dequant_rows, m.q8_rows) for m in group} == {(c["gemv_rows"], c["dequant_rows"],
                                                                             c["q8_rows"])}
    line = qgemv_choice.summary(chosen)
    assert line.startswith("int4 g32 128->192 ") and "; int8 per channel 128->192 " in line
    assert " at 1/4/8 rows)" in line and " at 64/512 rows)" in line
    assert isinstance(mods[0], Int4Weight) and isinstance(per_channel[0], Int8Weight)


@needs_kernels
def test_cached_choices_are_reused_and_bad_entries_measured_again(tmp_path, monkeypatch):
    """The first measurement of a shape is cached per rank and reused by the next load; an entry
    someone broke is measured again (never a crash at load)."""
    import json

    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    # the timings are stubbed (two agreeing measurements), so the test does not depend on how busy
    # the machine is; test_choose_sets_every_weight_of_a_shape times the real kernels
    calls = []

    def measure(mods, dequant_dtype=None):
        calls.append(len(mods))
        return {"torch": [10.0, 20.0, 30.0], "tpengine": [5.0, 25.0 if len(calls) % 2 else 21.0, 40.0],
                "prefill_torch": [900.0, 7000.0], "prefill_dequant": [950.0, 1500.0]}
    monkeypatch.setattr(qgemv_choice, "_measure", measure)
    monkeypatch.setattr(measured, "Contention", _Quiet)
    mods = [weight("int4", 32, (96, 64), torch.float32, seed=i) for i in range(2)]
    first = qgemv_choice.choose({"int4 g32 64->96": mods}, rank=1)
    assert first["int4 g32 64->96"]["how"] == "measured" and calls == [2, 2]
    assert first["int4 g32 64->96"]["tpengine"] == [5.0, 21.0, 40.0]  # the faster of the two per bucket
    assert (first["int4 g32 64->96"]["gemv_rows"], first["int4 g32 64->96"]["dequant_rows"]) == (1, 512)
    assert {(m.gemv_rows, m.dequant_rows) for m in mods} == {(1, 512)}
    path = measured.cache_path()
    cached = json.loads(path.read_text())
    assert list(cached) == ["quant float32 int4 g32 64->96 rank 1"]
    again = qgemv_choice.choose({"int4 g32 64->96": mods}, rank=1)["int4 g32 64->96"]
    assert again["how"] == "cached" and again["torch"] == first["int4 g32 64->96"]["torch"]
    path.write_text(json.dumps({"quant float32 int4 g32 64->96 rank 1": {"torch": ["x", 1, 2], "tpengine": [1, 2, 3]}}))
    assert qgemv_choice.choose({"int4 g32 64->96": mods}, rank=1)["int4 g32 64->96"]["how"] == "measured"
    assert qgemv_choice.choose({"int4 g32 64->96": mods}, rank=1)["int4 g32 64->96"]["how"] == "cached"  # replaced
    path.write_text("not json")
    assert qgemv_choice.choose({"int4 g32 64->96": mods}, rank=1)["int4 g32 64->96"]["how"] == "measured"


def test_in_program_takes_the_c_kernels_one_row_times_in_a_program():
    """in_program: the C kernels' one-row times as a decode program makes them replace their bound calls' at
    one row; the other buckets, torch's times and timings without program times stay as they are."""
    times = {"torch": [20.0, 40.0, 60.0], "tpengine": [25.0, 30.0, 50.0], "tpengine_q8": [22.0, 28.0, 45.0],
             "tpengine_program": [19.0], "tpengine_q8_program": [15.0], "prefill_torch": [1.0, 2.0]}
    prog = qgemv_choice.in_program(times)
    assert prog == {"torch": [20.0, 40.0, 60.0], "tpengine": [19.0, 30.0, 50.0], "tpengine_q8": [15.0, 28.0, 45.0],
                    "prefill_torch": [1.0, 2.0]}
    assert qgemv_choice.rows_of(times)[::2] == (0, 0) and qgemv_choice.rows_of(prog)[::2] == (8, 8)
    assert qgemv_choice._decision(times) == (qgemv_choice.rows_of(times), qgemv_choice.rows_of(prog))
    plain = {"torch": [20.0, 40.0, 60.0], "tpengine": [25.0, 30.0, 50.0]}
    assert qgemv_choice.in_program(plain) == plain


@needs_kernels
@pytest.mark.parametrize("kind, group", [("int8", None), ("int4", 32)], ids=["int8", "int4"])
def test_a_program_product_is_also_timed_as_the_program_calls_it(kind, group):
    """_measure(program=True): each C path's one-row call also timed as a decode program makes it
    (cpu_program.one_row_us of the bound calls' c_spec: "q8" / "q4" ops), one time each; without ``program``
    none; one_row_us refuses calls of two kinds."""
    from tpengine.backends.cpu import cpu_program

    if not cpu_program.runs():
        pytest.skip("no C program runner in this build")
    mods = [weight(kind, group, (96, 64), torch.bfloat16, seed=i) for i in range(2)]
    for m in mods:
        m.set_kernels(cpu_qgemv)
    times = qgemv_choice._measure(mods, program=True)
    q8 = cpu_qgemv.q8_takes(mods[0])
    assert sorted(k for k in times if k.endswith("_program")) == ["tpengine_program"] + (
        ["tpengine_q8_program"] if q8 else [])
    assert all(len(times[k]) == 1 and times[k][0] > 0 for k in times if k.endswith("_program"))
    assert qgemv_choice._valid(times) and not any(k.endswith("_program") for k in qgemv_choice._measure(mods))
    m = mods[0]
    m.gemv_rows, m.q8_rows = 8, 0
    spec = m.bind().c_spec
    assert spec[0] == ("q8" if kind == "int8" else "q4") and cpu_program.product_shape(spec) == (96, 64)
    with pytest.raises(ValueError, match=r"^cpu program timing: need one-row product calls of one kind and shape"):
        cpu_program.one_row_us([spec, cpu_gemv_spec()], torch.bfloat16)


def cpu_gemv_spec() -> tuple:
    """A float32 GEMV's one-row call (a "lin" op) of a 96 x 64 weight."""
    from tpengine.backends.cpu import cpu_gemv

    return cpu_gemv.bind(torch.zeros(96, 64)).c_spec


def _choose_program(tmp_path, monkeypatch, times: dict[str, dict], program: set[str]) -> tuple[dict, list]:
    """qgemv_choice.choose of stand-in weights, one group per key of ``times`` (each group's stubbed timings, two
    agreeing measurements), ``program`` the keys a decode program multiplies by: ``(chosen, [(key, whether its
    program times were asked for)] of the groups measured)``."""
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measured, "Contention", _Quiet)
    monkeypatch.setattr(measured, "probe_busy", lambda: False)
    asked = []

    def measure(mods, dequant_dtype=None, program=False):
        asked.append((mods[0].key, program))
        return {k: v for k, v in times[mods[0].key].items() if program or not k.endswith("_program")}
    monkeypatch.setattr(qgemv_choice, "_measure", measure)

    class Mod:
        dtype, gemv_rows, dequant_rows, q8_rows = torch.bfloat16, 0, 0, 0

        def __init__(self, key):
            self.key, self.group_size = key, 32 if key.startswith("int8 g32 ") else None  # (grouped int8)
    groups = {k: [Mod(k), Mod(k)] for k in times}
    chosen = qgemv_choice.choose(groups, program=program)
    for k, group in groups.items():
        assert {m.gemv_rows for m in group} == {chosen[k]["gemv_rows"]}
    return chosen, sorted(set(asked))


def test_the_quantized_choice_is_made_for_the_whole_program(tmp_path, monkeypatch):
    """The groups a decode program multiplies by are chosen together: on their one-row times in a program
    (the C call alone), torch's kernel loses 576->576 at one row, so every product has a C call and the
    program runs: those choices stand (an untied head's group, not in the program, keeps its loop times);
    where torch's kernel still wins one product in the program's terms, no program runs and every group is
    chosen on the loop's times."""
    loop_loses = {"torch": [20.0, 40.0, 60.0], "tpengine": [22.0, 30.0, 50.0], "tpengine_program": [17.0]}
    wins = {"torch": [50.0, 90.0, 130.0], "tpengine": [30.0, 60.0, 90.0], "tpengine_program": [28.0]}
    head = {"torch": [20.0, 40.0, 60.0], "tpengine": [22.0, 30.0, 50.0]}
    times = {"int8 per channel 576->576": loop_loses, "int8 per channel 576->3072": wins,
             "int8 per channel 576->49152": head}
    program = {"int8 per channel 576->576", "int8 per channel 576->3072"}
    chosen, asked = _choose_program(tmp_path / "a", monkeypatch, times, program)
    assert asked == sorted((k, k in program) for k in times)  # program times only for the program's products
    assert {k: c["gemv_rows"] for k, c in chosen.items()} == {
        "int8 per channel 576->576": 8, "int8 per channel 576->3072": 8, "int8 per channel 576->49152": 0}
    assert chosen["int8 per channel 576->576"]["tpengine_program"] == [17.0]
    assert "in a decode program 17 us at 1 row" in qgemv_choice.summary(chosen)
    # torch's kernel faster at one row even against the program's call: no program, the loop's times decide
    times["int8 per channel 576->576"] = {**loop_loses, "tpengine_program": [21.0]}
    chosen, _ = _choose_program(tmp_path / "b", monkeypatch, times, program)
    assert {k: c["gemv_rows"] for k, c in chosen.items()} == {
        "int8 per channel 576->576": 0, "int8 per channel 576->3072": 8, "int8 per channel 576->49152": 0}
    chosen, asked = _choose_program(tmp_path / "b", monkeypatch, times, program)
    assert asked == [] and all(c["how"] == "cached" for c in chosen.values())
    # timings cached without the program times (a load whose model took no program) serve the loop only: a
    # program's products are measured again
    _choose_program(tmp_path / "c", monkeypatch, times, set())
    chosen, asked = _choose_program(tmp_path / "c", monkeypatch, times, {"int8 per channel 576->576"})
    assert asked == [("int8 per channel 576->576", True)] and chosen["int8 per channel 576->576"]["how"] == "measured"
    # a grouped int8 product (two int4 products in Python: no C call at one row) means no program: loop times
    times["int8 g32 576->960"], times["int8 per channel 576->576"] = head, loop_loses  # (8 rows in a program)
    chosen, asked = _choose_program(tmp_path / "d", monkeypatch, times, program | {"int8 g32 576->960"})
    assert asked == sorted((k, False) for k in times) and chosen["int8 per channel 576->576"]["gemv_rows"] == 0


class _Quiet:
    """A stand-in for :class:`~tpengine.backends.cpu.measured.Contention` on a quiet machine."""
    busy = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_disagreeing_measurements_are_used_once_and_not_cached(tmp_path, monkeypatch):
    """Two measurements that choose differently (a time slice lost to another process: 31 us at 4 rows
    puts the kernels behind torch's there) and a third with a choice of its own (41 us at 8 rows): the
    first one is used for this load and nothing is cached, so the next load measures again. A third that
    sides with the first: those two cached (measured_choice_is_cached covers two that agree)."""
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    slow = iter([{"torch": [10.0, 20.0, 30.0], "tpengine": [5.0, 10.0, 15.0]},
                 {"torch": [10.0, 20.0, 30.0], "tpengine": [5.0, 31.0, 15.0]},
                 {"torch": [10.0, 20.0, 30.0], "tpengine": [5.0, 10.0, 41.0]}])
    monkeypatch.setattr(qgemv_choice, "_measure", lambda mods, dt=None: next(slow))
    monkeypatch.setattr(measured, "Contention", _Quiet)

    class Mod:
        dtype, gemv_rows, dequant_rows = torch.float32, 0, 0
    mods = [Mod(), Mod()]
    got = qgemv_choice.choose({"int4 g32 64->96": mods}, rank=0)["int4 g32 64->96"]
    assert got["how"] == "measured, noisy (not cached)" and got["tpengine"] == [5.0, 10.0, 15.0]
    assert (got["gemv_rows"], got["dequant_rows"]) == (8, 0) and {m.gemv_rows for m in mods} == {8}
    assert not measured.cache_path().exists()
    slow = iter([{"torch": [10.0, 20.0, 30.0], "tpengine": [5.0, 10.0, 15.0]},
                 {"torch": [10.0, 20.0, 30.0], "tpengine": [5.0, 31.0, 15.0]},
                 {"torch": [10.0, 20.0, 30.0], "tpengine": [4.0, 12.0, 15.0]}])
    got = qgemv_choice.choose({"int4 g32 64->96": mods}, rank=0)["int4 g32 64->96"]
    assert got["how"] == "measured" and got["tpengine"] == [4.0, 10.0, 15.0] and got["gemv_rows"] == 8
    assert next(slow, None) is None and measured.cache_path().exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_coded_int4_every_path_is_the_stored_weight(dtype):
    """int4 with int8 zero codes: ``dequantize()`` is :func:`dequantize_int4_coded` of what
    :func:`quantize_int4_coded` stores; tpengine's GEMV (8 rows), torch's kernel (its scales and zeros
    built per call) and dequantize + GEMM all give that weight's product; an all-zero group is stored
    as 0 (scale and code 0) and stays exactly 0; a group without 0 in its range is widened to take it in."""
    from tpengine.model.quant.arith import dequantize_int4_coded, quantize_int4_coded

    w = torch.randn(80, 128, generator=torch.Generator().manual_seed(7)) * 0.05
    w[3] = 0.0
    w[5, :32] = torch.linspace(1.0, 2.0, 32)  # no 0 in the range: widened to [0, 2]
    q = quantize_weight(w, QuantScheme("int4", 32, zero_codes=True), dtype)
    q.set_kernels(cpu_qgemv)
    ref = dequantize_int4_coded(*quantize_int4_coded(w, 32, dtype), 32)
    assert torch.equal(q.dequantize(), ref) and not ref[3].any()
    assert not q.scales[:, 3].any() and not q.zero_codes[:, 3].any()
    step = float(q.scales[0, 5])  # min/max: 2 / 15; the error search may narrow or widen it a little
    assert step == pytest.approx(2.0 / 15, rel=0.05) and float((ref[5, :32] - w[5, :32]).abs().max()) <= step / 2
    assert float(quantize_int4_coded(w, 32, dtype, search=False)[1][0, 5]) == pytest.approx(2.0 / 15, rel=2 ** -7)
    assert q.nbytes == 80 * 128 // 2 + 4 * 80 * (dtype.itemsize + 1)  # half a byte a weight, a scale and a code a group
    paths = ((8, (8, 0)), (8, (0, 0)), (70, (0, 64)), (70, (0, 0)))
    if not cpu_qgemv.kernels_built(int4=True):  # no int4 C kernels: torch's kernel only, no GEMV or dequantization
        paths = tuple(p for p in paths if p[1] == (0, 0))
    for rows, (gemv, deq) in paths:
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(dtype)
        q.gemv_rows, q.dequant_rows = gemv, deq
        want = x.double() @ ref.double().T
        tol = bound(x, q) * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -18)
        assert ((q(x).double() - want).abs() <= tol + 1e-30).all(), (rows, gemv, deq)


def q8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 x int8 kernel's activations, in float32 as the C code computes them: per row and block of
    32 columns ``d = max |x| / 127`` and ``xq = round(x * (127 / max |x|))`` (ties to even); ``(d * xq,
    d)``, both ``[rows, k]`` (d repeated over its block)."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    xq = torch.round(xb * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    d = (amax / 127).expand_as(xb)
    return (xq * d).reshape(x.shape), d.reshape(x.shape)


def int4_q8_of(q, x: torch.Tensor) -> torch.Tensor:
    """The int4 x int8 kernel's product of ``x`` with the int4 weight ``q``."""
    scales, codes = (q.scales, q.zero_codes) if hasattr(q, "zero_codes") else (q.scales_and_zeros, None)
    return cpu_qgemv.int4(x.contiguous(), q.packed, scales, q.group_size, q.out_features, codes, act_int8=True)


@pytest.mark.skipif(cpu_library.missing(*cpu_qgemv.INT4_Q8_KERNELS) is not None,
                    reason=str(cpu_library.missing(*cpu_qgemv.INT4_Q8_KERNELS)))
def test_int4_q8_is_the_product_of_the_int8_activations(monkeypatch):
    """The int4 x int8 kernel (``act_int8``), int4 with float zeros and zero codes, groups of 32 and
    128, every row count, a last block of fewer than 64 rows: (1) it is the product of the activations
    as quantized to int8 per 32 (``q8_activations``) with the stored weight, to float32's rounding of
    its folds; (2) its error against the float product is within the activations' rounding, per output
    ``sum_i d_i / 2 * |w_i|`` (the stated bound), and in norm under 1 % on these normal activations;
    (3) the forward and the bound call take it up to ``q8_rows``; (4) where the build reads torch's other
    int4 layout, it gives the same results bit for bit on it; (5) under a column split (tp: each rank's
    rows) it gives each rank's outputs bit for bit, and under a row split on a group boundary the ranks'
    partial products sum to it (the same blocks of 32: the same int8 activations). bfloat16: the
    activations the engine gives it (``cpu_qgemv.q8_takes``)."""
    dtype = torch.bfloat16
    here = cpu_qgemv.torch_int4_block()
    other = {64: 32, 32: 64}[here]
    for (name, group), shape in [(("int4z", 32), (472, 256)), (("int4", 32), (192, 256)),
                                 (("int4z", 128), (104, 256)), (("int4", 128), (80, 256))]:
        q = weight(name, group, shape, dtype)
        # tp: each rank's weight is quantized from its float slice (row by row, group by group: the full
        # weight's values): a column split's rank 0 (rows 0..63, a whole block), a row split's two halves
        scheme, half = QuantScheme("int4", group, zero_codes=name == "int4z"), shape[1] // 2
        wf = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.05  # weight()'s
        col_part = quantize_weight(wf[:64], scheme, dtype)
        row_parts = [quantize_weight(wf[:, a:a + half], scheme, dtype) for a in (0, half)]
        scales, codes = (q.scales, q.zero_codes) if name == "int4z" else (q.scales_and_zeros, None)
        w = q.dequantize().double()
        for rows in (1, 3, 8):
            x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
            x[0, 5] = 40.0  # an outlier: its block's other values keep fewer bits
            got = cpu_qgemv.int4(x, q.packed, scales, group, shape[0], codes, act_int8=True)
            assert got.dtype == dtype and got.shape == (rows, shape[0])
            xd, d = q8_activations(x)
            want = xd.double() @ w.T
            # the folds s * (d * sum q xq) + (z - 8 s) * d * sum xq in float32, terms up to 16x |x| @ |w|; a
            # wrong row, scale or block is off by about |x| @ |w|
            tol = bound(xd, q) * 2 ** -14 + (want.abs() * 2 ** -8 if dtype == torch.bfloat16 else 0)
            assert ((got.double() - want).abs() <= tol + 1e-30).all(), (name, shape, rows)
            exact = x.double() @ w.T
            stated = (d.double() / 2) @ w.abs().T
            assert ((got.double() - exact).abs() <= stated + tol + 1e-30).all(), (name, shape, rows)
            err = ((got.double() - exact).norm(dim=1) / exact.norm(dim=1)).tolist()
            assert err[0] < 0.05 and all(e < 0.01 for e in err[1:]), (name, shape, rows, err)  # row 0: the outlier
            q.gemv_rows, q.q8_rows = 8, rows
            assert torch.equal(q(x), got) and torch.equal(q.bind()(x.contiguous()), got)
            q.q8_rows = rows - 1  # one row more than q8_rows: the float kernel
            assert torch.equal(q(x), cpu_qgemv.int4(x, q.packed, scales, group, shape[0], codes))
            # tp: a column split gives a rank's outputs bit for bit; a row split at a group boundary the
            # partial products that sum to the product
            assert torch.equal(int4_q8_of(col_part, x), got[:, :64])
            ys = [int4_q8_of(p, x[:, a:a + half]).double() for p, a in zip(row_parts, (0, half))]
            rounded = (ys[0].abs() + ys[1].abs()) * 2 ** -8 if dtype == torch.bfloat16 else 0  # each part's output
            assert ((ys[0] + ys[1] - want).abs() <= 2 * bound(xd, q) * 2 ** -14 + rounded + 1e-30).all(), (name, rows)
        if other in cpu_qgemv.int4_blocks():
            n_pad = scales.shape[1]
            repacked = pack_int4(_int4_values(q.packed, int4_pack_layout(n_pad), torch.arange(n_pad), shape[1]),
                                 other).reshape(q.packed.shape)
            xs = [torch.randn(r, shape[1], generator=torch.Generator().manual_seed(r)).to(dtype) for r in (1, 2, 5)]
            mine = [cpu_qgemv.int4(x, q.packed, scales, group, shape[0], codes, act_int8=True) for x in xs]
            with monkeypatch.context() as m:
                m.setattr(cpu_qgemv, "torch_int4_block", lambda: other)
                theirs = [cpu_qgemv.int4(x, repacked, scales, group, shape[0], codes, act_int8=True) for x in xs]
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), (name, shape)
    with pytest.raises(ValueError, match=r"^qgemv int4: need uint8 packed \[64, 32\], scales \[4, n_pad % 16 == 0\] "
                                         r"in torch.float32, group size % 32 == 0 "):
        z = weight("int4", 32, (64, 64), torch.float32)
        cpu_qgemv.int4(torch.zeros(1, 64), z.packed, torch.zeros(4, 64, 2), 16, 64, act_int8=True)


@pytest.mark.skipif(cpu_library.missing(*cpu_qgemv.INT4_Q8_KERNELS) is not None,
                    reason=str(cpu_library.missing(*cpu_qgemv.INT4_Q8_KERNELS)))
def test_int4_q8_is_the_same_at_every_thread_count(torch_threads):
    """The int4 x int8 kernel's threads split halves of 64-row units (9 units of 576 -> 576 run 9 / 9 halves
    at 2 threads, not 5 / 4 units), each unit's outputs the sum of its two halves' in one order: bit for bit
    the same at 1, 2 and 3 threads, for 1 and 3 rows, with a last block of fewer than 64 rows (160 -> 584
    rows, 9 units and a tail) and k of 5 blocks of 32 (halves of 2 and 3 blocks); and the same values as
    the product of the int8 activations (the test above)."""
    for name, shape in [("int4z", (576, 576)), ("int4", (584, 160))]:
        q = weight(name, 32, shape, torch.bfloat16, seed=1)
        for rows in (1, 3):
            x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
            got = []
            for n in (1, 2, 3):
                torch_threads(n)
                got.append(int4_q8_of(q, x))
            assert all(torch.equal(got[0], g) for g in got[1:]), (name, shape, rows)
            xd, _ = q8_activations(x)
            want = xd.double() @ q.dequantize().double().T
            tol = bound(xd, q) * 2 ** -14 + want.abs() * 2 ** -8
            assert ((got[0].double() - want).abs() <= tol + 1e-30).all(), (name, shape, rows)


def int8_q8_reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 x int8 kernel's arithmetic in torch: ``x`` quantized per row and block of 32 as
    ``q8_activations``, each block's sum ``S_b = sum q xq`` exact (integers, in float64), then
    ``s * sum_b d_b S_b`` in float64; and ``s * sum_b |d_b S_b|``, the scale of float32's rounding of
    the kernel's sum over blocks. Both ``[rows, n]``."""
    rows, k = x.shape
    xb = x.float().reshape(rows, -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    xq = torch.round(xb * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))).double()
    blocks = torch.einsum("rbi,obi->rob", xq, q.double().reshape(q.shape[0], -1, 32)) * amax.double().squeeze(-1)[
        :, None, :].div(127).to(torch.float32).double()  # d_b = amax / 127 in float32, as the C code
    return blocks.sum(-1) * s.double(), blocks.abs().sum(-1) * s.double().abs()


@pytest.mark.skipif(cpu_library.missing(*cpu_qgemv.INT8_Q8_KERNELS) is not None,
                    reason=str(cpu_library.missing(*cpu_qgemv.INT8_Q8_KERNELS)))
def test_int8_q8_is_the_integer_product_of_the_int8_activations():
    """The int8 x int8 kernel (``int8(..., act_int8=True)``): (1) float32 activations give the integer
    reference (``int8_q8_reference``: exact block sums, only the float32 sum over blocks and the scaling
    round), weights over the whole int8 range -128..127 (VNNI's + 128 offset, AVX2's sign trick), k a
    multiple of 64 and not (96, 288: a last half step), 1..8 rows, an all-zero row and a 40x outlier;
    (2) bfloat16 activations and scales give the float32 result on the same values rounded once, bit for
    bit; (3) the error against the float product is within the activations' rounding, per output ``s *
    sum_i d_i / 2 |q_i|``; (4) a bfloat16 per-channel weight's forward and bound call take it up to
    ``q8_rows`` (the float kernel above), and only such weights are candidates (``q8_takes``); (5) a k
    that is not a multiple of 32 is refused."""
    g = torch.Generator().manual_seed(11)
    for n, k in [(472, 96), (80, 256), (33, 288)]:
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        s = torch.rand(n, generator=g) * 0.01
        for rows in (1, 2, 3, 5, 8):
            x = torch.randn(rows, k, generator=g)
            x[0, 5] = 40.0  # an outlier: its block's other values keep fewer bits
            if rows > 2:
                x[2] = 0.0  # d = 0: the row's outputs are 0
            got = cpu_qgemv.int8(x, q, s, act_int8=True)
            want, scale = int8_q8_reference(x, q, s)
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            assert ((got.double() - want).abs() <= scale * 2 ** -18 + 1e-30).all(), (n, k, rows)
            if rows > 2:
                assert not got[2].any()
            xd, d = q8_activations(x)
            exact = (x.double() @ q.double().T) * s.double()
            stated = ((d.double() / 2) @ q.double().abs().T) * s.double()
            assert ((got.double() - exact).abs() <= stated + scale * 2 ** -18 + 1e-30).all(), (n, k, rows)
            xb, sb = x.bfloat16(), s.bfloat16()
            assert torch.equal(cpu_qgemv.int8(xb, q, sb, act_int8=True),
                               cpu_qgemv.int8(xb.float(), q, sb.float(), act_int8=True).bfloat16()), (n, k, rows)
    w = weight("int8", None, (80, 256), torch.bfloat16)
    assert cpu_qgemv.q8_takes(w)
    assert not cpu_qgemv.q8_takes(weight("int8", None, (80, 256), torch.float32))
    assert not cpu_qgemv.q8_takes(weight("int8", 32, (80, 256), torch.bfloat16))
    for rows in (1, 4):
        x = torch.randn(rows, 256, generator=g).bfloat16()
        w.gemv_rows, w.q8_rows = 8, rows
        q8 = cpu_qgemv.int8(x, w.qweight, w.scales, act_int8=True)
        assert torch.equal(w(x), q8) and torch.equal(w.bind()(x), q8)
        assert w.bind().c_spec[:2] == ("q8", "tpe_qgemv_int8_q8")
        w.q8_rows = rows - 1
        plain = cpu_qgemv.int8(x, w.qweight, w.scales)
        assert torch.equal(w(x), plain) and torch.equal(w.bind()(x), plain) and not torch.equal(plain, q8)
    q48 = torch.zeros(16, 48, dtype=torch.int8)
    with pytest.raises(ValueError) as e:
        cpu_qgemv.int8(torch.zeros(1, 48), q48, torch.ones(16), act_int8=True)
    assert str(e.value) == ("qgemv int8: need a contiguous int8 [n, 48] weight and [n] scales in torch.float32 and "
                            "48 % 32 == 0 input columns; got torch.int8 (16, 48), scales torch.float32 (16,)")
