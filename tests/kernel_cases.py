"""Shared cases for the paged-attention kernel tests (tests/test_kernels.py,
tests/test_triton_kernels.py): cache and token builders, a naive per-token oracle, the CPU backend
through the reference's call signatures, and the shape configurations.

Without CUDA the Triton kernels run on CPU tensors under the interpreter (TRITON_INTERPRET=1,
set before triton is first imported), in float32, on small shapes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tpengine.backends import reference as ref  # noqa: E402
from tpengine.backends.cpu.attention import CPUAttentionBackend  # noqa: E402

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

# a mixed step (chunked prefill): decodes first (one new token over a cache), then chunks and prompts
MIXED_LENS = [(1, 33), (1, 16), (1, 70), (17, 40), (2, 70), (15, 15)]

# a speculative verification first (each sequence's last token and up to 15 proposed ones over its
# cache: every token a decode row), then a 17-token chunk and a prompt, which keep the prefill path
VERIFY_LENS = [(5, 40), (1, 33), (3, 70), (16, 48), (17, 40), (2, 2)]


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


def _naive(qv, keys, values, q_to_kv, scale, soft_cap=None):
    """Dense attention of one query ``[Hq, D]`` over ``keys``/``values [L, Hkv, D]`` in float64 (scores
    capped to ``tanh(s / soft_cap) * soft_cap`` when given)."""
    out = torch.zeros(qv.shape, dtype=torch.float64)
    if keys.shape[0] == 0:
        return out
    for h, kvh in enumerate(q_to_kv):
        s = keys[:, kvh].double() @ qv[h].double() * scale
        if soft_cap is not None:
            s = torch.tanh(s / soft_cap) * soft_cap
        out[h] = torch.softmax(s, 0) @ values[:, kvh].double()
    return out


def _to(device, *ts):
    return [t.to(device) for t in ts]


# the CPU backend through the reference's call signatures (one step's prepare per call)
def _none_slots(n):
    return torch.full((n,), -1)


def cpu_store(k, v, kc, vc, slots, cpu_kernels=True):
    be = CPUAttentionBackend(cpu_kernels=cpu_kernels, kv_mirror=False)
    be.store_kvcache(k, v, kc, vc, be.prepare(False, slots, None, None, None, torch.zeros(0, dtype=torch.int64)))


def cpu_prefill(q, k, v, kc, vc, cu_q, cu_k, bt, qkv, scale, cpu_kernels=True, sliding_window=None, soft_cap=None):
    be = CPUAttentionBackend(cpu_kernels=cpu_kernels)
    attn = be.prepare(True, _none_slots(q.shape[0]), bt, cu_q, cu_k, None)
    return be.prefill_attention(q, k, v, kc, vc, qkv, scale, attn, sliding_window, soft_cap)


def cpu_decode(q, kc, vc, bt, ctx, qkv, scale, cpu_kernels=True, sliding_window=None, soft_cap=None):
    be = CPUAttentionBackend(cpu_kernels=cpu_kernels)
    attn = be.prepare(False, _none_slots(q.shape[0]), bt, None, None, ctx)
    return be.decode_attention(q, kc, vc, qkv, scale, attn, None, sliding_window, soft_cap)


ORACLE = (ref.store_kvcache, ref.prefill_attention, ref.decode_attention)


CPU = (cpu_store, cpu_prefill, cpu_decode)


IMPLS = [pytest.param(ORACLE, id="oracle"), pytest.param(CPU, id="cpu-backend")]


# (sliding_window, soft_cap): a window inside one block (7), one across blocks (33), a soft cap small
# enough to bend the scores (2.0: tanh is far from linear at |s| ~ 2), and both at once
WINDOW_CAP = [
    pytest.param(7, None, id="window7"),
    pytest.param(33, None, id="window33"),
    pytest.param(None, 2.0, id="cap2"),
    pytest.param(20, 2.0, id="window20-cap2"),
]


def _visible_slots(bt, b, pos, bs, window):
    """The cache slots of the keys a query at ``pos`` of sequence ``b`` sees (the last ``window``)."""
    lo = 0 if window is None else max(0, pos - window + 1)
    return [_slot(bt, b, p, bs) for p in range(lo, pos + 1)]


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
