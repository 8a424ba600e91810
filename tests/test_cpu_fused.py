"""The fused CPU ops (tpengine/backends/cpu/cpu_fused.py): their bfloat16 C kernels against the torch op
chains they replace (residual add + RMSNorm and RoPE bit for bit, SiLU * up up to the last bit of
exp); the cases the kernels decline (float32, shapes they do not cover, ``cpu_kernels=False``) run the
torch chain inside the op, with no C call; bad indices raise IndexError naming them."""

import pytest
import torch
import torch.nn.functional as F

from tpengine.backends.cpu import cpu_fused, cpu_library
from tpengine.backends.torch_ops import rotate_half

BF16 = torch.bfloat16


#: the kernels' own tests; the torch chains the ops fall back to (declined cases, cpu_kernels=False, the
#: copies and the argument checks) run on every machine, without the C kernels too (AVX2 only)
FUSED = ("tpe_add_rms_norm", "tpe_add_rms_norm_f32", "tpe_rope", "tpe_rope_f32", "tpe_silu_mul", "tpe_silu_mul_f32",
         "tpe_gelu_tanh_mul", "tpe_gelu_tanh_mul_f32",
         "tpe_causal_softmax")  # (in every build with a vector path: AVX512-BF16 or AVX2)
needs_kernels = pytest.mark.skipif(cpu_library.missing(*FUSED) is not None, reason=str(cpu_library.missing(*FUSED)))


@pytest.fixture
def c_calls(monkeypatch):
    """The names of the C functions called (through torch.ops.tpengine.*) while the test runs."""
    calls, real = [], cpu_library.load()
    if real is None:  # no C kernels here: nothing can call one
        return calls

    class Counting:
        def __getattr__(self, name):
            return lambda *a: calls.append(name) or getattr(real, name)(*a)

        def __getitem__(self, name):  # a function's address for a call from C (the decode program's ops)
            return real[name]

    monkeypatch.setattr(cpu_library, "_lib", Counting())
    return calls


def rand(*shape, scale=1.0, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


@needs_kernels
@pytest.mark.parametrize("rows", (1, 64, 300))  # 300 x 576: over the kernel's OpenMP threshold
def test_add_rms_norm_equals_torch(rows):
    h, x, w = rand(rows, 576, scale=3.0), rand(rows, 576, seed=1), rand(576, seed=2).abs() + 0.5
    h_before = h.clone()
    h2, y = cpu_fused.add_rms_norm(h, x, w, 1e-5, True)
    want_h = h + x
    want_y = w * F.rms_norm(want_h.float(), (576,), None, 1e-5).to(BF16)
    assert torch.equal(h2, want_h) and torch.equal(y, want_y)
    assert torch.equal(h, h_before)  # inputs are not written
    h3, y3 = cpu_fused.add_rms_norm(h, None, w, 1e-5, True)
    assert h3 is h and torch.equal(y3, w * F.rms_norm(h.float(), (576,), None, 1e-5).to(BF16))


@needs_kernels
@pytest.mark.parametrize("dtype", (BF16, torch.float32), ids=["bfloat16", "float32"])
@pytest.mark.parametrize("batch", (True, False), ids=["1xTxHxD", "TxHxD"])
def test_rope_in_place_equals_hf_formula(batch, dtype, c_calls):
    """On the q/k part of a fused q/k/v row (a strided view), leaving v untouched; with or without
    a leading batch dimension of 1; bit for bit the torch formula in both dtypes (float32: each product
    rounded before the sum, no fused multiply-add)."""
    qkv, cos, sin = rand(1, 50, 15, 64), rand(1, 50, 64, seed=1), rand(1, 50, 64, seed=2)
    if dtype == torch.float32:  # full float32 mantissas: a product of two is not exact, so a fused one would differ
        qkv, cos, sin = (torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) for i, t in
                         enumerate((qkv, cos, sin)))
    if not batch:
        qkv, cos, sin = qkv[0], cos[0], sin[0]
    qk = qkv[..., :12, :]
    want = qk * cos.unsqueeze(-2) + rotate_half(qk) * sin.unsqueeze(-2)
    v = qkv[..., 12:, :].clone()
    assert cpu_fused.rope_(qk, cos, sin, True) is qk
    assert torch.equal(qk, want) and torch.equal(qkv[..., 12:, :], v)
    assert c_calls == ["tpe_rope" if dtype == BF16 else "tpe_rope_f32"]


