"""The C decode-attention kernel (tpengine/backends/cpu/cpu_decode.py) against the torch.bmm arithmetic
it replaces (the CPU backend's bfloat16 branch, tpengine/backends/cpu/attention.py): fast and
portable code paths, padding rows, masked tails holding NaN/inf, and its errors."""

import pytest
import torch

from tpengine.backends.cpu import cpu_decode, cpu_library
from tpengine.backends.cpu.attention import CPUAttentionBackend, key_mask

BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if cpu_library.missing(*cpu_decode.KERNELS):
        pytest.skip(cpu_library.missing(*cpu_decode.KERNELS))


def bmm_path(q, k, v, lens, scale):
    """The CPU backend's bfloat16 decode arithmetic: bf16 scores, float32 scale + mask + softmax,
    bf16 probabilities, bf16 p @ V."""
    b, hkv, g, d = q.shape
    cap = k.shape[2]
    bias = key_mask(lens, cap)[1]
    s = torch.bmm(q.reshape(b * hkv, g, d), k.view(b * hkv, cap, d).transpose(1, 2))
    s = s.float().mul_(scale).view(b, hkv, g, cap).add_(bias)
    p = torch.softmax(s, dim=-1).to(BF16).view(b * hkv, g, cap)
    return torch.bmm(p, v.view(b * hkv, cap, d)).view(b, hkv, g, d)


def case(b, hkv, g, d, cap, lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=gen).to(BF16) for shape in
               ((b, hkv, g, d), (b, hkv, cap, d), (b, hkv, cap, d)))
    return q, k, v, torch.tensor(lens, dtype=torch.int64)


SHAPES = [  # b, hkv, g, d, cap, lens: which code path
    (4, 2, 3, 64, 48, [48, 17, 0, 33]),  # AVX512-BF16 (G, D) specialised; a length-0 padding row
    (3, 1, 8, 128, 40, [40, 1, 39]),  # specialised; capacity not a multiple of 16 (scalar tail)
    (2, 2, 4, 32, 32, [32, 31]),  # generic fast path (D = 32 is not specialised)
    (5, 1, 2, 48, 20, [20, 3, 7, 19, 1]),  # portable scores (D % 32 != 0), fast p @ V
    (2, 1, 3, 20, 24, [24, 9]),  # portable both ways
]


@pytest.mark.parametrize("b,hkv,g,d,cap,lens", SHAPES)
def test_kernel_equals_bmm_arithmetic(b, hkv, g, d, cap, lens):
    q, k, v, lens_t = case(b, hkv, g, d, cap, lens)
    out = cpu_decode.decode_attention(q, k, v, lens_t, d**-0.5)
    want = bmm_path(q, k, v, lens_t, d**-0.5)
    assert out.dtype == BF16 and out.shape == (b, hkv, g, d)
    # only the order of float32 sums differs: a rare one-ulp step in a bfloat16 result
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=2**-9)
    assert (out == want).float().mean() >= 0.98
    exact = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * d**-0.5
                          + key_mask(lens_t, cap)[1].double(), dim=-1) @ v.double()
    torch.testing.assert_close(out.double(), exact, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("window,cap", [(9, None), (None, 2.0), (20, 2.0)])
def test_kernel_with_window_and_soft_cap_equals_bmm_arithmetic(window, cap):
    """A sliding window's key mask (the ``bias``) and a logit soft cap between the kernel's two ops: the
    bmm path's arithmetic with the same cap and mask (:func:`half_decode`), within a bfloat16 ulp."""
    from tpengine.backends.cpu.attention import half_decode

    q, k, v, lens = case(4, 2, 3, 64, 48, [48, 17, 0, 33], seed=3)
    valid, bias = key_mask(lens, 48, window)
    out = cpu_decode.decode_attention(q, k, v, lens, 0.125, soft_cap=cap, bias=bias)
    want = half_decode(q, k, v, valid, bias, 0.125, False, cap)
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=2**-9)
    plain = cpu_decode.decode_attention(q, k, v, lens, 0.125)
    assert not torch.equal(out[[0, 1, 3]], plain[[0, 1, 3]])  # the window / cap moved every real row


def test_masked_tail_is_never_read_into_the_result():
    """Keys and values at or past a sequence's length (the mirror's stale tail) may hold anything:
    NaN and inf there leave the result bit-identical to zeros there."""
    q, k, v, lens = case(3, 2, 3, 64, 64, [40, 64, 1], seed=1)
    clean = cpu_decode.decode_attention(q, k, v, lens, 0.125)
    k2, v2 = k.clone(), v.clone()
    for b, n in enumerate(lens.tolist()):
        k2[b, :, n:], v2[b, :, n:] = float("nan"), float("inf")
    assert torch.equal(cpu_decode.decode_attention(q, k2, v2, lens, 0.125), clean)
    assert torch.isfinite(clean.float()).all()


