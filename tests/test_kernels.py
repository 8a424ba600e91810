"""Paged-attention kernels on CPU: the torch oracle and the CPU backend vs a naive per-token oracle,
backend selection, and per-step isolation of the backend objects (the Triton kernels:
tests/test_triton_kernels.py)."""

import pytest
import torch
from kernel_cases import (  # sets TRITON_INTERPRET before triton is first imported (as conftest does)
    CONFIGS,
    DECODE_LENS,
    IMPLS,
    MIXED_LENS,
    PREFILL_LENS,
    VERIFY_LENS,
    WINDOW_CAP,
    _decode_case,
    _gen,
    _naive,
    _none_slots,
    _prefill_case,
    _slot,
    _visible_slots,
    cpu_decode,
    cpu_prefill,
    cpu_store,
)

from tpengine.backends import get_backend
from tpengine.backends import reference as ref
from tpengine.backends.cpu.attention import CPUAttentionBackend
from tpengine.backends.cuda import triton_kernels as tri
from tpengine.backends.cuda.attention import TritonAttentionBackend


def test_get_backend():
    cpu = get_backend("auto", "cpu", cpu_kernels=False, kv_mirror=True)
    assert isinstance(cpu, CPUAttentionBackend) and (cpu.cpu_kernels, cpu.kv_mirror, cpu.paged) == (False, True, False)
    assert get_backend("auto", "cpu", cpu_kernels=True, kv_mirror=True).paged  # the C kernels' paged decode
    assert not cpu.graph_safe and cpu.name == "cpu"
    assert isinstance(get_backend("cpu", "cpu", cpu_kernels=True, kv_mirror=True), CPUAttentionBackend)
    assert isinstance(get_backend("auto", torch.device("cuda"), cpu_kernels=True, kv_mirror=True),
                      TritonAttentionBackend)
    assert isinstance(get_backend("torch", "cuda", cpu_kernels=True, kv_mirror=False), CPUAttentionBackend)
    tb = get_backend("triton", "cpu", cpu_kernels=True, kv_mirror=True)
    assert isinstance(tb, TritonAttentionBackend) and tb.graph_safe and tb.name == "triton"
    assert get_backend("torch", "cpu", cpu_kernels=True, kv_mirror=True) is not get_backend(
        "torch", "cpu", cpu_kernels=True, kv_mirror=True)
    for obj in (cpu, tb):
        for f in ("prepare", "bind_layer", "store_kvcache", "prefill_attention", "decode_attention"):
            assert callable(getattr(obj, f))
    for f in ("store_kvcache", "prefill_attention", "decode_attention"):
        assert callable(getattr(ref, f)) and callable(getattr(tri, f))
    with pytest.raises(ValueError,
                       match=r"^unknown attention backend 'flash'; expected one of auto, cpu, torch, triton$"):
        get_backend("flash", "cpu", cpu_kernels=True, kv_mirror=True)


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


