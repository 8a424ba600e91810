"""Paged-attention kernels: torch reference vs a naive per-token oracle, Triton vs the reference.

Without CUDA the Triton kernels run on CPU tensors under the interpreter (TRITON_INTERPRET=1,
set here before triton is first imported), in float32, on small shapes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tpengine.kernels import get_backend  # noqa: E402
from tpengine.kernels import paged_attention as tri  # noqa: E402
from tpengine.kernels import reference as ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=1e-3, rtol=1e-3)

# (head_dim, block_size, q_to_kv): GQA ratios 1, 3, 4 and two uneven TP-shard maps
CONFIGS = [
    pytest.param(64, 16, [0, 1], id="d64-bs16-mha"),
    pytest.param(128, 32, [0, 0, 0, 1, 1, 1], id="d128-bs32-gqa3"),
    pytest.param(64, 32, [0, 0, 0, 0], id="d64-bs32-gqa4"),
    pytest.param(128, 16, [0, 0, 0, 1, 1], id="d128-bs16-uneven"),
    pytest.param(64, 16, [0, 1, 1, 1], id="d64-bs16-replicated"),
]
DECODE_LENS = [1, 15, 16, 17, 33, 70, 0]  # crosses block boundaries; 0 = batch padding
# (Lq, Lk): no prefix, prefixes not block-aligned, block-aligned, long prefix + few new tokens
PREFILL_LENS = [(1, 1), (15, 15), (17, 40), (16, 48), (2, 70)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cache(lens, bs, hkv, d, g, pad_cols=2):
    """Random caches and shuffled -1-padded block tables with room for ``lens`` tokens each."""
    need = [-(-n // bs) for n in lens]
    nblocks = sum(need) + 3
    perm = torch.randperm(nblocks, generator=g)
    bt = torch.full((len(lens), max(need) + pad_cols), -1, dtype=torch.int64)
    used = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[used:used + n]
        used += n
    kc = torch.randn(nblocks, bs, hkv, d, generator=g)
    vc = torch.randn(nblocks, bs, hkv, d, generator=g)
    return kc, vc, bt


def _slot(bt, b, pos, bs):
    return int(bt[b, pos // bs]) * bs + pos % bs


def _tokens(n, h, d, g):
    """[n, h, d] with non-contiguous strides, like the engine's transposed HF activations."""
    return torch.randn(h, n, d, generator=g).transpose(0, 1)


def _naive(qv, keys, values, q_to_kv, scale):
    """Dense attention of one query ``[Hq, D]`` over ``keys``/``values [L, Hkv, D]`` in float64."""
    out = torch.zeros(qv.shape, dtype=torch.float64)
    if keys.shape[0] == 0:
        return out
    for h, kvh in enumerate(q_to_kv):
        s = keys[:, kvh].double() @ qv[h].double() * scale
        out[h] = torch.softmax(s, 0) @ values[:, kvh].double()
    return out


def _to(device, *ts):
    return [t.to(device) for t in ts]


# ---------------------------------------------------------------------------------------------
# backend selection
# ---------------------------------------------------------------------------------------------


def test_get_backend():
    assert get_backend("auto", "cpu") is ref
    assert get_backend("auto", torch.device("cuda")) is tri
    assert get_backend("torch", "cuda") is ref
    assert get_backend("triton", "cpu") is tri
    for mod in (ref, tri):
        for f in ("store_kvcache", "prefill_attention", "decode_attention"):
            assert callable(getattr(mod, f))
    with pytest.raises(ValueError, match="flash"):
        get_backend("flash", "cpu")


# ---------------------------------------------------------------------------------------------
# the reference against a naive per-token oracle
# ---------------------------------------------------------------------------------------------


def _decode_case(d, bs, q_to_kv, seed=0):
    g = _gen(seed)
    kc, vc, bt = _cache(DECODE_LENS, bs, max(q_to_kv) + 1, d, g)
    q = _tokens(len(DECODE_LENS), len(q_to_kv), d, g)
    return q, kc, vc, bt, torch.tensor(DECODE_LENS), torch.tensor(q_to_kv)


def _prefill_case(d, bs, q_to_kv, lens, seed=0):
    """Random prefix in the cache; new tokens' k/v stored into the cache as the engine does."""
    g = _gen(seed)
    hkv, hq = max(q_to_kv) + 1, len(q_to_kv)
    kc, vc, bt = _cache([lk for _, lk in lens], bs, hkv, d, g)
    n = sum(lq for lq, _ in lens)
    q, k, v = _tokens(n, hq, d, g), _tokens(n, hkv, d, g), _tokens(n, hkv, d, g)
    slots = [_slot(bt, b, p, bs) for b, (lq, lk) in enumerate(lens) for p in range(lk - lq, lk)]
    ref.store_kvcache(k, v, kc, vc, torch.tensor(slots))
    cu_q = torch.tensor([0] + [lq for lq, _ in lens]).cumsum(0)
    cu_k = torch.tensor([0] + [lk for _, lk in lens]).cumsum(0)
    return q, k, v, kc, vc, cu_q, cu_k, bt, torch.tensor(q_to_kv)


