"""The decode KV mirror (tpengine/backends/cpu/kv_mirror.py): across decode steps of one batch the CPU
backend's bfloat16 decode attention appends one token per sequence instead of gathering the
context, and its outputs are bit-identical to a fresh gather's and to the mirror-off path's,
through capacity growth, a batch change and a prefill that rewrote cached tokens, on both
attention branches. Continuity is decided by the backend's per-step ``prepare``; each layer owns
its :class:`KVMirror` (with its own counters)."""

from __future__ import annotations

import pytest
import torch

from tpengine.backends.cpu import kv_mirror
from tpengine.backends.cpu.attention import CPUAttentionBackend
from tpengine.backends.cpu.kv_mirror import KVMirror

BS, D = 16, 64


def _setup(lens, extra, hkv, seed, spare=0):
    """bf16 caches with room for ``extra`` more tokens per sequence (+ ``spare`` unused blocks)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(n + extra) // BS) for n in lens]
    perm = torch.randperm(sum(need) + spare, generator=g)
    bt = torch.full((len(lens), max(need)), -1, dtype=torch.int64)
    used = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[used:used + n]
        used += n
    kc = torch.randn(sum(need) + spare, BS, hkv, D, generator=g).bfloat16()
    vc = torch.randn(sum(need) + spare, BS, hkv, D, generator=g).bfloat16()
    return kc, vc, bt, g


def _store(kc, vc, bt, lens, g):
    """Write one new token per sequence at position ``lens[b]`` (as the engine's decode step does)."""
    hkv = kc.shape[2]
    slots = torch.tensor([int(bt[b, n // BS]) * BS + n % BS for b, n in enumerate(lens)])
    k, v = (torch.randn(len(lens), hkv, D, generator=g).bfloat16() for _ in range(2))
    be = CPUAttentionBackend()
    be.store_kvcache(k, v, kc, vc, be.prepare(False, slots, bt, None, None, torch.tensor(lens) + 1))


def _prefill(be):
    """A (one-token, store-nothing) prefill step through ``be``: the next decode step rebuilds."""
    one = torch.tensor([0, 1])
    be.prepare(True, torch.tensor([-1]), torch.zeros(1, 1, dtype=torch.int64), one, one, None)


def _decode(be, q, kc, vc, tables, ctx, qkv, mirror=None, attn=None):
    """One decode step's attention through ``be`` (``attn``: the step's metadata, else prepared here)."""
    if attn is None:
        attn = be.prepare(False, torch.full((q.shape[0],), -1), tables, None, None, ctx)
    return be.decode_attention(q, kc, vc, qkv, D**-0.5, attn, mirror)


def _oracle(q, kc, vc, tables, ctx, qkv):
    from tpengine.backends import reference as ref

    return ref.decode_attention(q.float(), kc.float(), vc.float(), tables, ctx, qkv, D**-0.5)


@pytest.mark.parametrize("lens,q_to_kv", [([20, 31, 33, 1, 47], [0, 0, 1, 1]), ([5, 40], [0, 1, 1])],
                         ids=["bmm-path", "sdpa-path"])
def test_mirror_matches_fresh_gather(lens, q_to_kv):
    hkv, steps = max(q_to_kv) + 1, 40
    kc, vc, bt, g = _setup(lens, steps, hkv, seed=3, spare=16)  # mirrors fit: 5 x 96 <= 39 x 16 slots
    lens, rows = list(lens), list(range(len(lens)))
    qkv = torch.tensor(q_to_kv)
    be, off = CPUAttentionBackend(), CPUAttentionBackend(kv_mirror=False)  # EngineConfig(kv_mirror=False)
    mirror, fresh_mirrors = KVMirror(), []
    _prefill(be)
    cap, expect_rebuilds, expect_growths = 0, 0, 0  # the mirror's capacity as the module should grow it
    for step in range(steps):
        rebuild = step == 0
        if step == 20 and len(rows) > 2:  # a sequence finished: the batch shrinks, rows shift
            rows.pop(1)
            rebuild = True
        if step == 30:  # a prefill ran and rewrote a cached token of the first sequence
            kc[int(bt[rows[0], 0]), 3] += 1.0
            _prefill(be)
            rebuild = True
        _store(kc, vc, bt[rows], [lens[r] for r in rows], g)
        for r in rows:
            lens[r] += 1
        if rebuild or max(lens[r] for r in rows) > cap:
            cap = -(-max(lens[r] for r in rows) // kv_mirror.CHUNK) * kv_mirror.CHUNK
            expect_rebuilds += rebuild  # a gather from the paged cache
            expect_growths += not rebuild  # a copy of the old mirror into a larger one
        tables, ctx = bt[rows].clone(), torch.tensor([lens[r] for r in rows])  # fresh tensors per step
        q = torch.randn(len(rows), len(q_to_kv), D, generator=g).bfloat16()
        attn = be.prepare(False, torch.full((len(rows),), -1), tables, None, None, ctx)  # once per step
        got = _decode(be, q, kc, vc, tables, ctx, qkv, mirror, attn)
        fresh_mirrors.append(KVMirror())
        fresh = _decode(be, q, kc.clone(), vc.clone(), tables, ctx, qkv, fresh_mirrors[-1], attn)  # a gather
        assert torch.equal(got, fresh), f"step {step}"
        assert torch.equal(_decode(off, q, kc, vc, tables, ctx, qkv, KVMirror()), got), f"step {step}"
        if step in (0, 39):
            want = _oracle(q, kc, vc, tables, ctx, qkv)
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    made = {k: mirror.stats[k] + sum(m.stats[k] for m in fresh_mirrors) for k in mirror.stats}
    assert expect_rebuilds >= 2 and expect_growths >= 1  # the schedule: start, (shrink,) prefill; a growth
    # + 1 rebuild per `fresh` call (a new cache); a growth then appends
    assert made == {"rebuilds": steps + expect_rebuilds, "growths": expect_growths, "appends": steps - expect_rebuilds}


@pytest.mark.parametrize("why", ["disabled", "too-big"])
def test_mirror_not_used(why):
    """``EngineConfig(kv_mirror=False)`` (a backend made with ``kv_mirror=False``) or a batch whose
    mirrors would not fit in the size of the KV cache: every step gathers, the mirror is never
    touched, results are unchanged."""
    lens, q_to_kv = [20, 31, 33, 1, 47], [0, 0, 1, 1]
    kc, vc, bt, g = _setup(lens, 8, 2, seed=5)
    if why == "disabled":
        be = CPUAttentionBackend(kv_mirror=False)
    else:  # 5 x capacity(56) = 5 x 64 tokens > the cache's 14 blocks x 16 slots
        be = CPUAttentionBackend()
        assert len(lens) * kv_mirror.capacity(max(lens) + 8) > kc.shape[0] * BS
    _prefill(be)
    mirror = KVMirror()
    for _ in range(8):
        _store(kc, vc, bt, lens, g)
        lens = [n + 1 for n in lens]
        q = torch.randn(len(lens), len(q_to_kv), D, generator=g).bfloat16()
        args = (bt.clone(), torch.tensor(lens), torch.tensor(q_to_kv))
        got = _decode(be, q, kc, vc, *args, mirror)
        torch.testing.assert_close(got.float(), _oracle(q, kc, vc, *args), atol=2e-2, rtol=2e-2)
    assert mirror.stats == {"rebuilds": 0, "growths": 0, "appends": 0} and mirror.k is None


def test_bind_layer_gives_each_layer_its_own_mirror():
    """``bind_layer`` keeps a mirror per layer index in the backend (None with mirrors off)."""
    from types import SimpleNamespace

    a, b = SimpleNamespace(layer_idx=0), SimpleNamespace(layer_idx=1)
    be = CPUAttentionBackend()
    be.bind_layer(a)
    be.bind_layer(b)
    ma, mb = be.layer_state(a), be.layer_state(b)
    assert isinstance(ma, KVMirror) and isinstance(mb, KVMirror) and ma is not mb
    off = CPUAttentionBackend(kv_mirror=False)
    off.bind_layer(a)
    assert off.layer_state(a) is None
