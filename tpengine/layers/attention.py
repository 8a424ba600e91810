"""The ``tpengine`` attention function, registered with transformers' AttentionInterface.

HF attention modules hand it q/k/v after RoPE (and q/k norms) for this rank's local heads. GQA
goes through the module's ``tp_q_to_kv`` map from the ShardPlan, so uneven and replicated KV
heads work. Inside an engine step (a :class:`tpengine.engine.context.Context` is set) it writes
k/v into the module's paged KV cache and runs paged attention; outside one it runs plain causal
attention over the whole batch (used to compare logits with HF).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from tpengine.engine.context import Context, get_context

NAME = "tpengine"


def tpengine_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for one layer.

    Shapes: ``query [B, Hq_local, T, D]``, ``key``/``value [B, Hkv_local, T, D]`` -> returns
    ``([B, T, Hq_local, D], None)`` as transformers expects. In an engine step B == 1 and the T
    tokens are the step's sequences packed back to back.
    """
    q_to_kv = module.tp_q_to_kv
    ctx = get_context()
    if ctx is None:
        k = key.index_select(1, q_to_kv)
        v = value.index_select(1, q_to_kv)
        out = F.scaled_dot_product_attention(query, k, v, is_causal=query.shape[2] > 1, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    out = paged_attention(module, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                          scaling, ctx)
    return out.unsqueeze(0), None


def paged_attention(module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                    ctx: Context) -> torch.Tensor:
    """One layer's attention inside an engine step, on the step's packed tokens: store ``k``/``v``
    in the module's paged KV cache, then prefill or decode attention over it.

    Shapes: ``q [T, Hq_local, D]``, ``k``/``v [T, Hkv_local, D]`` (any strides) -> ``[T, Hq_local, D]``.
    """
    be, k_cache, v_cache = ctx.backend, module.k_cache, module.v_cache
    be.store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping)
    if ctx.is_prefill:
        return be.prefill_attention(q, k, v, k_cache, v_cache, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                    ctx.block_tables, module.tp_q_to_kv, scaling)
    return be.decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, module.tp_q_to_kv,
                               scaling)


def _no_mask(*args, **kwargs):
    """tpengine attention builds its own causal structure; HF needs no mask tensor."""
    return None


def register() -> str:
    """Register the attention and mask functions under ``"tpengine"`` (idempotent); returns the name."""
    AttentionInterface.register(NAME, tpengine_attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME
