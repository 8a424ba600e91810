"""Torch reference for paged attention: the oracle the Triton kernels and the CPU fast path are
tested against. The simplest obviously-correct torch code, one sequence and one head at a time,
softmax in float32; no fast paths, no C kernels, no caching between calls.

Layout (shared with :mod:`tpengine.backends.cuda.triton_kernels` and
:mod:`tpengine.backends.cpu.attention`): each layer's ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, Hkv, D]``; token slot ``s`` lives at block ``s // block_size``, offset
``s % block_size`` (the vLLM PagedAttention layout, Kwon et al. 2023, "Efficient Memory Management
for Large Language Model Serving with PagedAttention"). GQA goes only through ``q_to_kv`` (local
query head ``h`` reads local KV head ``q_to_kv[h]``), so uneven and replicated tensor-parallel KV
shards work. Every function accepts tensors of any strides; outputs have the dtype of ``q``.

Two per-layer properties of the attention call, HF's semantics (``masking_utils.sliding_window_overlay``,
Gemma 2's ``eager_attention_forward``): ``sliding_window`` ``w`` (a query at position ``i`` sees only the
keys at positions ``j`` with ``i - w < j <= i``; None: every earlier key) and ``soft_cap`` ``c`` (the
scaled scores ``s`` become ``tanh(s / c) * c`` -- divide, tanh, multiply, in float32 -- before the mask
and the softmax; None: no cap). Only the keys some query sees are read from the cache, so block-table
entries before every query's window may be -1 (blocks already freed).
"""

from __future__ import annotations

import torch

from tpengine.backends import kv_quant
from tpengine.backends.checks import (
    check_cache,
    check_decode,
    check_heads,
    check_slots,
    check_store,
    check_window_cap,
    prefill_lengths,
    window_start,
)