def test_errors():
    q, k, v, lens = case(2, 1, 3, 64, 32, [32, 5])
    with pytest.raises(ValueError, match=r"^context length 33 exceeds the 32 keys given$"):
        cpu_decode.decode_attention(q, k, v, torch.tensor([33, 5]), 0.125)
    with pytest.raises(ValueError, match=r"^q \(2, 1, 3, 64\), k \(2, 1, 32, 64\), v \(2, 1, 16, 64\), context_lens "
                                         r"\(2,\): expected \[B, Hkv, G<=8, D<=256\], \[B, Hkv, L, D\] x2, \[B\]$"):
        cpu_decode.decode_attention(q, k, v[:, :, :16].contiguous(), lens, 0.125)
    with pytest.raises(ValueError, match=r"^k and v hold no keys \(L = 0\)$"):
        cpu_decode.decode_attention(q, k[:, :, :0], v[:, :, :0], torch.zeros(2, dtype=torch.int64), 0.125)
    with pytest.raises(ValueError, match=r"^k and v must be contiguous bfloat16 CPU tensors$"):
        cpu_decode.decode_attention(q, k.float(), v, lens, 0.125)
    assert not cpu_decode.available(q.float(), 3, 64, True) and not cpu_decode.available(q, 9, 64, True)
    assert cpu_decode.available(q, 3, 64, True) and not cpu_decode.available(q, 3, 64, False)


def test_backend_decode_uses_the_kernel_and_matches_bmm(monkeypatch):
    """The CPU backend's decode attention over a paged cache: with the kernel on (``cpu_kernels``) and
    off (torch.bmm, or SDPA for a few sequences) the results agree to a bfloat16 ulp."""
    gen = torch.Generator().manual_seed(2)
    bs, hkv, d, lens = 16, 2, 64, [37, 5, 64, 20, 1]
    kc, vc = (torch.randn(24, bs, hkv, d, generator=gen).to(BF16) for _ in "kv")
    tables = torch.arange(len(lens) * 4).view(len(lens), 4)
    q = torch.randn(len(lens), 6, d, generator=gen).to(BF16)
    q_to_kv = torch.tensor([0, 0, 0, 1, 1, 1])
    ctx = torch.tensor(lens)
    calls = []
    monkeypatch.setattr(cpu_decode, "decode_attention",
                        lambda *a, f=cpu_decode.decode_attention: calls.append(1) or f(*a))
    def decode(cpu_kernels, sdpa_rows=None):
        be = CPUAttentionBackend(cpu_kernels=cpu_kernels)
        if sdpa_rows is not None:
            be.sdpa_rows = sdpa_rows
        attn = be.prepare(False, torch.full((len(lens),), -1), tables, None, None, ctx)
        return be.decode_attention(q, kc, vc, q_to_kv, d**-0.5, attn, None)

    on = decode(True)
    assert len(calls) == 1
    off = decode(False)
    assert len(calls) == 1
    torch.testing.assert_close(on.float(), off.float(), rtol=2**-7, atol=2**-9)
    # the SDPA / bmm switch forced each way (B x Hkv = 10 rows here): bmm is the kernel's
    # arithmetic; SDPA rounds inside in its own order (a few bfloat16 steps on small outputs)
    torch.testing.assert_close(decode(False, 0).float(), on.float(), rtol=2**-7, atol=2**-9)
    torch.testing.assert_close(decode(False, 64).float(), on.float(), rtol=2**-7, atol=2**-7)
    assert len(calls) == 1


@pytest.mark.parametrize("d", (64, 20))  # AVX512-BF16 and portable p @ V
def test_ties_round_to_even(d):
    """Equal scores over two keys give p = 0.5 each, so the output is the midpoint of two adjacent
    bfloat16 values: rounded to the even one, as torch rounds."""
    e = 2.0**-7  # bfloat16 spacing in [1, 2)
    q = torch.zeros(1, 1, 1, d, dtype=BF16)
    k = torch.zeros(1, 1, 2, d, dtype=BF16)
    lows = torch.tensor([1.0, 1.0 + e, 1.5, 1.5 + e]).repeat(d // 4 + 1)[:d]
    v = torch.stack([lows, lows + e]).to(BF16).view(1, 1, 2, d)
    out = cpu_decode.decode_attention(q, k, v, torch.tensor([2]), 1.0).float().flatten()
    even = torch.tensor([1.0, 1.0 + 2 * e, 1.5, 1.5 + 2 * e]).repeat(d // 4 + 1)[:d]  # 1+e and 1.5+e are odd
    assert torch.equal(out, even)
    assert torch.equal(bmm_path(q, k, v, torch.tensor([2]), 1.0).float().flatten(), even)