@pytest.mark.parametrize("lens", [PREFILL_LENS, MIXED_LENS, VERIFY_LENS], ids=["prefill", "mixed", "verify"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d,bs,q_to_kv", CONFIGS[1:2] + CONFIGS[4:5])
def test_reference_prefill_matches_naive(d, bs, q_to_kv, impl, lens):
    q, k, v, kc, vc, cu_q, cu_k, bt, qkv = _prefill_case(d, bs, q_to_kv, lens)
    out = impl[1](q, k, v, kc, vc, cu_q, cu_k, bt, qkv, d**-0.5)
    flat_k, flat_v = kc.flatten(0, 1), vc.flatten(0, 1)
    for b, (lq, lk) in enumerate(lens):
        for i in range(lq):
            pos = lk - lq + i  # the query's position; it sees keys 0..pos, all in the cache by now
            slots = [_slot(bt, b, p, bs) for p in range(pos + 1)]
            want = _naive(q[cu_q[b] + i], flat_k[slots], flat_v[slots], q_to_kv, d**-0.5)
            torch.testing.assert_close(out[cu_q[b] + i].double(), want, atol=1e-5, rtol=1e-5)


WINDOW_STEPS = (PREFILL_LENS + [(40, 40)], MIXED_LENS, VERIFY_LENS)  # prompts and chunks; mixed; verification


def _window_outputs(prefill, decode, window, cap, **kw):
    """A decode step and the prefill steps of :data:`WINDOW_STEPS` through ``prefill``/``decode`` (the
    reference's call signatures) with a sliding window and soft cap: ``[(output, case), ...]``."""
    d, bs, q_to_kv = 64, 16, [0, 0, 0, 1, 1, 1]
    case = _decode_case(d, bs, q_to_kv, seed=11)
    outs = [(decode(*case, d**-0.5, sliding_window=window, soft_cap=cap, **kw), case)]
    for lens in WINDOW_STEPS:
        case = _prefill_case(d, bs, q_to_kv, lens, seed=12)
        outs.append((prefill(*case, d**-0.5, sliding_window=window, soft_cap=cap, **kw), case))
    return outs


@pytest.mark.parametrize("window,cap", WINDOW_CAP)
def test_reference_window_and_soft_cap_match_naive(window, cap):
    """The oracle with a sliding window shorter than the contexts and a logit soft cap, float32: decode
    rows (padding too), and prefill steps of prompts, chunks over a cached prefix, a mixed step's decodes
    and a speculative verification's rows, each query against the naive attention over the keys it sees."""
    d, bs, q_to_kv = 64, 16, [0, 0, 0, 1, 1, 1]
    (out, (q, kc, vc, bt, _, _)), *prefills = _window_outputs(ref.prefill_attention, ref.decode_attention, window, cap)
    flat_k, flat_v = kc.flatten(0, 1), vc.flatten(0, 1)
    want = [_naive(q[b], flat_k[s], flat_v[s], q_to_kv, d**-0.5, cap)
            for b, n in enumerate(DECODE_LENS) for s in [_visible_slots(bt, b, n - 1, bs, window) if n else []]]
    torch.testing.assert_close(out.double(), torch.stack(want), atol=1e-5, rtol=1e-5)
    for lens, (out, (q, _, _, kc, vc, cu_q, _, bt, _)) in zip(WINDOW_STEPS, prefills):
        flat_k, flat_v = kc.flatten(0, 1), vc.flatten(0, 1)
        want = [_naive(q[cu_q[b] + i], flat_k[s], flat_v[s], q_to_kv, d**-0.5, cap)
                for b, (lq, lk) in enumerate(lens) for i in range(lq)
                for s in [_visible_slots(bt, b, lk - lq + i, bs, window)]]
        torch.testing.assert_close(out.double(), torch.stack(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,cap", WINDOW_CAP)
@pytest.mark.parametrize("cpu_kernels", (True, False), ids=["C", "torch"])
def test_cpu_window_and_soft_cap_match_the_oracle(window, cap, cpu_kernels):
    """The CPU backend's float32 paths (SDPA under a window mask, explicit arithmetic with a cap; the
    prefix read from the window on; a mixed step's decodes and a verification's rows as decode rows)
    on the cases the oracle is checked on above."""
    want = _window_outputs(ref.prefill_attention, ref.decode_attention, window, cap)
    got = _window_outputs(cpu_prefill, cpu_decode, window, cap, cpu_kernels=cpu_kernels)
    for (g, _), (w, _) in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,cap", WINDOW_CAP[1:])
@pytest.mark.parametrize("cpu_kernels", (True, False), ids=["C", "torch"])
def test_window_and_soft_cap_bfloat16_and_batched_prompts(window, cap, cpu_kernels):
    """bfloat16 through the CPU backend (the C decode kernel or the bmm path; same-length prompts as
    one batched call; chunks over a prefix) against the float32 oracle of the same inputs, within
    bfloat16 rounding; and the window reads no block before it (those block-table entries are -1)."""
    d, bs, q_to_kv = 64, 16, [0, 0, 1, 1]
    kw = dict(sliding_window=window, soft_cap=cap)
    half = [t.bfloat16() if t.is_floating_point() else t for t in _decode_case(d, bs, q_to_kv, seed=13)]
    q, kc, vc, bt, ctx, qkv = half
    if window is not None:  # free the blocks wholly before each sequence's window
        for b, n in enumerate(ctx.tolist()):
            bt[b, : max(0, n - window) // bs] = -1
    want = ref.decode_attention(q.float(), kc.float(), vc.float(), bt, ctx, qkv, d**-0.5, **kw)
    got = cpu_decode(q, kc, vc, bt, ctx, qkv, d**-0.5, cpu_kernels=cpu_kernels, **kw)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    for lens in ([(24, 24)] * 3, [(17, 40), (2, 70), (1, 33), (30, 30)]):
        half = [t.bfloat16() if t.is_floating_point() else t for t in _prefill_case(d, bs, q_to_kv, lens, seed=14)]
        want = ref.prefill_attention(*[t.float() if t.is_floating_point() else t for t in half], d**-0.5, **kw)
        got = cpu_prefill(*half, d**-0.5, cpu_kernels=cpu_kernels, **kw)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_window_and_cap_change_the_result_and_none_is_the_default():
    """The window and the cap are not no-ops on these cases, and None for both is the plain call bit for bit."""
    d, bs, q_to_kv = 64, 16, [0, 1]
    case = _decode_case(d, bs, q_to_kv, seed=15)
    plain = cpu_decode(*case, d**-0.5)
    assert torch.equal(cpu_decode(*case, d**-0.5, sliding_window=None, soft_cap=None), plain)
    for kw in (dict(sliding_window=7), dict(soft_cap=2.0)):
        for f in (cpu_decode, ref.decode_attention):
            diff = (f(*case, d**-0.5, **kw) - plain).abs().amax(dim=(1, 2))
            assert (diff[torch.tensor(DECODE_LENS) > 7] > 1e-3).all()
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1; got 0"):
        ref.decode_attention(*case, d**-0.5, sliding_window=0)
    with pytest.raises(ValueError, match="logit_soft_cap must be None or a finite number > 0; got -1.0"):
        ref.decode_attention(*case, d**-0.5, soft_cap=-1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_one_step_serves_sliding_and_full_layers(dtype):
    """Gemma 2's alternation in one step's metadata: a decode step (with KV mirrors, bfloat16) and a
    prefill step with a mixed step's decode rows, each prepared once, serve full and sliding layers
    (two window values) in turn; each layer's result is the oracle's for its own window, and the
    window-dependent key masks are made once per window value."""
    d, bs, q_to_kv = 64, 16, [0, 0, 1, 1]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    layers = [(None, 2.0), (7, 2.0), (None, None), (33, None), (7, 2.0)]
    be = CPUAttentionBackend(cpu_kernels=True, kv_mirror=True)
    q, kc, vc, bt, ctx, qkv = (t.to(dtype) if t.is_floating_point() else t
                               for t in _decode_case(d, bs, q_to_kv, seed=18))
    attn = be.prepare(False, _none_slots(q.shape[0]), bt, None, None, ctx)
    from tpengine.backends.cpu.kv_mirror import KVMirror
    mirror = {w: KVMirror() for w, _ in layers}
    for window, cap in layers:
        got = be.decode_attention(q, kc, vc, qkv, d**-0.5, attn, mirror[window], window, cap)
        want = ref.decode_attention(q.float(), kc.float(), vc.float(), bt, ctx, qkv, d**-0.5, window, cap)
        torch.testing.assert_close(got.float(), want, **tol)
    masks = [key for key in attn.derived if key[0] == "key-mask"]
    assert sorted(masks, key=str) == sorted({("key-mask", masks[0][1], w) for w, _ in layers}, key=str)
    case = [t.to(dtype) if t.is_floating_point() else t for t in _prefill_case(d, bs, q_to_kv, MIXED_LENS, seed=19)]
    q, k, v, kc, vc, cu_q, cu_k, bt, qkv = case
    attn = be.prepare(True, _none_slots(q.shape[0]), bt, cu_q, cu_k, None)
    assert attn.decodes is not None
    for window, cap in layers:
        got = be.prefill_attention(q, k, v, kc, vc, qkv, d**-0.5, attn, window, cap)
        want = ref.prefill_attention(*[t.float() if t.is_floating_point() else t for t in case], d**-0.5,
                                     window, cap)
        torch.testing.assert_close(got.float(), want, **tol)


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
                                   pytest.param(lambda *a: cpu_store(*a, cpu_kernels=False), id="cpu-torch")])
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


@pytest.mark.parametrize("q_to_kv", [[0, 0, 0, 1, 1, 1], [0, 1, 1, 0]], ids=["gqa3", "uneven"])
@pytest.mark.parametrize("cpu_kernels", (True, False), ids=["C-softmax", "torch-softmax"])
def test_cpu_prefill_half_batched(q_to_kv, cpu_kernels):
    """Same-length prompts in bfloat16 take the CPU backend's matmul path (HF eager's arithmetic):
    equal to the float32 oracle within bfloat16 rounding, and causal (a changed last key leaves
    earlier rows)."""
    d, bs, lens = 64, 16, [(20, 20)] * 3
    case = list(_prefill_case(d, bs, q_to_kv, lens, seed=7))
    half = [t.bfloat16() if t.is_floating_point() else t for t in case]
    out = cpu_prefill(*half, d**-0.5, cpu_kernels=cpu_kernels)
    assert out.dtype == torch.bfloat16 and out.shape == case[0].shape
    want = ref.prefill_attention(*[t.float() if t.is_floating_point() else t for t in half], d**-0.5)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    half[1] = half[1].clone()
    half[1][19] += 1.0  # sequence 0's last key: only its last query sees it
    changed = (cpu_prefill(*half, d**-0.5, cpu_kernels=cpu_kernels) != out).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == [19]


def test_mixed_step_decodes_take_the_decode_path():
    """The leading one-token sequences of a prefill step are batched through the decode path."""
    q, k, v, kc, vc, cu_q, cu_k, bt, qkv = _prefill_case(64, 16, [0, 1, 1, 1], MIXED_LENS)
    be = CPUAttentionBackend(cpu_kernels=True)
    attn = be.prepare(True, torch.full((q.shape[0],), -1), bt, cu_q, cu_k, None)
    assert attn.decodes.context_lens.tolist() == [33, 16, 70]
    assert (attn.decodes.min_ctx, attn.decodes.max_ctx, attn.decodes.is_prefill) == (16, 70, False)
    one = _prefill_case(64, 16, [0, 1], [(1, 33), (17, 40)])
    assert be.prepare(True, torch.full((18,), -1), one[7], one[5], one[6], None).decodes is None  # one decode
    # a verification: every token of the leading sequences is a decode row over its context so far
    q, k, v, kc, vc, cu_q, cu_k, bt, qkv = _prefill_case(64, 16, [0, 1, 1, 1], VERIFY_LENS)
    attn = be.prepare(True, torch.full((q.shape[0],), -1), bt, cu_q, cu_k, None)
    assert attn.decode_seqs == 4 and attn.decodes.context_lens.tolist() == (
        [36, 37, 38, 39, 40, 33, 68, 69, 70] + list(range(33, 49)))
    assert torch.equal(attn.decodes.block_tables, bt[[0] * 5 + [1] + [2] * 3 + [3] * 16])
    assert attn.path == "prefill"  # a chunk and a prompt follow
    # a step of decode rows only takes the paged C kernel (once bind_model bound it for every layer), its
    # index one row per token
    q, k, v, kc, vc, cu_q, cu_k, bt, qkv = _prefill_case(64, 16, [0, 1, 1, 1], VERIFY_LENS[:3])
    paged = CPUAttentionBackend(cpu_kernels=True, paged=True)
    assert paged.prepare(True, torch.arange(q.shape[0]), bt, cu_q, cu_k, None).path == "prefill"  # not bound
    paged.paged_calls = {0: None}  # as bind_model leaves it for a model whose every layer the kernel takes
    attn = paged.prepare(True, torch.arange(q.shape[0]), bt, cu_q, cu_k, None)
    assert attn.path == "paged" and attn.paged_index.context_lens.tolist() == [36, 37, 38, 39, 40, 33, 68, 69, 70]
    assert torch.equal(attn.paged_index.block_tables, bt[[0] * 5 + [1] + [2] * 3])
    assert attn.paged_index.slot_mapping.tolist() == list(range(9))


def test_prepare_is_per_step_and_per_backend(monkeypatch):
    """Two CPU backends in one process with different cpu_kernels/kv_mirror settings, their steps
    interleaved: each step's metadata comes from its own backend's prepare, one backend's prefill
    does not break the other's mirror continuity, and the cpu_kernels=False one makes no C call."""
    from tpengine.backends.cpu import cpu_library
    from tpengine.backends.cpu.kv_mirror import KVMirror

    if cpu_library.missing("tpe_decode_scores"):
        pytest.skip(cpu_library.missing("tpe_decode_scores"))
    calls, real = [], cpu_library.load()

    class Counting:
        def __getattr__(self, name):
            return lambda *a: calls.append(name) or getattr(real, name)(*a)

    monkeypatch.setattr(cpu_library, "_lib", Counting())
    g, bs, hkv, d = _gen(9), 16, 2, 64
    kc, vc = (torch.randn(16, bs, hkv, d, generator=g).bfloat16() for _ in "kv")
    bt = torch.arange(8).view(2, 4)
    qkv = torch.tensor([0, 0, 1, 1])
    plain = CPUAttentionBackend(cpu_kernels=False, kv_mirror=False)
    fast = CPUAttentionBackend(cpu_kernels=True, kv_mirror=True)
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
        assert len(calls) == n  # cpu_kernels=False: torch only
        got_fast = fast.decode_attention(q, kc, vc, qkv, d**-0.5, a_fast, mirror_fast)
        assert "tpe_decode_scores" in calls[n:]
        torch.testing.assert_close(got_plain.float(), got_fast.float(), rtol=2e-2, atol=2e-2)  # SDPA vs C
    assert mirror_plain.stats == {"rebuilds": 0, "growths": 0, "appends": 0}
    assert mirror_fast.stats == {"rebuilds": 1, "growths": 1, "appends": 3}  # 33 tokens at step 3 > capacity 32