__all__ = ["store_kvcache", "prefill_attention", "decode_attention"]


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write token ``i``'s key/value into cache slot ``slot_mapping[i]`` (in place).

    Shapes: ``key``/``value [N, Hkv, D]``, caches ``[num_blocks, block_size, Hkv, D]``,
    ``slot_mapping [N]`` int64; slot -1 means "skip this token" (padding). Values are cast to the
    cache dtype; an int8 cache with ``kv_scales`` (``(k_scale, v_scale)``, ``[num_blocks, block_size,
    Hkv]`` float32) gets codes and scales (:func:`tpengine.backends.kv_quant.quantize`). Raises ValueError
    on shape mismatch, IndexError for a slot out of range (see
    :func:`tpengine.backends.checks.check_slots`). Distinct tokens must map to distinct slots.
    """
    num_blocks, bs, _, _ = check_store(key, value, k_cache, v_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    check_slots(slot_mapping, *torch.aminmax(slot_mapping), num_blocks * bs)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if kv_scales is not None:
        kv_quant.store(key[keep], value[keep], k_cache, v_cache, kv_scales, slots)
        return
    k_cache[slots // bs, slots % bs] = key[keep].to(k_cache.dtype)
    v_cache[slots // bs, slots % bs] = value[keep].to(v_cache.dtype)


def _cached(cache: torch.Tensor, block_row: torch.Tensor, n: int, start: int = 0,
            scale: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens ``start..n-1`` of one sequence from ``cache`` through its block-table row -> ``[n - start, Hkv, D]``
    (an int8 cache with its ``scale``: dequantized to float32)."""
    pos = torch.arange(start, n, device=cache.device)
    bs = cache.shape[1]
    rows = cache[block_row[pos // bs], pos % bs]
    return rows if scale is None else kv_quant.dequantize(rows, scale[block_row[pos // bs], pos % bs], torch.float32)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[Lq, Lk]`` bool: key position ``k_pos[j]`` is visible to the query at ``q_pos[i]`` (causal, and
    within the sliding window when there is one)."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    return visible


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, q_to_kv: torch.Tensor,
            scale: float, soft_cap: float | None = None) -> torch.Tensor:
    """``q [Lq, Hq, D]`` over ``k``/``v [Lk, Hkv, D]``; ``visible [Lq, Lk]`` bool. Float32 scores (soft-capped
    to ``tanh(s / soft_cap) * soft_cap`` when given) and softmax, per query head through ``q_to_kv``.
    Returns ``[Lq, Hq, D]`` float32."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for h, kvh in enumerate(q_to_kv.tolist()):
        s = (q[:, h].float() @ k[:, kvh].float().T) * scale
        if soft_cap is not None:
            s = torch.tanh(s / soft_cap) * soft_cap
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        out[:, h] = p @ v[:, kvh].float()
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      block_tables: torch.Tensor | None, q_to_kv: torch.Tensor, scale: float,
                      sliding_window: int | None = None, soft_cap: float | None = None,
                      kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Varlen causal attention for B sequences packed along N, over a paged cached prefix.

    Shapes: ``q [N, Hq, D]``, ``k``/``v [N, Hkv, D]`` (this step's new tokens), caches
    ``[num_blocks, block_size, Hkv, D]``, ``cu_seqlens_q``/``cu_seqlens_k [B+1]`` int64
    (cumulative new / total tokens), ``block_tables [B, max_blocks]`` int64 (-1 padded; may be
    None when no sequence has a prefix), ``q_to_kv [Hq]`` int64, ``scale`` = softmax scale
    (usually ``D ** -0.5``). Returns ``[N, Hq, D]`` in ``q.dtype``.

    Sequence b's keys are positions ``0..Lk-1``: the first ``P = Lk - Lq`` are read from the
    cache via ``block_tables[b]``, the last ``Lq`` are taken from ``k``/``v`` directly. Query
    ``i`` sits at position ``P + i`` and sees keys ``0..P+i``; with ``sliding_window`` ``w`` only
    those after ``P + i - w``, and ``soft_cap`` caps the scores (the module docstring); the cached
    prefix is read from the first position any query sees; an int8 cache is read with its ``kv_scales``
    (dequantized; this step's own ``k``/``v`` are used as given). Raises ValueError on malformed
    lengths/shapes, a prefix without ``block_tables`` or a bad window or cap.
    """
    check_window_cap(sliding_window, soft_cap)
    _, _, hkv, d = check_cache(k_cache, v_cache)
    check_heads(q, q_to_kv, hkv, d)
    if k.shape != v.shape or k.shape[0] != q.shape[0] or tuple(k.shape[1:]) != (hkv, d):
        raise ValueError(f"k/v must be [{q.shape[0]}, {hkv}, {d}]; got {tuple(k.shape)}, {tuple(v.shape)}")
    cu_q, _, lqs, lks = prefill_lengths(cu_seqlens_q, cu_seqlens_k, q.shape[0])
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for b, (lq, lk) in enumerate(zip(lqs, lks)):
        s, e, p = cu_q[b], cu_q[b + 1], lk - lq
        if p > 0 and block_tables is None:
            raise ValueError(f"sequence {b} has a cached prefix ({p} tokens) but block_tables is None")
        kb, vb = k[s:e], v[s:e]
        lo = window_start(p, sliding_window)  # the first cached key the first query sees
        if p > lo:
            ks, vs = kv_scales or (None, None)
            kb = torch.cat([_cached(k_cache, block_tables[b], p, lo, ks).to(k.dtype), kb])
            vb = torch.cat([_cached(v_cache, block_tables[b], p, lo, vs).to(v.dtype), vb])
        q_pos, k_pos = (torch.arange(a, lk, device=q.device) for a in (p, lo))
        visible = _visible(q_pos, k_pos, sliding_window)
        out[s:e] = _attend(q[s:e], kb, vb, visible, q_to_kv, scale, soft_cap).to(q.dtype)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, q_to_kv: torch.Tensor,
                     scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                     kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query token per sequence attending to its cached keys (the last ``sliding_window`` of them
    when given, read from the cache alone; scores capped by ``soft_cap``: the module docstring).

    Shapes: ``q [B, Hq, D]``, caches ``[num_blocks, block_size, Hkv, D]``, ``block_tables
    [B, max_blocks]`` int64 (-1 padded), ``context_lens [B]`` int64 (tokens in the cache,
    including this step's token, already stored), ``q_to_kv [Hq]``, ``scale`` = softmax scale.
    Returns ``[B, Hq, D]`` in ``q.dtype``; a sequence with ``context_lens == 0`` (batch padding)
    gets zeros; an int8 cache is read with its ``kv_scales`` (dequantized to float32). Raises ValueError on
    shape mismatch, a context longer than the block table's
    capacity or a bad window or cap.
    """
    check_window_cap(sliding_window, soft_cap)
    _, bs, hkv, d = check_decode(q, k_cache, v_cache, q_to_kv, block_tables, context_lens)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for b, n in enumerate(context_lens.tolist()):
        if n > block_tables.shape[1] * bs:
            raise ValueError(f"context length {n} exceeds block table capacity {block_tables.shape[1]}x{bs}")
        if n > 0:
            lo = window_start(n - 1, sliding_window)
            ks, vs = kv_scales or (None, None)
            kb, vb = _cached(k_cache, block_tables[b], n, lo, ks), _cached(v_cache, block_tables[b], n, lo, vs)
            visible = torch.ones(1, n - lo, dtype=torch.bool, device=q.device)
            out[b] = _attend(q[b : b + 1], kb, vb, visible, q_to_kv, scale, soft_cap)[0].to(q.dtype)
    return out
