"""The paged decode C kernel (tpengine/backends/cpu/csrc/cpu_paged.c): RoPE, KV store and attention of one
layer's decode step in one call, against the torch oracle (tpengine.backends.reference) and the
torch path's RoPE, in float32 and bfloat16, with the kernel-test shapes (GQA, uneven and
replicated KV-head maps, block boundaries, a padding row)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import CONFIGS, DECODE_LENS, WINDOW_CAP, _cache, _gen, _slot

from tpengine.backends import reference as ref
from tpengine.backends.cpu import cpu_library, cpu_paged

# measured choices are among this module's subjects: no measuring budget (conftest's default is 0: nothing
# measured)
pytestmark = pytest.mark.usefixtures("measuring")

# the kernel's tests; paged_index and choose_amx (None without AMX) run on every machine
needs_kernels = pytest.mark.skipif(cpu_library.missing("tpe_paged_decode_f32", "tpe_paged_decode_bf16") is not None,
                                   reason=str(cpu_library.missing("tpe_paged_decode_f32", "tpe_paged_decode_bf16")))


def rope(x, cos, sin):
    """HF's ``x * cos + rotate_half(x) * sin`` per head, in x's dtype: ``x [B, H, D]``, ``cos [B, D]``."""
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


def case(d, bs, q_to_kv, dtype, seed=0, lens=DECODE_LENS):
    g = _gen(seed)
    hq, hkv = len(q_to_kv), max(q_to_kv) + 1
    kc, vc, bt = _cache(lens, bs, hkv, d, g)
    b = len(lens)
    qkv = torch.randn(b, hq + 2 * hkv, d, generator=g).to(dtype)  # the fused q/k/v GEMM output
    pos = torch.tensor([max(n - 1, 0) for n in lens])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    slots = torch.tensor([_slot(bt, i, n - 1, bs) if n else -1 for i, n in enumerate(lens)])
    return (qkv, ang.cos().to(dtype), ang.sin().to(dtype), kc.to(dtype), vc.to(dtype), bt, slots,
            torch.tensor(lens), torch.tensor(q_to_kv))


def views(qkv, hq, hkv):
    return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d, bs, q_to_kv", CONFIGS)
def test_paged_decode_equals_rope_store_and_reference_attention(d, bs, q_to_kv, dtype):
    qkv, cos, sin, kc, vc, bt, slots, lens, qkv_map = case(d, bs, q_to_kv, dtype)
    hq, hkv = len(q_to_kv), max(q_to_kv) + 1
    # the oracle: torch RoPE, the reference store, the reference attention (float32 math)
    q0, k0, v0 = (x.clone() for x in views(qkv, hq, hkv))
    q0, k0 = rope(q0, cos, sin), rope(k0, cos, sin)
    kc0, vc0 = kc.clone(), vc.clone()
    ref.store_kvcache(k0, v0, kc0, vc0, slots)
    want = ref.decode_attention(q0.float(), kc0.float(), vc0.float(), bt, lens, qkv_map, d ** -0.5)

    q, k, v = views(qkv, hq, hkv)
    out = cpu_paged.decode(q, k, v, cos, sin, kc, vc, qkv_map, d ** -0.5, cpu_paged.paged_index(slots, bt, lens))
    assert out.shape == (len(DECODE_LENS), hq, d) and out.dtype == dtype
    # RoPE in place, op by op as torch rounds it; the cache written exactly
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), want, **tol)
    assert torch.equal(out[DECODE_LENS.index(0)], torch.zeros(hq, d, dtype=dtype))  # padding row


@needs_kernels
@pytest.mark.parametrize("threads", [1, 4])  # 1: a work item per sequence; 4 (B < 4 x threads): per (sequence, KV head)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window,cap", WINDOW_CAP)
def test_paged_decode_with_window_and_soft_cap_equals_the_reference(window, cap, dtype, threads):
    """A sliding window shorter than the contexts and a logit soft cap, through ``decode`` and a bound
    call: the reference attention of each sequence (decode rows of several lengths, a padding row, and a
    speculative verification's rows, each its own context length over one block table), with the
    blocks wholly before every row's window freed (-1 in the table: never read or checked); a many-
    sequence batch. float32 within 1e-5, bfloat16 within its rounding."""
    d, bs, q_to_kv = 64, 16, [0, 0, 0, 1, 1, 1]
    hq, hkv = len(q_to_kv), max(q_to_kv) + 1
    verify = [36, 37, 38, 39, 40]  # one sequence's rows: its last token and four proposed ones
    lens = DECODE_LENS + [1000, 129] + verify  # 1000: past the bfloat16 fetch-ahead budget
    qkv, cos, sin, kc, vc, bt, slots, lens_t, qkv_map = case(d, bs, q_to_kv, dtype, seed=21, lens=lens)
    v0 = len(lens) - len(verify)
    bt[v0:] = bt[v0]  # the verification's rows share a table: their slots are consecutive positions
    slots[v0:] = torch.tensor([_slot(bt, v0, n - 1, bs) for n in verify])
    if window is not None:
        low = min(verify) - window  # the blocks before the first verification row's window
        bt[v0:, : max(low, 0) // bs] = -1
        for b, n in enumerate(lens[:v0]):
            bt[b, : max(n - window, 0) // bs] = -1
    q0, k0, v0_ = (x.clone() for x in views(qkv, hq, hkv))
    q0, k0 = rope(q0, cos, sin), rope(k0, cos, sin)
    kc0, vc0 = kc.clone(), vc.clone()
    ref.store_kvcache(k0, v0_, kc0, vc0, slots)
    want = ref.decode_attention(q0.float(), kc0.float(), vc0.float(), bt, lens_t, qkv_map, d ** -0.5,
                                sliding_window=window, soft_cap=cap)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run = cpu_paged.bind(kc, vc, qkv_map, d ** -0.5, 0, window or 0, cap or 0.0)
        out = run(qkv.flatten(1), cpu_paged.Rope((cos, sin), dtype), cpu_paged.paged_index(slots, bt, lens_t))
    finally:
        torch.set_num_threads(before)
    out = out.view(len(lens), hq, d)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), want, **tol)
    assert torch.equal(out[DECODE_LENS.index(0)], torch.zeros(hq, d, dtype=dtype))  # padding row
    if dtype == torch.float32 and threads == 1:  # decode() itself, RoPE already applied: the same result
        q, k, v = (x.clone() for x in views(qkv, hq, hkv))
        again = cpu_paged.decode(q, k, v, None, None, kc, vc, qkv_map, d ** -0.5,
                                 cpu_paged.paged_index(torch.full_like(slots, -1), bt, lens_t),
                                 sliding_window=window, soft_cap=cap)
        assert torch.equal(again, out)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_backend_binds_each_layers_window_and_cap(monkeypatch, dtype):
    """A model of full and sliding layers through the CPU backend's ``forward``: ``bind_model`` binds each
    layer's paged call with its own window and cap, one decode step's metadata serves every layer, and each
    layer's output is the torch path's (C kernels off) and the reference's for its window and cap."""
    from types import SimpleNamespace

    from tpengine.backends.cpu import layer_calls
    from tpengine.backends.cpu.attention import CPUAttentionBackend
    from tpengine.backends.torch_ops import TorchOps

    monkeypatch.setattr(layer_calls, "bind_stack", lambda stack, cpu_kernels: 0)  # no norms or MLPs here
    d, bs, q_to_kv = 64, 16, [0, 0, 1, 1]
    specs = [(None, None), (7, 2.0), (33, None), (None, 2.0)]
    qkv, cos, sin, kc, vc, bt, slots, lens, qkv_map = case(d, bs, q_to_kv, dtype, seed=23)
    g = _gen(24)

    def stack():
        attns = [SimpleNamespace(num_heads=4, num_key_value_heads=2, head_dim=d, ops=TorchOps(), layer_idx=i,
                                 k_cache=torch.randn(kc.shape, generator=_gen(30 + i)).to(dtype),
                                 v_cache=torch.randn(vc.shape, generator=_gen(40 + i)).to(dtype),
                                 tp_q_to_kv=qkv_map, scaling=d ** -0.5, sliding_window=w, logit_soft_cap=c)
                 for i, (w, c) in enumerate(specs)]
        return SimpleNamespace(layers=[SimpleNamespace(self_attn=a) for a in attns],
                               config=SimpleNamespace(num_hidden_layers=len(attns)))

    inputs = [torch.randn(qkv.shape, generator=g).to(dtype).flatten(1) for _ in specs]
    outs = {}
    for cpu_kernels in (True, False):
        be, st = CPUAttentionBackend(cpu_kernels=cpu_kernels, kv_mirror=False, paged=True), stack()
        be.bind_model(st, 1)
        ctx = SimpleNamespace(attn=be.prepare(False, slots, bt, None, None, lens), is_prefill=False)
        assert ctx.attn.path == ("paged" if cpu_kernels else "gathered")
        outs[cpu_kernels] = [be.forward(x.clone(), (cos, sin), layer.self_attn, ctx).float()
                             for x, layer in zip(inputs, st.layers)]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for i, (w, c) in enumerate(specs):
        layer = stack().layers[i].self_attn
        q, k, v = (x.clone() for x in views(inputs[i].view(len(lens), 8, d), 4, 2))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        ref.store_kvcache(k, v, layer.k_cache, layer.v_cache, slots)
        want = ref.decode_attention(q.float(), layer.k_cache.float(), layer.v_cache.float(), bt, lens, qkv_map,
                                    d ** -0.5, w, c).flatten(1)
        torch.testing.assert_close(outs[True][i], want, **tol)
        torch.testing.assert_close(outs[False][i], want, **tol)


@needs_kernels
def test_paged_decode_window_and_cap_errors():
    """A window or cap the kernel cannot take is refused by name; a block the window needs is still checked."""
    qkv, cos, sin, kc, vc, bt, slots, lens, qkv_map = case(64, 16, [0, 1], torch.float32)
    q, k, v = views(qkv, 2, 2)
    index = cpu_paged.paged_index(slots, bt, lens)
    with pytest.raises(ValueError, match=r"^sliding_window must be None or an int >= 1; got -3$"):
        cpu_paged.decode(q, k, v, cos, sin, kc, vc, qkv_map, 0.125, index, sliding_window=-3)
    with pytest.raises(ValueError, match=r"^logit_soft_cap must be None or a finite number > 0; got inf$"):
        cpu_paged.bind(kc, vc, qkv_map, 0.125, 0, 0, float("inf"))
    table = bt.clone()
    table[5, 4] = -1  # sequence 5 (70 keys) needs its block 4 (keys 64..69) under a window of 7
    with pytest.raises(IndexError, match=r"^paged decode: block_tables\[5\] = "):
        cpu_paged.decode(q, k, v, cos, sin, kc, vc, qkv_map, 0.125, cpu_paged.paged_index(slots, table, lens),
                         sliding_window=7)


@needs_kernels
def test_paged_decode_without_rope_and_bfloat16_matches_the_torch_decode_path():
    """bfloat16 without RoPE against the CPU backend's own C decode path (the arithmetic it
    replaces): bf16-rounded scores and probabilities, float32 accumulation."""
    from kernel_cases import cpu_decode

    qkv, _, _, kc, vc, bt, slots, lens, qkv_map = case(64, 16, [0, 0, 0, 1, 1, 1], torch.bfloat16, seed=4)
    q, k, v = views(qkv, 6, 2)
    none = torch.full_like(slots, -1)
    out = cpu_paged.decode(q, k, v, None, None, kc, vc, qkv_map, 0.125, cpu_paged.paged_index(none, bt, lens))
    want = cpu_decode(q.contiguous(), kc, vc, bt, lens, qkv_map, 0.125)
    assert (out.float() - want.float()).abs().max().item() <= 2 ** -7 * want.float().abs().max().item()


@needs_kernels
def test_paged_decode_bad_indices_raise_before_anything_is_written():
    qkv, cos, sin, kc, vc, bt, slots, lens, qkv_map = case(64, 16, [0, 1], torch.float32)
    q, k, v = views(qkv, 2, 2)
    nb, bs = kc.shape[:2]
    before = (qkv.clone(), kc.clone(), vc.clone())

    def run(s=slots, t=bt, n=lens):
        with pytest.raises(IndexError) as e:
            cpu_paged.decode(q, k, v, cos, sin, kc, vc, qkv_map, 0.125, cpu_paged.paged_index(s, t, n))
        assert torch.equal(kc, before[1]) and torch.equal(vc, before[2])
        return str(e.value)

    bad = slots.clone()
    bad[2] = nb * bs
    assert run(s=bad) == f"paged decode: slot_mapping[2] = {nb * bs} is out of range; valid: [-1, {nb * bs})"
    long = lens.clone()
    long[1] = bt.shape[1] * bs + 1
    assert run(n=long) == (f"paged decode: context_lens[1] = {bt.shape[1] * bs + 1} is out of range; valid: "
                           f"[0, {bt.shape[1] * bs}]")
    table = bt.clone()
    table[3, 0] = nb
    assert run(t=table) == (f"paged decode: block_tables[3] = {table[3].tolist()} is out of range; valid: "
                            f"[0, {nb}) for the blocks a sequence's length covers")
    with pytest.raises(ValueError, match=r"k_cache must be contiguous"):
        cpu_paged.decode(q, k, v, cos, sin, kc.transpose(0, 1), vc, qkv_map, 0.125,
                         cpu_paged.paged_index(slots, bt, lens))


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_decode_steps_take_the_paged_kernel_once_per_layer(tmp_path, monkeypatch, dtype):
    """In the engine every decode step calls the paged kernel once per layer (2 layers x 5 decode
    steps for 6 tokens), and the tokens equal the torch path's (``cpu_kernels=False``)."""
    from conftest import make_tiny_model

    from tpengine.config import EngineConfig
    from tpengine.engine.llm_engine import LLMEngine
    from tpengine.sampling_params import SamplingParams

    model = make_tiny_model(tmp_path, "llama", seed=5, head_dim=32)
    calls = []
    real = cpu_paged.bind  # each layer's bound call (the CPU backend's bind_model): count its [B, Hq, D]

    def bind(k_cache, v_cache, q_to_kv, scale, *amx):
        run = real(k_cache, v_cache, q_to_kv, scale, *amx)
        return lambda qkv, *a: calls.append((qkv.shape[0], q_to_kv.shape[0], k_cache.shape[3])) or run(qkv, *a)
    monkeypatch.setattr(cpu_paged, "bind", bind)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for cpu_kernels in (True, False):
        eng = LLMEngine(EngineConfig(model=str(model), dtype=dtype, cpu_kernels=cpu_kernels, num_kv_blocks=16,
                                     max_model_len=64))
        tokens[cpu_kernels] = eng.generate([("a", [5, 6, 7, 8, 9], params)])[0].token_ids
        eng.shutdown()
        if cpu_kernels:
            assert calls == [(1, 4, 32)] * (2 * 5)  # [B, Hq, D] of the tiny Llama
    assert len(calls) == 10 and tokens[True] == tokens[False] and len(tokens[True]) == 6


@needs_kernels
def test_paged_decode_refuses_a_bad_head_map():
    qkv, cos, sin, kc, vc, bt, slots, lens, _ = case(64, 16, [0, 1], torch.float32)
    q, k, v = views(qkv, 2, 2)
    with pytest.raises(ValueError) as e:
        cpu_paged.decode(q, k, v, cos, sin, kc, vc, torch.tensor([0, 2]), 0.125,
                         cpu_paged.paged_index(slots, bt, lens))
    assert str(e.value) == ("paged decode: q_to_kv [0, 2] must map each of the 2 query heads to a KV head in "
                            "[0, 2), at most 16 on one")


def test_paged_index_is_checked_once_for_the_step():
    _, _, _, _, _, bt, slots, lens, _ = case(64, 16, [0, 1], torch.float32)
    index = cpu_paged.paged_index(slots, bt.t().contiguous().t(), lens)  # any strides: made contiguous
    assert index.block_tables.is_contiguous() and torch.equal(index.block_tables, bt)
    with pytest.raises(ValueError) as e:
        cpu_paged.paged_index(slots, bt, lens[:-1])
    assert str(e.value) == ("paged decode: int64 slot_mapping [B], block_tables [B, max_blocks], context_lens [B]; "
                            f"got [(torch.int64, (7,)), (torch.int64, {tuple(bt.shape)}), (torch.int64, (6,))]")


AMX = cpu_paged.amx_available()


@needs_kernels
@pytest.mark.skipif(not AMX, reason="the paged kernel's AMX path needs AMX-BF16 (Sapphire Rapids or later)")
@pytest.mark.parametrize("d, bs, q_to_kv", [c for c in CONFIGS if c.values[1] % 16 == 0 and c.values[0] <= 128])
def test_paged_decode_amx_path_equals_the_reference_and_the_avx512_path(d, bs, q_to_kv):
    """bfloat16: the AMX path (from one sequence on) against the reference attention, as the
    AVX-512 path is tested above, and against the AVX-512 path itself (the same roundings; the
    float32 sums in another order may move a bfloat16 output by one ulp)."""
    hq, hkv = len(q_to_kv), max(q_to_kv) + 1
    outs = []
    for min_batch in (0, 1):
        qkv, cos, sin, kc, vc, bt, slots, lens, qkv_map = case(d, bs, q_to_kv, torch.bfloat16)
        q0, k0, v0 = (x.clone() for x in views(qkv, hq, hkv))
        q0, k0 = rope(q0, cos, sin), rope(k0, cos, sin)
        kc0, vc0 = kc.clone(), vc.clone()
        ref.store_kvcache(k0, v0, kc0, vc0, slots)
        want = ref.decode_attention(q0.float(), kc0.float(), vc0.float(), bt, lens, qkv_map, d ** -0.5)
        q, k, v = views(qkv, hq, hkv)
        out = cpu_paged.decode(q, k, v, cos, sin, kc, vc, qkv_map, d ** -0.5, cpu_paged.paged_index(slots, bt, lens),
                               amx_min_batch=min_batch)
        assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
        assert torch.equal(out[DECODE_LENS.index(0)], torch.zeros(hq, d, dtype=torch.bfloat16))
        outs.append(out)
    ulp = outs[0].float().abs().clamp_min(2 ** -126) * 2 ** -7  # one bfloat16 ulp (at most)
    assert ((outs[1].float() - outs[0].float()).abs() <= ulp).all()


@needs_kernels
@pytest.mark.parametrize("window,cap", [pytest.param(None, None, id="full"), pytest.param(20, 2.0, id="window20-cap2")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d, bs, q_to_kv", CONFIGS)
def test_work_items_of_whole_sequences_or_of_kv_heads_give_the_same_bits(d, bs, q_to_kv, dtype, window, cap):
    """At 1 thread the 7 sequences of DECODE_LENS are >= 4 x threads, so a kernel that takes a whole sequence as its
    work item there takes it (the AVX2 kernel where every KV head has the same query heads, 1-4 of them: all but
    the uneven and replicated maps; the AVX-512 one in bfloat16); at 4 threads each item is one (sequence, KV head).
    Each head's arithmetic is the same either way, so the outputs are equal bit for bit."""
    qkv, cos, sin, kc, vc, bt, slots, lens, qkv_map = case(d, bs, q_to_kv, dtype, seed=5)
    hq, hkv = len(q_to_kv), max(q_to_kv) + 1
    index = cpu_paged.paged_index(slots, bt, lens)
    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 4):
            torch.set_num_threads(threads)
            q, k, v = (x.clone() for x in views(qkv, hq, hkv))
            outs.append(cpu_paged.decode(q, k, v, cos, sin, kc.clone(), vc.clone(), qkv_map, d ** -0.5, index,
                                         sliding_window=window, soft_cap=cap))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    assert outs[0].abs().sum() > 0 and torch.equal(outs[0][DECODE_LENS.index(0)], torch.zeros(hq, d, dtype=dtype))


MANY_LENS = DECODE_LENS * 3 + [1000, 1, 129]  # 24 sequences (one work item each); 1000: past the fetch-ahead budget


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("path", ["f32", "bf16", "bf16-amx"])
def test_paged_decode_of_many_sequences_claims_every_item_once(path, threads):
    """A batch of many sequences (a work item per sequence, whole K/V rows; each thread claims its
    next item one ahead and fetches its rows while computing the current one) gives the reference
    attention for every sequence, whatever the thread count, lengths (a long one, padding rows)
    and path."""
    if path == "bf16-amx" and not AMX:
        pytest.skip("the paged kernel's AMX path needs AMX-BF16 (Sapphire Rapids or later)")
    dtype = torch.float32 if path == "f32" else torch.bfloat16
    q_to_kv = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    qkv, cos, sin, kc, vc, bt, slots, lens, qkv_map = case(64, 16, q_to_kv, dtype, seed=3, lens=MANY_LENS)
    q0, k0, v0 = (x.clone() for x in views(qkv, 9, 3))
    q0, k0 = rope(q0, cos, sin), rope(k0, cos, sin)
    kc0, vc0 = kc.clone(), vc.clone()
    ref.store_kvcache(k0, v0, kc0, vc0, slots)
    want = ref.decode_attention(q0.float(), kc0.float(), vc0.float(), bt, lens, qkv_map, 0.125)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v = views(qkv, 9, 3)
        out = cpu_paged.decode(q, k, v, cos, sin, kc, vc, qkv_map, 0.125, cpu_paged.paged_index(slots, bt, lens),
                               amx_min_batch=1 if path == "bf16-amx" else 0)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), want, **tol)
    assert (out[lens == 0] == 0).all() and int((lens == 0).sum()) == 3


