"""Argument checks shared by the paged-attention backends (:mod:`tpengine.backends.reference`,
:mod:`tpengine.backends.cuda.triton_kernels`): cache layout ``[num_blocks, block_size, Hkv, D]``,
token-major ``[N, H, D]`` activations, cumulative sequence offsets. Each raises ValueError naming
the mismatch."""

from __future__ import annotations

import torch

__all__ = ["check_cache", "check_store", "check_heads", "check_slots", "check_window_cap", "prefill_lengths",
           "window_start"]


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate a layer's cache pair; returns ``(num_blocks, block_size, Hkv, D)``.

    Raises ValueError if either is not 4-D or their shapes differ.
    """
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_blocks, block_size, Hkv, D]; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    return tuple(k_cache.shape)  # type: ignore[return-value]


def check_store(key, value, k_cache, v_cache, slot_mapping) -> tuple[int, int, int, int]:
    """Validate ``store_kvcache`` arguments; returns the cache shape. Raises ValueError."""
    _, _, hkv, d = shape = check_cache(k_cache, v_cache)
    if key.shape != value.shape or key.dim() != 3 or tuple(key.shape[1:]) != (hkv, d):
        raise ValueError(f"key/value must be [N, {hkv}, {d}]; got {tuple(key.shape)}, {tuple(value.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}]; got {tuple(slot_mapping.shape)}")
    return shape


def check_heads(q: torch.Tensor, q_to_kv: torch.Tensor, hkv: int, d: int) -> None:
    """Validate ``q [*, Hq, D]`` against ``q_to_kv [Hq]`` and the cache's ``Hkv``/``D``.

    Raises ValueError naming the mismatch. Does not read ``q_to_kv``'s values (no device sync).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, Hq, D]; got shape {tuple(q.shape)}")
    if q.shape[2] != d:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {d}")
    if q_to_kv.dim() != 1 or q_to_kv.shape[0] != q.shape[1]:
        raise ValueError(f"q_to_kv must be [Hq={q.shape[1]}]; got shape {tuple(q_to_kv.shape)}")
    if hkv < 1:
        raise ValueError("the cache holds no KV heads")


def prefill_lengths(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, n_tokens: int):
    """Host copies of the per-sequence lengths: ``(cu_q list, cu_k list, lq list, lk list)``.

    One device->host transfer. Raises ValueError if the offsets are malformed, if
    ``cu_seqlens_q[-1] != n_tokens`` or if some sequence has ``Lk < Lq``.
    """
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 1:
        raise ValueError(
            f"cu_seqlens_q/k must both be [B+1]; got {tuple(cu_seqlens_q.shape)} and "
            f"{tuple(cu_seqlens_k.shape)}"
        )
    cu_q, cu_k = torch.stack([cu_seqlens_q, cu_seqlens_k.to(cu_seqlens_q.dtype)]).tolist()
    lq = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    lk = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
    if cu_q[0] != 0 or cu_k[0] != 0 or cu_q[-1] != n_tokens:
        raise ValueError(
            f"cu_seqlens_q must run 0..{n_tokens} and cu_seqlens_k start at 0; got {cu_q}, {cu_k}"
        )
    bad = [b for b in range(len(lq)) if lq[b] < 0 or lk[b] < lq[b]]
    if bad:
        b = bad[0]
        raise ValueError(f"sequence {b}: need 0 <= Lq <= Lk, got Lq={lq[b]}, Lk={lk[b]}")
    return cu_q, cu_k, lq, lk


def check_slots(slot_mapping: torch.Tensor, lo: int | torch.Tensor, hi: int | torch.Tensor, num_slots: int) -> None:
    """Raise IndexError unless every slot (min ``lo``, max ``hi``) is -1 (skip) or in ``[0, num_slots)``:
    ``slot_mapping[i] = v is out of range for a KV cache of n slots (valid: -1 to skip, 0 to n-1)``,
    naming the first bad position (found only on that error path)."""
    if int(lo) < -1 or int(hi) >= num_slots:
        i = int(((slot_mapping < -1) | (slot_mapping >= num_slots)).nonzero()[0])
        raise IndexError(f"slot_mapping[{i}] = {int(slot_mapping[i])} is out of range for a KV cache of "
                         f"{num_slots} slots (valid: -1 to skip, 0 to {num_slots - 1})")


def check_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_to_kv: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate ``decode_attention`` arguments (``q [B, Hq, D]``, ``block_tables [B, max_blocks]``,
    ``context_lens [B]``, the caches and ``q_to_kv``); returns the cache shape. Raises ValueError."""
    shape = check_cache(k_cache, v_cache)
    check_heads(q, q_to_kv, shape[2], shape[3])
    nb = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != nb or context_lens.shape != (nb,):
        raise ValueError(
            f"block_tables must be [{nb}, max_blocks] and context_lens [{nb}]; got "
            f"{tuple(block_tables.shape)}, {tuple(context_lens.shape)}"
        )
    return shape


def check_window_cap(window: int | None, soft_cap: float | None) -> None:
    """Validate a layer's sliding window (None, or an int ``w >= 1``: a query at position ``i`` sees the
    keys at ``i - w < j <= i``) and attention-logit soft cap (None, or a finite ``c > 0``: scaled scores
    become ``tanh(s / c) * c``). Raises ValueError naming the bad value."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1; got {window!r}")
    if soft_cap is not None and not (isinstance(soft_cap, (int, float)) and 0 < float(soft_cap) < float("inf")):
        raise ValueError(f"logit_soft_cap must be None or a finite number > 0; got {soft_cap!r}")


def window_start(pos: int, window: int | None) -> int:
    """The first key position a query at position ``pos`` sees: ``max(0, pos - window + 1)`` (0 without
    a window)."""
    return 0 if window is None else max(0, pos - window + 1)
