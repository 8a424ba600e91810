"""Paged-attention kernels: the torch oracle and the CPU backend vs a naive per-token oracle, Triton
(functions and backend object) vs the oracle, backend selection and per-step isolation.

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
from tpengine.kernels.cpu_attention import CPUAttentionBackend  # noqa: E402
from tpengine.kernels.triton_attention import TritonAttentionBackend  # noqa: E402

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
    cpu = get_backend("auto", "cpu", native=False, kv_mirror=True)
    assert isinstance(cpu, CPUAttentionBackend) and (cpu.native, cpu.kv_mirror) == (False, True)
    assert not cpu.graph_safe and cpu.name == "torch"
    assert isinstance(get_backend("auto", torch.device("cuda"), native=True, kv_mirror=True), TritonAttentionBackend)
    assert isinstance(get_backend("torch", "cuda", native=True, kv_mirror=False), CPUAttentionBackend)
    tb = get_backend("triton", "cpu", native=True, kv_mirror=True)
    assert isinstance(tb, TritonAttentionBackend) and tb.graph_safe and tb.name == "triton"
    assert get_backend("torch", "cpu", native=True, kv_mirror=True) is not get_backend("torch", "cpu", native=True,
                                                                                       kv_mirror=True)
    for obj in (cpu, tb):
        for f in ("prepare", "bind_layer", "store_kvcache", "prefill_attention", "decode_attention"):
            assert callable(getattr(obj, f))
    for f in ("store_kvcache", "prefill_attention", "decode_attention"):
        assert callable(getattr(ref, f)) and callable(getattr(tri, f))
    with pytest.raises(ValueError, match=r"^unknown attention backend 'flash'; expected one of auto, torch, triton$"):
        get_backend("flash", "cpu", native=True, kv_mirror=True)


# the CPU backend through the reference's call signatures (one step's prepare per call)
def _none_slots(n):
    return torch.full((n,), -1)


def cpu_store(k, v, kc, vc, slots, native=True):
    be = CPUAttentionBackend(native=native, kv_mirror=False)
    be.store_kvcache(k, v, kc, vc, be.prepare(False, slots, None, None, None, torch.zeros(0, dtype=torch.int64)))


def cpu_prefill(q, k, v, kc, vc, cu_q, cu_k, bt, qkv, scale, native=True):
    be = CPUAttentionBackend(native=native)
    attn = be.prepare(True, _none_slots(q.shape[0]), bt, cu_q, cu_k, None)
    return be.prefill_attention(q, k, v, kc, vc, qkv, scale, attn)


def cpu_decode(q, kc, vc, bt, ctx, qkv, scale, native=True):
    be = CPUAttentionBackend(native=native)
    attn = be.prepare(False, _none_slots(q.shape[0]), bt, None, None, ctx)
    return be.decode_attention(q, kc, vc, qkv, scale, attn, None)


ORACLE = (ref.store_kvcache, ref.prefill_attention, ref.decode_attention)
CPU = (cpu_store, cpu_prefill, cpu_decode)
IMPLS = [pytest.param(ORACLE, id="oracle"), pytest.param(CPU, id="cpu-backend")]


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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d,bs,q_to_kv", CONFIGS[:2] + CONFIGS[3:4])
def test_reference_decode_matches_naive(d, bs, q_to_kv, impl):
    q, kc, vc, bt, ctx, qkv = _decode_case(d, bs, q_to_kv)
    out = impl[2](q, kc, vc, bt, ctx, qkv, d**-0.5)
    assert out.dtype == q.dtype and out.shape == q.shape
    flat_k, flat_v = kc.flatten(0, 1), vc.flatten(0, 1)
    for b, n in enumerate(DECODE_LENS):
        slots = [_slot(bt, b, p, bs) for p in range(n)]
        want = _naive(q[b], flat_k[slots], flat_v[slots], q_to_kv, d**-0.5)
        torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d,bs,q_to_kv", CONFIGS[1:2] + CONFIGS[4:5])
def test_reference_prefill_matches_naive(d, bs, q_to_kv, impl):
    q, k, v, kc, vc, cu_q, cu_k, bt, qkv = _prefill_case(d, bs, q_to_kv, PREFILL_LENS)
    out = impl[1](q, k, v, kc, vc, cu_q, cu_k, bt, qkv, d**-0.5)
    flat_k, flat_v = kc.flatten(0, 1), vc.flatten(0, 1)
    for b, (lq, lk) in enumerate(PREFILL_LENS):
        for i in range(lq):
            pos = lk - lq + i  # the query's position; it sees keys 0..pos, all in the cache by now
            slots = [_slot(bt, b, p, bs) for p in range(pos + 1)]
            want = _naive(q[cu_q[b] + i], flat_k[slots], flat_v[slots], q_to_kv, d**-0.5)
            torch.testing.assert_close(out[cu_q[b] + i].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_reference_store_and_dtypes(impl):
    store, _, decode = impl
    g = _gen(1)
    kc, vc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16), torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    k, v = torch.randn(4, 2, 64, generator=g), torch.randn(4, 2, 64, generator=g)
    store(k, v, kc, vc, torch.tensor([5, -1, 63, 16]))
    for i, s in [(0, 5), (2, 63), (3, 16)]:
        assert torch.equal(kc[s // 16, s % 16], k[i].bfloat16())
        assert torch.equal(vc[s // 16, s % 16], v[i].bfloat16())
    assert kc.flatten(0, 1).abs().sum(dim=(1, 2)).count_nonzero() == 3  # the -1 token wrote nothing
    q = torch.randn(2, 3, 64, generator=g).bfloat16()
    args = (torch.tensor([[0, 1], [3, 2]]), torch.tensor([7, 20]), torch.tensor([0, 1, 1]), 0.125)
    out = decode(q, kc, vc, *args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), decode(q.float(), kc.float(), vc.float(), *args),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_reference_errors(impl):
    _, prefill, decode = impl
    q, k, v, kc, vc, cu_q, cu_k, bt, qkv = _prefill_case(64, 16, [0, 1], [(4, 4), (3, 9)])
    with pytest.raises(ValueError, match="q_to_kv"):
        prefill(q, k, v, kc, vc, cu_q, cu_k, bt, qkv[:1], 0.1)
    with pytest.raises(ValueError, match="Lk"):
        prefill(q, k, v, kc, vc, cu_q, torch.tensor([0, 4, 6]), bt, qkv, 0.1)
    with pytest.raises(ValueError, match="block_tables"):
        prefill(q, k, v, kc, vc, cu_q, cu_k, None, qkv, 0.1)
    with pytest.raises(ValueError, match="capacity"):
        decode(q[:2], kc, vc, bt, torch.tensor([4, 1000]), qkv, 0.1)


@pytest.mark.parametrize("store", [pytest.param(ref.store_kvcache, id="oracle"),
                                   pytest.param(cpu_store, id="cpu-C"),
                                   pytest.param(lambda *a: cpu_store(*a, native=False), id="cpu-torch")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_slot_out_of_range(store, dtype):
    """A slot past the cache (or below -1) is an IndexError naming it and the valid range, raised
    before anything is written."""
    kc, vc = torch.zeros(5, 16, 2, 64, dtype=dtype), torch.zeros(5, 16, 2, 64, dtype=dtype)
    k = torch.ones(3, 2, 64, dtype=dtype)
    with pytest.raises(IndexError, match=r"^slot_mapping\[2\] = 80 is out of range for a KV cache of 80 slots "
                                         r"\(valid: -1 to skip, 0 to 79\)$"):
        store(k, k, kc, vc, torch.tensor([0, 79, 80]))
    with pytest.raises(IndexError, match=r"^slot_mapping\[1\] = -2 is out of range for a KV cache of 80 slots "
                                         r"\(valid: -1 to skip, 0 to 79\)$"):
        store(k, k, kc, vc, torch.tensor([0, -2, 5]))
    assert kc.abs().sum() == 0 and vc.abs().sum() == 0


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
    got = cpu_decode(*_to("cpu", q[:2], kc, vc), bt, ctx, qkv, d**-0.5)  # and the CPU backend
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("q_to_kv", [[0, 0, 0, 1, 1, 1], [0, 1, 1, 0]], ids=["gqa3", "uneven"])
@pytest.mark.parametrize("native", (True, False), ids=["C-softmax", "torch-softmax"])
def test_cpu_prefill_half_batched(q_to_kv, native):
    """Same-length prompts in bfloat16 take the CPU backend's matmul path (HF eager's arithmetic):
    equal to the float32 oracle within bfloat16 rounding, and causal (a changed last key leaves
    earlier rows)."""
    d, bs, lens = 64, 16, [(20, 20)] * 3
    case = list(_prefill_case(d, bs, q_to_kv, lens, seed=7))
    half = [t.bfloat16() if t.is_floating_point() else t for t in case]
    out = cpu_prefill(*half, d**-0.5, native=native)
    assert out.dtype == torch.bfloat16 and out.shape == case[0].shape
    want = ref.prefill_attention(*[t.float() if t.is_floating_point() else t for t in half], d**-0.5)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    half[1] = half[1].clone()
    half[1][19] += 1.0  # sequence 0's last key: only its last query sees it
    changed = (cpu_prefill(*half, d**-0.5, native=native) != out).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == [19]


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


def test_prepare_is_per_step_and_per_backend(monkeypatch):
    """Two CPU backends in one process with different native/kv_mirror settings, their steps
    interleaved: each step's metadata comes from its own backend's prepare, one backend's prefill
    does not break the other's mirror continuity, and the native=False one makes no C call."""
    from tpengine.kernels import cpu_native
    from tpengine.kernels.kv_mirror import KVMirror

    if cpu_native.load() is None:
        pytest.skip(f"C kernels unavailable here: {cpu_native.unavailable_reason()}")
    calls, real = [], cpu_native.load()

    class Counting:
        def __getattr__(self, name):
            return lambda *a: calls.append(name) or getattr(real, name)(*a)

    monkeypatch.setattr(cpu_native, "_lib", Counting())
    g, bs, hkv, d = _gen(9), 16, 2, 64
    kc, vc = (torch.randn(16, bs, hkv, d, generator=g).bfloat16() for _ in "kv")
    bt = torch.arange(8).view(2, 4)
    qkv = torch.tensor([0, 0, 1, 1])
    plain, fast = CPUAttentionBackend(native=False, kv_mirror=False), CPUAttentionBackend(native=True, kv_mirror=True)
    mirror_plain, mirror_fast = KVMirror(), KVMirror()
    one = torch.tensor([0, 1])
    for step in range(4):
        ctx = torch.tensor([10 + step, 30 + step])
        q = torch.randn(2, 4, d, generator=g).bfloat16()
        a_fast = fast.prepare(False, _none_slots(2), bt.clone(), None, None, ctx)
        plain.prepare(True, torch.tensor([-1]), bt[:1], one, one, None)  # the other engine prefills in between
        a_plain = plain.prepare(False, _none_slots(2), bt.clone(), None, None, ctx)
        assert a_plain.mirror is None and a_fast.mirror.serial == step + 1 and a_fast.mirror.continues == (step > 0)
        assert (a_fast.min_ctx, a_fast.max_ctx) == (a_plain.min_ctx, a_plain.max_ctx) == (10 + step, 30 + step)
        n = len(calls)
        got_plain = plain.decode_attention(q, kc, vc, qkv, d**-0.5, a_plain, mirror_plain)
        assert len(calls) == n  # native=False: torch only
        got_fast = fast.decode_attention(q, kc, vc, qkv, d**-0.5, a_fast, mirror_fast)
        assert "tpe_decode_scores" in calls[n:]
        torch.testing.assert_close(got_plain.float(), got_fast.float(), rtol=2e-2, atol=2e-2)  # SDPA vs C
    assert mirror_plain.stats == {"rebuilds": 0, "growths": 0, "appends": 0}
    assert mirror_fast.stats == {"rebuilds": 1, "growths": 1, "appends": 3}  # 33 tokens at step 3 > capacity 32