def test_choose_amx_measures_both_paths_and_names_the_batch_to_pass(monkeypatch):
    from tpengine.backends.cpu import measured

    monkeypatch.setattr(measured, "probe_busy", lambda: False)  # a quiet start: both paths are timed
    choice = cpu_paged.choose_amx(torch.tensor([0, 0, 0, 1, 1, 1]), 2, 64, 16, batches=(1, 4), context=40, layers=2)
    if not AMX:
        assert choice is None and cpu_paged.amx_min_batch(choice) == 0
        return
    assert set(choice.times_us) == {"avx512", "amx"} and all(len(t) == 2 for t in choice.times_us.values())
    assert (choice.name, cpu_paged.amx_min_batch(choice)) in (("avx512", 0), ("amx from B >= 1", 1),
                                                              ("amx from B >= 4", 4))
    assert cpu_paged.choose_amx(torch.tensor([0, 0]), 1, 64, 8) is None  # block size not a multiple of 16


def test_amx_min_batch_reads_the_batch_off_a_choice():
    """The decode argument a measured choice names (given choices: no timing)."""
    from tpengine.backends.cpu.measured import Choice

    assert [cpu_paged.amx_min_batch(c) for c in (None, Choice("avx512", "cached"), Choice("amx from B >= 8", "cached"))
            ] == [0, 0, 8]
