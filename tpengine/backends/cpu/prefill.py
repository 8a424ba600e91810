"""The CPU backend's prefill attention arithmetic (:mod:`tpengine.backends.cpu.attention` picks the
path): a cached prefix read through a block table, attention over a cached prefix plus new tokens
as two flash calls merged by their log-sum-exp, HF-eager-style causal attention in half
precision for batches of equal-length prompts, and the attention of a layer with a sliding window or a
logit soft cap (:func:`masked_attention`: SDPA under a window mask, or explicit arithmetic with the
cap, which SDPA does not take)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpengine.backends.cpu import cpu_fused

__all__ = ["causal_matmul_attention", "gather_cache", "masked_attention", "prefix_attention", "visible_keys"]


def prefix_attention(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, kn: torch.Tensor, vn: torch.Tensor,
                     scale: float, gqa: bool) -> torch.Tensor:
    """Attention of ``q [1, Hq, Lq, D]`` (new tokens at positions ``p .. p+Lq-1``) over a cached prefix
    ``kp``/``vp [1, H, p, D]`` (all visible) and the new tokens' own ``kn``/``vn [1, H, Lq, D]``
    (causal) -> ``[1, Hq, Lq, D]``; ``H`` is ``Hq``, or ``Hkv`` with ``gqa``.

    One query token (a decode in a mixed step) is one SDPA call over the concatenation. Otherwise
    the two parts run as two flash-attention calls, the prefix unmasked and the new tokens with a
    causal mask, merged by their log-sum-exp (the split-softmax identity of flash-decoding /
    FlashAttention's block merge): the same result as one bottom-right-aligned masked call, which
    CPU SDPA computes over the whole ``Lq x (p + Lq)`` rectangle."""
    if q.shape[2] == 1:
        return F.scaled_dot_product_attention(q, torch.cat([kp, kn], 2), torch.cat([vp, vn], 2), scale=scale,
                                              enable_gqa=gqa)
    if gqa and kp.shape[1] != q.shape[1]:  # the log-sum-exp op takes one KV head per query head
        g = q.shape[1] // kp.shape[1]
        kp, vp, kn, vn = (x.repeat_interleave(g, 1) for x in (kp, vp, kn, vn))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o1, l1 = flash(q, kp, vp, 0.0, False, scale=scale)[:2]  # [1, Hq, Lq, D], [1, Hq, Lq] float32
    o2, l2 = flash(q, kn, vn, 0.0, True, scale=scale)[:2]
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp_(), (l2 - m).exp_()
    o = o1.float().mul_(w1[..., None]).add_(o2.float().mul_(w2[..., None])).div_((w1 + w2)[..., None])
    return o.to(q.dtype)


def gather_cache(cache: torch.Tensor, block_row: torch.Tensor, n: int, start: int = 0) -> torch.Tensor:
    """Tokens ``start..n-1`` of one sequence from ``cache`` through its block-table row -> [n - start, Hkv, D]
    (the blocks before ``start`` are not read)."""
    bs = cache.shape[1]
    pos = torch.arange(start, n, device=cache.device)
    return cache.reshape(-1, *cache.shape[2:]).index_select(0, block_row[pos // bs] * bs + pos % bs)


def causal_matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            cpu_kernels: bool) -> torch.Tensor:
    """Causal attention of ``q [B, Hq, L, D]`` over ``k``/``v [B, Hkv, L, D]`` (``Hq = G * Hkv``,
    query head ``h`` reads KV head ``h // G``) -> ``[B, Hq, L, D]``, computed as HF's eager
    attention does for half types: matmuls in the input dtype, scores scaled and masked, softmax
    accumulated in float32 (CPU softmax upcasts half inputs internally). On CPU in bfloat16 this is
    faster than SDPA's flash kernel for short prompts where the CPU has a fast bfloat16 GEMM (the
    caller checks :func:`tpengine.backends.cpu.cpu_widen.gemm_dtype`; on an AVX2-only CPU it is not)."""
    b, hkv, n, d = k.shape
    g = q.shape[1] // hkv
    s = torch.matmul(q.reshape(b, hkv, g * n, d), k.transpose(-1, -2))  # [B, Hkv, G*L, L]
    p = cpu_fused.causal_softmax_(s.view(b, hkv, g, n, n), scale, cpu_kernels).view(b, hkv, g * n, n)
    return torch.matmul(p, v).view(b, hkv * g, n, d)


def visible_keys(lq: int, lk: int, q0: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[lq, lk]`` bool: key ``j`` (position ``j``) is visible to query ``i`` (position ``q0 + i``):
    ``j <= q0 + i`` and, with a sliding ``window``, ``j > q0 + i - window``."""
    q_pos = torch.arange(q0, q0 + lq, device=device)[:, None]
    k_pos = torch.arange(lk, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q0: int,
                     window: int | None, soft_cap: float | None) -> torch.Tensor:
    """Attention of a layer with a sliding window and/or a logit soft cap: ``q [B, Hq, Lq, D]`` (query
    ``i`` at key position ``q0 + i``) over ``k``/``v [B, H, Lk, D]`` (``H`` divides ``Hq``; query head
    ``h`` reads KV head ``h // (Hq / H)``) -> ``[B, Hq, Lq, D]`` in ``q``'s dtype, with the mask of
    :func:`visible_keys` (every query sees at least itself, so no row is empty).

    Without a cap: one SDPA call under the boolean mask. With ``soft_cap`` ``c``: the scores as HF's eager
    attention computes them (the product in the input dtype, then float32: scaled, ``tanh(s / c) * c``,
    masked, softmax), the probabilities rounded to the input dtype for the product with ``v``."""
    b, h, lk, d = k.shape
    hq, lq = q.shape[1], q.shape[2]
    mask = visible_keys(lq, lk, q0, window, q.device)
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=h != hq)
    g = hq // h
    s = torch.matmul(q.reshape(b, h, g * lq, d), k.transpose(-1, -2))  # [B, H, G*Lq, Lk]
    s = s.float().mul_(scale).div_(soft_cap).tanh_().mul_(soft_cap).view(b, h, g, lq, lk)
    p = torch.softmax(s.masked_fill_(~mask, float("-inf")), dim=-1).to(q.dtype).view(b, h, g * lq, lk)
    return torch.matmul(p, v).view(b, hq, lq, d)
