"""The Triton paged-attention kernels (functions and backend object) against the torch oracle.

Without CUDA they run on CPU tensors under the interpreter (TRITON_INTERPRET=1, set before triton
is first imported), in float32, on small shapes.
"""

import pytest
import torch
from kernel_cases import (  # sets TRITON_INTERPRET before triton is first imported (as conftest does)
    CONFIGS,
    DECODE_LENS,
    DEVICE,
    PREFILL_LENS,
    TOL,
    VERIFY_LENS,
    WINDOW_CAP,
    _decode_case,
    _gen,
    _prefill_case,
    _slot,
    _to,
    _tokens,
    cpu_decode,
)

from tpengine.backends import reference as ref
from tpengine.backends.cuda import triton_kernels as tri
from tpengine.backends.cuda.attention import TritonAttentionBackend


@pytest.mark.parametrize("d,hkv", [(64, 2), (128, 3)])
def test_triton_store(d, hkv):
    g = _gen(2)
    kc, vc = torch.randn(5, 16, hkv, d, generator=g), torch.randn(5, 16, hkv, d, generator=g)
    k, v = _tokens(6, hkv, d, g), _tokens(6, hkv, d, g)
    slots = torch.tensor([0, -1, 17, 79, -1, 40])
    want_k, want_v = kc.clone(), vc.clone()
    ref.store_kvcache(k, v, want_k, want_v, slots)
    kc, vc, k, v, slots = _to(DEVICE, kc, vc, k, v, slots)
    tri.store_kvcache(k, v, kc, vc, slots)
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)


@pytest.mark.parametrize("partition", [None, 32], ids=["one-split", "split-k"])
@pytest.mark.parametrize("d,bs,q_to_kv", CONFIGS)
def test_triton_decode(d, bs, q_to_kv, partition):
    q, kc, vc, bt, ctx, qkv = _decode_case(d, bs, q_to_kv, seed=3)
    _, part, splits = tri.decode_splits(bt.shape[1] * bs, d, partition)
    assert (splits > 1 and max(DECODE_LENS) > part) == (partition is not None)  # split-K engaged or not
    want = ref.decode_attention(q, kc, vc, bt, ctx, qkv, d**-0.5)
    args = _to(DEVICE, q, kc, vc, bt, ctx, qkv)
    got = tri.decode_attention(*args, d**-0.5, partition_size=partition)
    assert got.shape == q.shape and got.dtype == q.dtype and got.is_contiguous()
    torch.testing.assert_close(got.cpu(), want, **TOL)
    assert got[DECODE_LENS.index(0)].abs().max() == 0  # padding row -> zeros


@pytest.mark.parametrize("d,bs,q_to_kv", CONFIGS)
def test_triton_prefill_with_cached_prefix(d, bs, q_to_kv):
    case = _prefill_case(d, bs, q_to_kv, PREFILL_LENS, seed=4)
    want = ref.prefill_attention(*case, d**-0.5)
    got = tri.prefill_attention(*_to(DEVICE, *case), d**-0.5)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.cpu(), want, **TOL)


@pytest.mark.parametrize("d,bs,q_to_kv", CONFIGS[1:2] + CONFIGS[3:4])
def test_triton_prefill_no_prefix(d, bs, q_to_kv):
    lens = [(1, 1), (16, 16), (33, 33), (70, 70)]
    q, k, v, kc, vc, cu_q, cu_k, bt, qkv = _prefill_case(d, bs, q_to_kv, lens, seed=5)
    want = ref.prefill_attention(q, k, v, kc, vc, cu_q, cu_k, bt, qkv, d**-0.5)
    q, k, v, kc, vc, cu_q, cu_k, qkv = _to(DEVICE, q, k, v, kc, vc, cu_q, cu_k, qkv)
    got = tri.prefill_attention(q, k, v, kc, vc, cu_q, cu_k, None, qkv, d**-0.5)  # no table needed
    torch.testing.assert_close(got.cpu(), want, **TOL)


