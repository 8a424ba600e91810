"""The fused bfloat16 CPU kernels (tpengine/kernels/cpu_fused.py) against the torch op chains they
replace: residual add + RMSNorm and RoPE bit for bit, SiLU * up up to the last bit of exp; the
cases they decline (float32, shapes they do not cover) return None."""

import pytest
import torch
import torch.nn.functional as F

from tpengine.kernels import cpu_fused, cpu_native
from tpengine.layers.fused import rotate_half

BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if cpu_native.load() is None:
        pytest.skip(f"C kernels unavailable here: {cpu_native.unavailable_reason()}")


def rand(*shape, scale=1.0, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


@pytest.mark.parametrize("rows", (1, 64, 300))  # 300 x 576: over the kernel's OpenMP threshold
def test_add_rms_norm_equals_torch(rows):
    h, x, w = rand(rows, 576, scale=3.0), rand(rows, 576, seed=1), rand(576, seed=2).abs() + 0.5
    h_before = h.clone()
    h2, y = cpu_fused.add_rms_norm(h, x, w, 1e-5)
    want_h = h + x
    want_y = w * F.rms_norm(want_h.float(), (576,), None, 1e-5).to(BF16)
    assert torch.equal(h2, want_h) and torch.equal(y, want_y)
    assert torch.equal(h, h_before)  # inputs are not written
    h3, y3 = cpu_fused.add_rms_norm(h, None, w, 1e-5)
    assert h3 is h and torch.equal(y3, w * F.rms_norm(h.float(), (576,), None, 1e-5).to(BF16))


def test_rope_in_place_equals_hf_formula():
    """On the q/k part of a fused q/k/v row (a strided view), leaving v untouched."""
    qkv, cos, sin = rand(1, 50, 15, 64), rand(1, 50, 64, seed=1), rand(1, 50, 64, seed=2)
    qk = qkv[..., :12, :]
    want = qk * cos.unsqueeze(-2) + rotate_half(qk) * sin.unsqueeze(-2)
    v = qkv[..., 12:, :].clone()
    assert cpu_fused.rope_(qk, cos, sin) is qk
    assert torch.equal(qk, want) and torch.equal(qkv[..., 12:, :], v)


def test_silu_mul_equals_torch():
    gu = rand(200, 2 * 1536, scale=4.0)
    gu[0, :8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -100.0, 100.0, -87.0])
    out = cpu_fused.silu_mul(gu, 1536)
    want = F.silu(gu[:, :1536]).mul_(gu[:, 1536:])
    assert out.shape == (200, 1536)
    same = (out == want) | (out.isnan() & want.isnan())
    assert same[0, :8].all()  # zeros, infinities, NaN, saturated exp
    # exp may differ from SLEEF's in its last float32 bit, which the bfloat16 rounding hides here
    assert same.all()


def test_declined_cases_return_none():
    h, w = rand(4, 576), rand(576)
    assert cpu_fused.add_rms_norm(h.float(), None, w.float(), 1e-5) is None  # float32: torch's path
    assert cpu_fused.add_rms_norm(rand(4, 40), None, rand(40), 1e-5) is None  # 40 % 16
    assert cpu_fused.rope_(rand(1, 3, 2, 48), rand(1, 3, 48), rand(1, 3, 48)) is None  # 48 % 32
    assert cpu_fused.rope_(rand(2, 3, 2, 64), rand(2, 3, 64), rand(2, 3, 64)) is None  # batch of 2
    assert cpu_fused.silu_mul(rand(3, 2 * 24), 24) is None  # 24 % 16
    assert cpu_fused.silu_mul(rand(3, 64), 16) is None  # not 2 x 16 wide
    assert cpu_fused.silu_mul(rand(3, 0), 0) is None and cpu_fused.add_rms_norm(rand(3, 0), None, rand(0), 1e-5) is None
    overlapping = rand(1, 1, 2, 64).expand(1, 5, 2, 64)  # 5 positions sharing one row of memory
    assert cpu_fused.rope_(overlapping, rand(1, 5, 64), rand(1, 5, 64)) is None


def test_disabled_means_torch(monkeypatch):
    monkeypatch.setattr(cpu_native, "ENABLED", False)
    assert cpu_fused.add_rms_norm(rand(4, 576), None, rand(576), 1e-5) is None
    assert cpu_fused.silu_mul(rand(3, 64), 32) is None


def test_copy_rows_equals_index_copy():
    """KV-cache writes from the strided k/v parts of a fused q/k/v output, and mirror-style
    appends through a source index: the same tensors as index_copy_ / index_select."""
    qkv = rand(7, 9, 64)  # 7 tokens; heads 0-4 q, 5-6 k, 7-8 v
    k, v = qkv[:, 5:7], qkv[:, 7:9]
    slots = torch.tensor([11, 3, 0, 19, 4, 8, 15])
    kc, vc = rand(20, 2, 64, seed=1), rand(20, 2, 64, seed=2)
    want_k, want_v = kc.clone().index_copy_(0, slots, k), vc.clone().index_copy_(0, slots, v)
    assert cpu_fused.copy_rows((k, v), (kc, vc), slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    rows, src = torch.tensor([5, 0, 9]), torch.tensor([39, 2, 17])  # [slots * heads, D] views
    mk, mv = rand(10, 64, seed=3), rand(10, 64, seed=4)
    want_mk = mk.clone().index_copy_(0, rows, kc.view(-1, 64).index_select(0, src))
    want_mv = mv.clone().index_copy_(0, rows, vc.view(-1, 64).index_select(0, src))
    assert cpu_fused.copy_rows((kc.view(-1, 64), vc.view(-1, 64)), (mk, mv), rows, src)
    assert torch.equal(mk, want_mk) and torch.equal(mv, want_mv)
    before = kc.clone()
    assert not cpu_fused.copy_rows((k.float(), v.float()), (kc.float(), vc.float()), slots)  # float32: torch
    assert not cpu_fused.copy_rows((k, v), (kc, vc), slots[:3])  # 7 rows, 3 indices
    assert torch.equal(kc, before)


@pytest.mark.parametrize("n", (1, 5, 37, 128))
def test_causal_softmax_equals_torch(n):
    """The prefill path's s.mul_(scale).add_(causal mask) then softmax, in bfloat16: masked keys
    exactly 0, the rest equal but for exp's last bit (a rare one-ulp step)."""
    s = rand(2, 3, n, n, scale=8.0)
    mask = torch.zeros(n, n).masked_fill_(torch.ones(n, n, dtype=torch.bool).triu_(1), float("-inf")).to(BF16)
    want = torch.softmax(s.clone().mul_(0.125).add_(mask), dim=-1)
    got = s.clone()
    assert cpu_fused.causal_softmax_(got, 0.125) is got
    assert (got.triu(1) == 0).all() and (got[..., 0, 0] == 1).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-9)
    assert (got != want).sum() <= max(1, got.numel() // 10000)
    assert cpu_fused.causal_softmax_(s.float(), 0.125) is None  # float32: torch
    assert cpu_fused.causal_softmax_(rand(n, n + 1), 0.1) is None  # not square


def test_causal_softmax_rows_with_nan_or_inf_are_nan_as_in_torch():
    n = 20
    s = rand(1, n, n)
    s[0, 5, 2], s[0, 7, 7], s[0, 9, 3] = float("nan"), float("inf"), -float("inf")
    s[0, 11, :12] = -float("inf")  # every visible key masked out by its score
    mask = torch.zeros(n, n).masked_fill_(torch.ones(n, n, dtype=torch.bool).triu_(1), float("-inf")).to(BF16)
    want = torch.softmax(s.clone().mul_(0.125).add_(mask), dim=-1)
    got = cpu_fused.causal_softmax_(s.clone(), 0.125)
    assert want[0, [5, 7, 11]].isnan().all() and not want[0, 9].isnan().any()  # what torch does
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_add_rms_norm_non_contiguous_residual():
    """A transposed residual: read from a contiguous copy kept alive through the call."""
    h, w = rand(64, 576), rand(576, seed=2)
    x = rand(576, 64, seed=1).t()
    h2, y = cpu_fused.add_rms_norm(h, x, w, 1e-5)
    assert torch.equal(h2, h + x) and torch.equal(y, w * F.rms_norm((h + x).float(), (576,), None, 1e-5).to(BF16))


def test_cpu_kernels_switch_is_per_engine(tmp_path, monkeypatch):
    """Two engines in one process, one with cpu_kernels = false: its steps make no C call, even
    after the other engine was created (the module switch is set at every step)."""
    from conftest import make_tiny_model

    from tpengine.config import EngineConfig
    from tpengine.engine.llm_engine import LLMEngine
    from tpengine.engine.sampling_params import SamplingParams

    model = make_tiny_model(tmp_path, "llama", seed=2)
    calls = []
    real = cpu_native.load()

    class Counting:
        def __getattr__(self, name):
            return lambda *a: calls.append(name) or getattr(real, name)(*a)

    monkeypatch.setattr(cpu_native, "_lib", Counting())
    cfg = {"model": str(model), "dtype": "bfloat16", "max_model_len": 64, "kv_cache_gb": 0.01}
    off = LLMEngine(EngineConfig(**cfg, cpu_kernels=False))
    on = LLMEngine(EngineConfig(**cfg))
    try:
        req = [("a", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))]
        off.generate(req)
        assert calls == []
        on.generate(req)
        assert "tpe_add_rms_norm" in calls and "tpe_decode_scores" in calls
        calls.clear()
        off.generate(req)
        assert calls == []
    finally:
        off.shutdown()
        on.shutdown()