@pytest.mark.parametrize("d,bs,q_to_kv", CONFIGS[:2] + CONFIGS[3:4])
def test_reference_decode_matches_naive(d, bs, q_to_kv):
    q, kc, vc, bt, ctx, qkv = _decode_case(d, bs, q_to_kv)
    out = ref.decode_attention(q, kc, vc, bt, ctx, qkv, d**-0.5)
    assert out.dtype == q.dtype and out.shape == q.shape
    flat_k, flat_v = kc.flatten(0, 1), vc.flatten(0, 1)
    for b, n in enumerate(DECODE_LENS):
        slots = [_slot(bt, b, p, bs) for p in range(n)]
        want = _naive(q[b], flat_k[slots], flat_v[slots], q_to_kv, d**-0.5)
        torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d,bs,q_to_kv", CONFIGS[1:2] + CONFIGS[4:5])
def test_reference_prefill_matches_naive(d, bs, q_to_kv):
    q, k, v, kc, vc, cu_q, cu_k, bt, qkv = _prefill_case(d, bs, q_to_kv, PREFILL_LENS)
    out = ref.prefill_attention(q, k, v, kc, vc, cu_q, cu_k, bt, qkv, d**-0.5)
    flat_k, flat_v = kc.flatten(0, 1), vc.flatten(0, 1)
    for b, (lq, lk) in enumerate(PREFILL_LENS):
        for i in range(lq):
            pos = lk - lq + i  # the query's position; it sees keys 0..pos, all in the cache by now
            slots = [_slot(bt, b, p, bs) for p in range(pos + 1)]
            want = _naive(q[cu_q[b] + i], flat_k[slots], flat_v[slots], q_to_kv, d**-0.5)
            torch.testing.assert_close(out[cu_q[b] + i].double(), want, atol=1e-5, rtol=1e-5)


def test_reference_store_and_dtypes():
    g = _gen(1)
    kc, vc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16), torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    k, v = torch.randn(4, 2, 64, generator=g), torch.randn(4, 2, 64, generator=g)
    ref.store_kvcache(k, v, kc, vc, torch.tensor([5, -1, 63, 16]))
    for i, s in [(0, 5), (2, 63), (3, 16)]:
        assert torch.equal(kc[s // 16, s % 16], k[i].bfloat16())
        assert torch.equal(vc[s // 16, s % 16], v[i].bfloat16())
    assert kc.flatten(0, 1).abs().sum(dim=(1, 2)).count_nonzero() == 3  # the -1 token wrote nothing
    q = torch.randn(2, 3, 64, generator=g).bfloat16()
    args = (torch.tensor([[0, 1], [3, 2]]), torch.tensor([7, 20]), torch.tensor([0, 1, 1]), 0.125)
    out = ref.decode_attention(q, kc, vc, *args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.decode_attention(q.float(), kc.float(), vc.float(), *args),
                               atol=2e-2, rtol=2e-2)


def test_reference_errors():
    q, k, v, kc, vc, cu_q, cu_k, bt, qkv = _prefill_case(64, 16, [0, 1], [(4, 4), (3, 9)])
    with pytest.raises(ValueError, match="q_to_kv"):
        ref.prefill_attention(q, k, v, kc, vc, cu_q, cu_k, bt, qkv[:1], 0.1)
    with pytest.raises(ValueError, match="Lk"):
        ref.prefill_attention(q, k, v, kc, vc, cu_q, torch.tensor([0, 4, 6]), bt, qkv, 0.1)
    with pytest.raises(ValueError, match="block_tables"):
        ref.prefill_attention(q, k, v, kc, vc, cu_q, cu_k, None, qkv, 0.1)
    with pytest.raises(ValueError, match="capacity"):
        ref.decode_attention(q[:2], kc, vc, bt, torch.tensor([4, 1000]), qkv, 0.1)


# ---------------------------------------------------------------------------------------------
# Triton against the reference
# ---------------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("q_to_kv", [[0, 0, 0, 1, 1, 1], [0, 1, 1, 0]], ids=["gqa3", "uneven"])
def test_reference_prefill_half_batched(q_to_kv):
    """Same-length prompts in bfloat16 take the matmul path (HF eager's arithmetic): equal to the
    float32 result within bfloat16 rounding, and causal (a changed last key leaves earlier rows)."""
    d, bs, lens = 64, 16, [(20, 20)] * 3
    case = list(_prefill_case(d, bs, q_to_kv, lens, seed=7))
    half = [t.bfloat16() if t.is_floating_point() else t for t in case]
    out = ref.prefill_attention(*half, d**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == case[0].shape
    want = ref.prefill_attention(*[t.float() if t.is_floating_point() else t for t in half], d**-0.5)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    half[1] = half[1].clone()
    half[1][19] += 1.0  # sequence 0's last key: only its last query sees it
    changed = (ref.prefill_attention(*half, d**-0.5) != out).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == [19]