def test_triton_strided_cache():
    """Caches that are not contiguous (head-major blocks) work in every kernel of both backends."""
    d, bs, q_to_kv = 64, 16, [0, 0, 1]
    case = list(_prefill_case(d, bs, q_to_kv, [(3, 20), (9, 9)], seed=6))
    for i in (3, 4):  # k_cache, v_cache -> same values, [nb, H, bs, D] memory order
        case[i] = case[i].transpose(1, 2).contiguous().transpose(1, 2)
    q, k, v, kc, vc, cu_q, cu_k, bt, qkv = case
    kc2, vc2 = kc.contiguous(), vc.contiguous()  # copies for the reference
    kc, vc = kc.to(DEVICE), vc.to(DEVICE)  # .to keeps the strides
    assert not kc.is_contiguous()
    slots = torch.tensor([_slot(bt, 1, p, bs) for p in range(9)])
    tri.store_kvcache(*_to(DEVICE, k[3:], v[3:]), kc, vc, slots.to(DEVICE))
    ref.store_kvcache(k[3:], v[3:], kc2, vc2, slots)
    assert torch.equal(kc.cpu(), kc2) and torch.equal(vc.cpu(), vc2)
    want = ref.prefill_attention(q, k, v, kc2, vc2, cu_q, cu_k, bt, qkv, d**-0.5)
    got = tri.prefill_attention(*_to(DEVICE, q, k, v, kc, vc, cu_q, cu_k, bt, qkv), d**-0.5)
    torch.testing.assert_close(got.cpu(), want, **TOL)
    ctx = torch.tensor([20, 9])
    want = ref.decode_attention(q[:2], kc2, vc2, bt, ctx, qkv, d**-0.5)
    got = tri.decode_attention(*_to(DEVICE, q[:2], kc, vc, bt, ctx, qkv), d**-0.5, partition_size=16)
    torch.testing.assert_close(got.cpu(), want, **TOL)
    got = ref.decode_attention(*_to("cpu", q[:2], kc, vc), bt, ctx, qkv, d**-0.5)  # strided reference too
    torch.testing.assert_close(got, want, **TOL)
    got = cpu_decode(*_to("cpu", q[:2], kc, vc), bt, ctx, qkv, d**-0.5)  # and the CPU backend
    torch.testing.assert_close(got, want, **TOL)