@needs_kernels
def test_silu_mul_equals_torch():
    gu = rand(200, 2 * 1536, scale=4.0)
    gu[0, :8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -100.0, 100.0, -87.0])
    out = cpu_fused.silu_mul(gu, 1536, True)
    want = F.silu(gu[:, :1536]).mul_(gu[:, 1536:])
    assert out.shape == (200, 1536)
    same = (out == want) | (out.isnan() & want.isnan())
    assert same[0, :8].all()  # zeros, infinities, NaN, saturated exp
    # exp may differ from SLEEF's in its last float32 bit, which the bfloat16 rounding hides here
    assert same.all()


@needs_kernels
def test_gelu_tanh_mul_equals_torch():
    """GeGLU's ``gelu_tanh(gate) * up`` (Gemma's MLP): bfloat16 bit for bit equal to torch's
    ``F.gelu(approximate="tanh").mul_``, saturated tanh included (exactly +-1 past |x| 8.66, as SLEEF's);
    float32 within a few units in the last place (tanh's last bits); rows of 24 (24 % 16) take torch."""
    gu = rand(200, 2 * 1536, scale=4.0)
    gu[0, :8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -100.0, 100.0, -87.0])
    line = torch.linspace(-12, 12, 1536)  # every magnitude of tanh's argument: polynomial, formula, saturated
    gu[1] = torch.cat([line, torch.ones(1536)]).bfloat16()
    out = cpu_fused.gelu_tanh_mul(gu, 1536, True)
    want = F.gelu(gu[:, :1536], approximate="tanh").mul_(gu[:, 1536:])
    assert out.shape == (200, 1536)
    assert ((out == want) | (out.isnan() & want.isnan())).all()
    g32 = torch.cat([torch.linspace(-12, 12, 3072), torch.ones(3072)])[None]
    torch.testing.assert_close(cpu_fused.gelu_tanh_mul(g32, 3072, True),
                               F.gelu(g32[:, :3072], approximate="tanh"), rtol=4e-6, atol=1e-6)
    g24 = rand(3, 2 * 24)
    want24 = F.gelu(g24[:, :24], approximate="tanh").mul_(g24[:, 24:])
    assert torch.equal(cpu_fused.gelu_tanh_mul(g24, 24, True), want24)


