"""Paged attention for one layer inside an engine step: the one entry point the model's attention
layers call, with the step's :class:`tpengine.context.Context` passed explicitly.

GQA goes through the module's ``tp_q_to_kv`` map from the ShardPlan, so uneven and replicated KV
heads work.
"""

from __future__ import annotations

import torch

from tpengine.context import Context


def paged_attention(module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                    ctx: Context) -> torch.Tensor:
    """Store ``k``/``v`` in the module's paged KV cache, then prefill or decode attention over it,
    through ``ctx.backend`` with the step's metadata ``ctx.attn``.

    Shapes: ``q [T, Hq_local, D]``, ``k``/``v [T, Hkv_local, D]`` (any strides; may be views into
    the fused q/k/v GEMM output) -> ``[T, Hq_local, D]``. ``module`` holds ``k_cache``/``v_cache``
    (``[num_blocks, block_size, Hkv_local, D]``), ``tp_q_to_kv`` (``[Hq_local]`` int64) and, bound by
    ``backend.bind_layer``, its per-layer backend state (``kv_mirror``).
    """
    be, attn, k_cache, v_cache = ctx.backend, ctx.attn, module.k_cache, module.v_cache
    be.store_kvcache(k, v, k_cache, v_cache, attn)
    if ctx.is_prefill:
        return be.prefill_attention(q, k, v, k_cache, v_cache, module.tp_q_to_kv, scaling, attn)
    return be.decode_attention(q, k_cache, v_cache, module.tp_q_to_kv, scaling, attn,
                               getattr(module, "kv_mirror", None))


def paged_decode(module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 scaling: float, ctx: Context) -> torch.Tensor | None:
    """A decode step's RoPE, KV store and attention in one backend call
    (:meth:`tpengine.backends.base.AttentionBackend.paged_decode`), or None where the backend has
    none for this step: then the caller applies RoPE and calls :func:`paged_attention`. Shapes as
    there, with ``cos``, ``sin [B, D]``; ``q`` and ``k`` are rotated in place."""
    if ctx.is_prefill:
        return None
    return ctx.backend.paged_decode(module, q, k, v, cos, sin, scaling, ctx.attn)