def test_triton_backend_object_equals_functions():
    """TritonAttentionBackend: prepare (lengths read once, in prefill only) + store/prefill/decode
    give the functions' results."""
    d, bs, q_to_kv = 64, 16, [0, 0, 1]
    q, k, v, kc, vc, cu_q, cu_k, bt, qkv = _to(DEVICE, *_prefill_case(d, bs, q_to_kv, [(3, 20), (9, 9)], seed=8))
    be = TritonAttentionBackend()
    slots = _to(DEVICE, torch.tensor([_slot(bt.cpu(), b, p, bs) for b, (lq, lk) in enumerate([(3, 20), (9, 9)])
                                      for p in range(lk - lq, lk)]))[0]
    attn = be.prepare(True, slots, bt, cu_q, cu_k, None)
    assert attn.lengths[2:] == ([3, 9], [20, 9])
    kc2, vc2 = kc.clone(), vc.clone()
    be.store_kvcache(k, v, kc, vc, attn)
    tri.store_kvcache(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    want = tri.prefill_attention(q, k, v, kc, vc, cu_q, cu_k, bt, qkv, d**-0.5)
    assert torch.equal(be.prefill_attention(q, k, v, kc, vc, qkv, d**-0.5, attn), want)
    ctx = _to(DEVICE, torch.tensor([20, 9]))[0]
    attn = be.prepare(False, slots[:2], bt, None, None, ctx)
    assert attn.lengths is None
    want = tri.decode_attention(q[:2], kc, vc, bt, ctx, qkv, d**-0.5)
    assert torch.equal(be.decode_attention(q[:2], kc, vc, qkv, d**-0.5, attn), want)


@pytest.mark.parametrize("window,cap", WINDOW_CAP)
def test_triton_window_and_soft_cap(window, cap):
    """A sliding window shorter than the contexts and a logit soft cap in both kernels, against the
    oracle: decode rows (one split and split-K, whose splits before a window run nothing; a padding
    row), and prefill steps (prompts longer than a query tile, chunks over a cached prefix, a
    verification's few-token sequences), with the blocks wholly before every query's window freed
    (-1 in the tables: never read); through the backend object as well."""
    d, bs, q_to_kv = 64, 16, [0, 0, 1]
    kw = dict(sliding_window=window, soft_cap=cap)
    q, kc, vc, bt, ctx, qkv = _decode_case(d, bs, q_to_kv, seed=16)
    if window is not None:
        for b, n in enumerate(ctx.tolist()):
            bt[b, : max(n - window, 0) // bs] = -1
    want = ref.decode_attention(q, kc, vc, bt, ctx, qkv, d**-0.5, **kw)
    for partition in (None, 16):
        got = tri.decode_attention(*_to(DEVICE, q, kc, vc, bt, ctx, qkv), d**-0.5, partition_size=partition, **kw)
        torch.testing.assert_close(got.cpu(), want, **TOL)
    lens = [(70, 70), (17, 40), (2, 70)] + VERIFY_LENS[:2]
    q, k, v, kc, vc, cu_q, cu_k, bt, qkv = _prefill_case(d, bs, q_to_kv, lens, seed=17)
    if window is not None:
        for b, (lq, lk) in enumerate(lens):
            bt[b, : max(lk - lq - window + 1, 0) // bs] = -1
    want = ref.prefill_attention(q, k, v, kc, vc, cu_q, cu_k, bt, qkv, d**-0.5, **kw)
    args = _to(DEVICE, q, k, v, kc, vc, cu_q, cu_k, bt, qkv)
    got = tri.prefill_attention(*args, d**-0.5, **kw)
    torch.testing.assert_close(got.cpu(), want, **TOL)
    be = TritonAttentionBackend()
    attn = be.prepare(True, _to(DEVICE, torch.full((q.shape[0],), -1))[0], args[7], args[5], args[6], None)
    assert torch.equal(be.prefill_attention(*args[:5], args[8], d**-0.5, attn, window, cap), got)


@pytest.mark.parametrize("window,cap", [(None, None), (24, 2.0)], ids=["plain", "window-cap"])
def test_triton_int8_cache_equals_the_reference(window, cap):
    """An int8 KV cache (kv_cache_dtype int8): the store kernel writes the reference's codes and scales bit
    for bit (halfway values round to even, an all-zero row gets scale 0), and decode (one split and split-K)
    and prefill over a cached int8 prefix equal the reference on the dequantized cache, with a window and
    a soft cap too; float32 under the interpreter."""
    from tpengine.backends import kv_quant

    d, bs, q_to_kv = 64, 16, [0, 0, 1]
    kw = dict(sliding_window=window, soft_cap=cap)
    g = _gen(31)
    q, kc, vc, bt, ctx, qkv = _decode_case(d, bs, q_to_kv, seed=32)
    (kq, ks), (vq, vs) = kv_quant.quantize(kc), kv_quant.quantize(vc)
    k, v = _tokens(4, 2, d, g), _tokens(4, 2, d, g)
    k[0, 0] = torch.arange(d) - 31.5  # with absmax 127 the codes are x itself: every one a tie, to even
    k[0, 0, 0] = 127.0
    v[1, 1] = 0.0
    slots = torch.tensor([3, -1, int(bt[5, 2]) * bs + 7, 40])
    want = [t.clone() for t in (kq, vq, ks, vs)]
    ref.store_kvcache(k, v, want[0], want[1], slots, kv_scales=(want[2], want[3]))
    got = _to(DEVICE, kq, vq, ks, vs)
    tri.store_kvcache(*_to(DEVICE, k, v), got[0], got[1], _to(DEVICE, slots)[0], kv_scales=(got[2], got[3]))
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
    kq, vq, ks, vs = want
    if window is not None:
        for b, n in enumerate(ctx.tolist()):
            bt[b, : max(n - window, 0) // bs] = -1
    expect = ref.decode_attention(q, kq, vq, bt, ctx, qkv, d**-0.5, **kw, kv_scales=(ks, vs))
    dev = _to(DEVICE, q, kq, vq, bt, ctx, qkv, ks, vs)
    for partition in (None, 16):
        out = tri.decode_attention(*dev[:6], d**-0.5, partition_size=partition, **kw, kv_scales=tuple(dev[6:]))
        torch.testing.assert_close(out.cpu(), expect, **TOL)
    lens = [(17, 40), (2, 70), (16, 16)]
    q, k, v, kc, vc, cu_q, cu_k, bt, qkv = _prefill_case(d, bs, q_to_kv, lens, seed=33)
    (kq, ks), (vq, vs) = kv_quant.quantize(kc), kv_quant.quantize(vc)
    expect = ref.prefill_attention(q, k, v, kq, vq, cu_q, cu_k, bt, qkv, d**-0.5, **kw, kv_scales=(ks, vs))
    dev = _to(DEVICE, q, k, v, kq, vq, cu_q, cu_k, bt, qkv, ks, vs)
    out = tri.prefill_attention(*dev[:9], d**-0.5, **kw, kv_scales=tuple(dev[9:]))
    torch.testing.assert_close(out.cpu(), expect, **TOL)