def test_activation_kind_names_what_one_op_computes():
    """FusedMLP fuses SiLU and torch's tanh GELU (nn.GELU's and transformers' GELUTanh, not its python form)."""
    from transformers.activations import ACT2FN, GELUTanh

    from tpengine.model.layers.fused import activation_kind
    assert activation_kind(torch.nn.SiLU()) == "silu" and activation_kind(ACT2FN["silu"]) == "silu"
    assert activation_kind(ACT2FN["gelu_pytorch_tanh"]) == "gelu_tanh"
    assert activation_kind(torch.nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert activation_kind(GELUTanh(use_gelu_tanh_python=True)) is None
    assert activation_kind(torch.nn.GELU()) is None and activation_kind(ACT2FN["relu"]) is None


def _rms(h, x, w):
    h = h if x is None else h + x
    if h.dtype == torch.float32:
        return h, F.rms_norm(h, w.shape, w, 1e-5)
    if w.dtype == torch.float32:  # a float32 weight beside half precision: Gemma's / OLMo 2's form, one rounding
        return h, F.rms_norm(h.float(), w.shape, w, 1e-5).to(h.dtype)
    return h, w * F.rms_norm(h.float(), w.shape, None, 1e-5).to(h.dtype)


def _same(got, want):
    return all(torch.equal(a, b) for a, b in zip(got, want)) if isinstance(got, tuple) else torch.equal(got, want)


def test_declined_cases_run_torch(c_calls):
    """Cases the C kernels do not cover run the torch chain inside the op: the same values as the
    chain, no C call."""
    h40, w40 = rand(4, 40), rand(40)
    assert _same(cpu_fused.add_rms_norm(h40, h40, w40, 1e-5, True), _rms(h40, h40, w40))  # 40 % 16
    h40, w40 = h40.float(), w40.float()
    assert _same(cpu_fused.add_rms_norm(h40, h40, w40, 1e-5, True), _rms(h40, h40, w40))  # float32, 40 % 16
    h, w = rand(4, 576), rand(576)
    assert _same(cpu_fused.add_rms_norm(h, None, w.float(), 1e-5, True), _rms(h, None, w.float()))  # mixed dtypes
    for qk, cs in ((rand(1, 3, 2, 48), rand(1, 3, 48)), (rand(2, 3, 2, 64), rand(2, 3, 64))):  # 48 % 32; batch 2
        if qk.shape[0] == 2:  # a batch of 2 is covered now when rows view as [T, H, D]; make one that is not
            qk = qk.transpose(0, 1)
            cs = cs.transpose(0, 1)
        want = qk * cs.unsqueeze(-2) + rotate_half(qk) * cs.unsqueeze(-2)
        got = cpu_fused.rope_(qk, cs, cs, True)
        assert got is not qk and torch.equal(got, want)
    g24 = rand(3, 2 * 24)
    assert torch.equal(cpu_fused.silu_mul(g24, 24, True), F.silu(g24[:, :24]).mul_(g24[:, 24:]))  # 24 % 16
    g48 = rand(3, 48).float()
    assert torch.equal(cpu_fused.silu_mul(g48, 24, True), F.silu(g48[:, :24]).mul_(g48[:, 24:]))  # float32, 24 % 16
    assert cpu_fused.silu_mul(rand(3, 0), 0, True).shape == (3, 0)
    assert cpu_fused.add_rms_norm(rand(3, 0), None, rand(0), 1e-5, True)[1].shape == (3, 0)
    overlapping = rand(1, 1, 2, 64).expand(1, 5, 2, 64)  # 5 positions sharing one row of memory
    c5, s5 = rand(1, 5, 64, seed=1), rand(1, 5, 64, seed=2)
    got = cpu_fused.rope_(overlapping, c5, s5, True)
    assert got is not overlapping
    assert torch.equal(got, overlapping * c5.unsqueeze(-2) + rotate_half(overlapping) * s5.unsqueeze(-2))
    assert c_calls == []


@needs_kernels
def test_float32_kernels_match_torch(c_calls):
    """float32 residual add + RMSNorm and SiLU * up run the ``_f32`` C kernels: the residual sum is
    exact, the rest equal to torch's float32 ops up to the order of the sum of squares and the
    last bits of exp (a few units in the last place)."""
    h, x, w = rand(8, 576).float(), rand(8, 576, seed=1).float(), rand(576, seed=2).float()
    h2, y = cpu_fused.add_rms_norm(h, x, w, 1e-5, True)
    want_h2, want_y = _rms(h, x, w)
    assert torch.equal(h2, want_h2)
    torch.testing.assert_close(y, want_y, rtol=4e-7 * 8, atol=1e-7)
    h1, y1 = cpu_fused.add_rms_norm(h, None, w, 1e-5, True)
    assert h1 is h
    torch.testing.assert_close(y1, _rms(h, None, w)[1], rtol=4e-7 * 8, atol=1e-7)
    gu = rand(5, 2 * 1536, scale=4.0).float()
    gu[0, :6] = torch.tensor([0.0, float("inf"), -float("inf"), -100.0, 100.0, -87.0])
    out = cpu_fused.silu_mul(gu, 1536, True)
    torch.testing.assert_close(out, F.silu(gu[:, :1536]).mul_(gu[:, 1536:]), rtol=4e-6, atol=1e-30, equal_nan=True)
    assert c_calls == ["tpe_add_rms_norm_f32", "tpe_add_rms_norm_f32", "tpe_silu_mul_f32"]


def test_kernels_off_means_torch(c_calls):
    """``cpu_kernels=False`` (EngineConfig.cpu_kernels = false): the torch chains, bit for bit, no C call."""
    h, x, w = rand(4, 576), rand(4, 576, seed=1), rand(576, seed=2)
    assert _same(cpu_fused.add_rms_norm(h, x, w, 1e-5, False), _rms(h, x, w))
    gu = rand(3, 64)
    assert torch.equal(cpu_fused.silu_mul(gu, 32, False), F.silu(gu[:, :32]).mul_(gu[:, 32:]))
    qk, cs = rand(4, 3, 64), rand(4, 64, seed=3)
    assert torch.equal(cpu_fused.rope_(qk, cs, cs, False), qk * cs[:, None] + rotate_half(qk) * cs[:, None])
    s = rand(2, 8, 8)
    assert torch.equal(cpu_fused.causal_softmax_(s.clone(), 0.5, False),
                       torch.softmax(s.clone().mul_(0.5).add_(cpu_fused.causal_bias(8, BF16, s.device)), dim=-1))
    kc = rand(20, 2, 64)
    want = kc.clone().index_copy_(0, torch.tensor([3, 1]), gu.view(3, 1, 64).expand(3, 2, 64)[:2].contiguous())
    got = kc.clone()
    src = gu.view(3, 1, 64).expand(3, 2, 64)[:2].contiguous()
    cpu_fused.copy_rows((src, src), (got, got.clone()), torch.tensor([3, 1]), cpu_kernels=False)
    assert torch.equal(got, want)
    assert c_calls == []


def test_copy_rows_equals_index_copy(c_calls):
    """KV-cache writes from the strided k/v parts of a fused q/k/v output, and mirror-style
    appends through a source index: the same tensors as index_copy_ / index_select (bfloat16 and float32,
    one C call each where the library loads)."""
    qkv = rand(7, 9, 64)  # 7 tokens; heads 0-4 q, 5-6 k, 7-8 v
    k, v = qkv[:, 5:7], qkv[:, 7:9]
    slots = torch.tensor([11, 3, 0, 19, 4, 8, 15])
    kc, vc = rand(20, 2, 64, seed=1), rand(20, 2, 64, seed=2)
    want_k, want_v = kc.clone().index_copy_(0, slots, k), vc.clone().index_copy_(0, slots, v)
    cpu_fused.copy_rows((k, v), (kc, vc), slots, cpu_kernels=True)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    rows, src = torch.tensor([5, 0, 9]), torch.tensor([39, 2, 17])  # [slots * heads, D] views
    mk, mv = rand(10, 64, seed=3), rand(10, 64, seed=4)
    want_mk = mk.clone().index_copy_(0, rows, kc.view(-1, 64).index_select(0, src))
    want_mv = mv.clone().index_copy_(0, rows, vc.view(-1, 64).index_select(0, src))
    cpu_fused.copy_rows((kc.view(-1, 64), vc.view(-1, 64)), (mk, mv), rows, src, cpu_kernels=True)
    assert torch.equal(mk, want_mk) and torch.equal(mv, want_mv)
    kf, vf = kc.float(), vc.float()
    cpu_fused.copy_rows((k.float(), v.float()), (kf, vf), slots, cpu_kernels=True)  # float32: the same C copy
    assert torch.equal(kf, want_k.float()) and torch.equal(vf, want_v.float())
    assert c_calls == ([] if cpu_library.load() is None else ["tpe_copy_rows"] * 3)
    before = kc.clone()
    with pytest.raises(ValueError, match=r"^copy_rows: 3 dst_index entries for 7 source rows$"):  # nothing copied
        cpu_fused.copy_rows((k, v), (kc, vc), slots[:3], cpu_kernels=True)
    assert torch.equal(kc, before)


@pytest.mark.parametrize("cpu_kernels,dtype", [(True, BF16), (False, BF16), (True, torch.float32)],
                         ids=["C", "torch", "float32"])
def test_copy_rows_index_out_of_range(cpu_kernels, dtype):
    """An index out of range is an IndexError naming it and the valid range, never a write out of
    bounds; the C kernel checks every index before it copies, so it writes nothing (torch's
    index_copy_ may have copied the rows before the bad one)."""
    if cpu_kernels and dtype == BF16 and cpu_library.load() is None:  # (tpe_copy_rows is in every build)
        pytest.skip(f"needs the CPU C kernels: {cpu_library.unavailable_reason()}")
    src, dst = rand(4, 2, 64).to(dtype), rand(10, 2, 64, seed=1).to(dtype)
    before = dst.clone()
    with pytest.raises(IndexError, match=r"^dst_index\[2\] = 10 is out of range for 10 rows \(valid: 0 to 9\)$"):
        cpu_fused.copy_rows((src, src), (dst, dst), torch.tensor([0, 9, 10, 3]), cpu_kernels=cpu_kernels)
    with pytest.raises(IndexError, match=r"^dst_index\[0\] = -1 is out of range for 10 rows \(valid: 0 to 9\)$"):
        cpu_fused.copy_rows((src, src), (dst, dst), torch.tensor([-1, 9, 1, 3]), cpu_kernels=cpu_kernels)
    with pytest.raises(IndexError, match=r"^src_index\[1\] = 4 is out of range for 4 rows \(valid: 0 to 3\)$"):
        cpu_fused.copy_rows((src, src), (dst, dst), torch.tensor([0, 1]), torch.tensor([3, 4]), cpu_kernels=cpu_kernels)
    assert torch.equal(dst, before) or not (cpu_kernels and cpu_library.load() is not None)  # C: both dtypes


def test_ops_are_registered_and_check_arguments():
    """The C kernels are torch ops (``torch.ops.tpengine.*``, visible to the profiler); bad
    arguments are a ValueError at the op boundary, naming the op and the argument."""
    for name in ("add_rms_norm", "rope_", "silu_mul", "causal_softmax_", "copy_rows", "decode_scores", "decode_pv",
                 "row_argmax", "col_argmax"):
        assert hasattr(torch.ops.tpengine, name)
    src, dst = rand(4, 64), rand(10, 128)[:, :64]
    with pytest.raises(ValueError, match=r"^tpengine\.copy_rows: dst_a must be a contiguous bfloat16 CPU tensor"):
        torch.ops.tpengine.copy_rows(src, src, None, dst, dst, torch.arange(4))
    with pytest.raises(ValueError, match=r"^tpengine\.silu_mul: need gate_up \[\.\.\., 2 \* inter\]"):
        torch.ops.tpengine.silu_mul(rand(3, 64), rand(3, 24))
    with pytest.raises(ValueError, match=r"^tpengine\.row_argmax: x must be a non-empty float32 or bfloat16 \[rows, "
                                         r"cols\] CPU tensor with contiguous rows; got torch\.int64 \(2, 3\)"):
        torch.ops.tpengine.row_argmax(torch.zeros(2, 3, dtype=torch.int64), torch.empty(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^tpengine\.col_argmax: index must be a contiguous int64 \[3\] tensor; "
                                         r"got torch\.int64 \(2,\)$"):
        torch.ops.tpengine.col_argmax(rand(2, 3), torch.empty(2, dtype=torch.int64))
    with torch.profiler.profile() as prof:
        cpu_fused.silu_mul(rand(3, 64), 32, True)
    # without the C kernel (no compiler, or a build with no vector path) the op is not called: its torch chain runs
    assert ("tpengine::silu_mul" in {e.key for e in prof.key_averages()}) == cpu_library.has("tpe_silu_mul")


@needs_kernels
@pytest.mark.parametrize("n", (1, 5, 37, 128))
def test_causal_softmax_equals_torch(n):
    """The prefill path's s.mul_(scale).add_(causal mask) then softmax, in bfloat16: masked keys
    exactly 0, the rest equal but for exp's last bit (a rare one-ulp step)."""
    s = rand(2, 3, n, n, scale=8.0)
    mask = torch.zeros(n, n).masked_fill_(torch.ones(n, n, dtype=torch.bool).triu_(1), float("-inf")).to(BF16)
    want = torch.softmax(s.clone().mul_(0.125).add_(mask), dim=-1)
    got = s.clone()
    assert cpu_fused.causal_softmax_(got, 0.125, True) is got
    assert (got.triu(1) == 0).all() and (got[..., 0, 0] == 1).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-9)
    assert (got != want).sum() <= max(1, got.numel() // 10000)
    sf = s.float()
    want_f = torch.softmax(sf.clone().mul_(0.125).add_(cpu_fused.causal_bias(n, sf.dtype, sf.device)), dim=-1)
    assert torch.equal(cpu_fused.causal_softmax_(sf, 0.125, True), want_f)  # float32: torch
    with pytest.raises(ValueError, match=rf"^causal_softmax_: s must be square score blocks \[\.\.\., n, n\]; "
                                         rf"got \({n}, {n + 1}\)$"):
        cpu_fused.causal_softmax_(rand(n, n + 1), 0.1, True)


@needs_kernels
def test_causal_softmax_rows_with_nan_or_inf_are_nan_as_in_torch():
    n = 20
    s = rand(1, n, n)
    s[0, 5, 2], s[0, 7, 7], s[0, 9, 3] = float("nan"), float("inf"), -float("inf")
    s[0, 11, :12] = -float("inf")  # every visible key masked out by its score
    mask = torch.zeros(n, n).masked_fill_(torch.ones(n, n, dtype=torch.bool).triu_(1), float("-inf")).to(BF16)
    want = torch.softmax(s.clone().mul_(0.125).add_(mask), dim=-1)
    got = cpu_fused.causal_softmax_(s.clone(), 0.125, True)
    assert want[0, [5, 7, 11]].isnan().all() and not want[0, 9].isnan().any()  # what torch does
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@needs_kernels
def test_add_rms_norm_non_contiguous_residual():
    """A transposed residual: read from a contiguous copy kept alive through the call."""
    h, w = rand(64, 576), rand(576, seed=2)
    x = rand(576, 64, seed=1).t()
    h2, y = cpu_fused.add_rms_norm(h, x, w, 1e-5, True)
    assert torch.equal(h2, h + x) and torch.equal(y, w * F.rms_norm((h + x).float(), (576,), None, 1e-5).to(BF16))


@needs_kernels
def test_cpu_kernels_switch_is_per_engine(tmp_path, monkeypatch):
    """Two engines in one process, one with cpu_kernels = false: its steps make no C call (not even the
    GEMV of a measured linear layout), even
    after the other engine was created (the choice is per backend and per layer, no module switch)."""
    from conftest import make_tiny_model

    from tpengine.config import EngineConfig
    from tpengine.engine.llm_engine import LLMEngine
    from tpengine.sampling_params import SamplingParams

    model = make_tiny_model(tmp_path, "llama", seed=2)
    calls = []
    real = cpu_library.load()

    class Counting:
        def __getattr__(self, name):
            return lambda *a: calls.append(name) or getattr(real, name)(*a)

        def __getitem__(self, name):  # a function's address for a call from C (the decode program's ops)
            return real[name]

    monkeypatch.setattr(cpu_library, "_lib", Counting())
    cfg = {"model": str(model), "dtype": "bfloat16", "max_model_len": 64, "kv_cache_gb": 0.01}
    off = LLMEngine(EngineConfig(**cfg, cpu_kernels=False))
    on = LLMEngine(EngineConfig(**cfg))
    # loading may time the GEMV for the layout choice (an uncached or noisy measurement); the steps
    # are what must make no C call
    calls.clear()
    try:
        req = [("a", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))]
        off.generate(req)
        assert calls == []
        on.generate(req)
        assert "tpe_add_rms_norm" in calls  # the decode attention kernel only where this build has it
        assert ("tpe_decode_scores" in calls) == cpu_library.has("tpe_decode_scores")
        calls.clear()
        off.generate(req)
        assert calls == []
    finally:
        off.shutdown()
        on.shutdown()


@needs_kernels
@pytest.mark.parametrize("rows", (1, 64, 300))
def test_float32_weight_beside_bfloat16_norm_kernel(rows):
    """Gemma's / OLMo 2's norm form bound to its kernel (``tpe_add_rms_norm_w32``): bfloat16 activations, a
    float32 weight, the product rounded once -- torch's ``F.rms_norm(h.float(), w).bfloat16()`` up to the
    order of the float32 sum of squares (at most one bfloat16 step apart); the residual sum exact."""
    from tpengine.backends.cpu.cpu_fused import FusedOps
    from tpengine.backends.cpu.layer_calls import bind_norm
    from tpengine.model.layers.fused import RMSNorm

    if not cpu_library.has("tpe_add_rms_norm_w32"):
        pytest.skip("no tpe_add_rms_norm_w32 in this build")
    norm = RMSNorm(576, 1e-6, BF16, FusedOps(True), float32_weight=True)
    norm.weight = torch.nn.Parameter(torch.randn(576, generator=torch.Generator().manual_seed(3)) * 0.1 + 1.0,
                                     requires_grad=False)
    run = bind_norm(norm, BF16)
    assert run is not None and bind_norm(norm) is not None  # (float32 activations: the float32 kernel)
    h, x = rand(rows, 576, scale=3.0), rand(rows, 576, seed=1)
    for residual in (x, None):
        h2, y = run(h, residual)
        want_h = h if residual is None else h + x
        want = F.rms_norm(want_h.float(), (576,), norm.weight, 1e-6).to(BF16)
        assert torch.equal(h2, want_h) and y.dtype == BF16
        ulp = want.float().abs().clamp_min(1e-30) * 2 ** -7
        assert ((y.float() - want.float()).abs() <= ulp).all()


@needs_kernels
@pytest.mark.parametrize("shape", [(16, 49152), (1, 1001), (3, 17)])  # over the OpenMP threshold; tails
def test_soft_cap_kernel_equals_torch(shape, c_calls):
    """Gemma 2's final-logit soft cap in one C pass (``tpe_soft_cap``) gives torch's three bfloat16 ops'
    values (HF's); float32 and cpu_kernels off take torch."""
    from tpengine.backends import torch_ops

    if not cpu_library.has("tpe_soft_cap"):
        pytest.skip("no tpe_soft_cap in this build")
    x = rand(*shape, scale=40.0)
    want = torch_ops.soft_cap_(x.clone(), 30.0)
    got = x.clone()
    assert cpu_fused.soft_cap_(got, 30.0, True) is got and torch.equal(got, want)
    assert c_calls == ["tpe_soft_cap"]
    f = x.float()
    assert torch.equal(cpu_fused.soft_cap_(f.clone(), 30.0, True), torch.tanh(f / 30.0) * 30.0)
    assert torch.equal(cpu_fused.soft_cap_(x.clone(), 30.0, False), want) and c_calls == ["tpe_soft_cap"]


@needs_kernels
@pytest.mark.parametrize("tokens", (1, 5))
def test_per_head_qk_norm_in_place_equals_the_layers_norms(tokens):
    """Qwen3's per-head q_norm / k_norm bound on the attention layer (layer_calls.bind_qk_norm, tpe_head_rms_norm):
    the query and key heads of every token normalized in place, bit for bit the norm on those rows (HF's
    Qwen3RMSNorm: float32 mean of squares, rounded before the weight), the value heads untouched; float32 as
    close as the float32 norm; another dtype takes the layer's generic path."""
    from types import SimpleNamespace

    from tpengine.backends.cpu import layer_calls

    hq, hkv, d = 4, 2, 64
    for dtype in (BF16, torch.float32):
        qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
        norm = [SimpleNamespace(weight=(torch.rand(d, generator=torch.Generator().manual_seed(i)) + 0.5).to(dtype),
                                eps=1e-6) for i in (5, 6)]
        generic = []
        attn = SimpleNamespace(q_norm=norm[0], k_norm=norm[1], head_dim=d, num_heads=hq, num_key_value_heads=hkv,
                               projection_norms=False, _qk_norm=lambda t: generic.append(t) or t)
        run = layer_calls.bind_qk_norm(attn, dtype)
        t = qkv.view(tokens, hq + 2 * hkv, d).float()
        want = torch.cat([(n.weight * F.rms_norm(t[:, a:b], (d,), None, 1e-6).to(dtype)) for n, (a, b) in
                          ((norm[0], (0, hq)), (norm[1], (hq, hq + hkv)))] + [t[:, hq + hkv:].to(dtype)], dim=1)
        got = run(qkv.clone())
        if dtype == BF16:
            assert torch.equal(got, want.flatten(1))
        else:
            assert torch.allclose(got, want.flatten(1), rtol=1e-6, atol=1e-6)
        assert generic == [] and run(qkv.to(torch.float16)) is not None and len(generic) == 1
