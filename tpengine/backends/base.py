"""The attention backend interface: what :func:`tpengine.model.layers.attention.paged_attention` and the model
runner call, implemented by :class:`tpengine.backends.cpu.attention.CPUAttentionBackend` (torch + C
kernels) and :class:`tpengine.backends.cuda.attention.TritonAttentionBackend` (CUDA).

One backend object per engine (:func:`tpengine.backends.get_backend`). Per step the model runner
calls :meth:`AttentionBackend.prepare` once with the step's index tensors; its result (the step's
*attention metadata*: host copies of lengths, gather indices, masks...) rides on the step's
:class:`tpengine.context.Context` as ``ctx.attn`` and is handed back to every layer's call. Nothing
per step is kept in module globals, so several engines in one process never see each other's state.
"""

from __future__ import annotations

from typing import Any

import torch


class AttentionBackend:
    """Paged attention over ``[num_blocks, block_size, Hkv, D]`` KV caches (layout and semantics:
    :mod:`tpengine.backends.reference`, the oracle every backend is tested against).

    Attributes: ``name`` ("torch" or "triton"); ``graph_safe``: its decode steps never sync with
    the host, so they may be captured in CUDA graphs.
    """

    name = "abstract"
    graph_safe = False

    def prepare(self, is_prefill: bool, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                context_lens: torch.Tensor | None) -> Any:
        """Once per step, before the forward: the step's attention metadata from its int64 index
        tensors on the model's device (``slot_mapping [N]``, ``block_tables [B, max_blocks]``,
        prefill: ``cu_seqlens_q``/``cu_seqlens_k [B+1]``, decode: ``context_lens [B]``)."""
        raise NotImplementedError

    def bind_layer(self, module: torch.nn.Module) -> None:
        """Called by the model runner after it sets ``module.k_cache``/``module.v_cache``: attach any
        per-layer state the backend keeps (the CPU backend's KV mirror)."""

    def store_kvcache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      attn: Any) -> None:
        """Write this step's ``key``/``value [N, Hkv, D]`` into the caches at ``attn``'s slot mapping."""
        raise NotImplementedError

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, q_to_kv: torch.Tensor, scale: float, attn: Any) -> torch.Tensor:
        """``q [N, Hq, D]``, this step's ``k``/``v [N, Hkv, D]`` -> ``[N, Hq, D]`` (see the reference)."""
        raise NotImplementedError

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_to_kv: torch.Tensor,
                         scale: float, attn: Any, mirror: Any = None) -> torch.Tensor:
        """``q [B, Hq, D]`` -> ``[B, Hq, D]`` over the cached keys; ``mirror``: the layer's per-layer state
        from :meth:`bind_layer` (``module.kv_mirror``), or None."""
        raise NotImplementedError

    def paged_decode(self, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, scale: float, attn: Any) -> torch.Tensor | None:
        """A decode step's whole attention for one layer in one call, where the backend has one:
        RoPE (``cos``, ``sin [B, D]``) on ``q [B, Hq, D]`` and ``k [B, Hkv, D]``, the store of ``k``/``v``
        into ``module``'s caches, and attention over them -> ``[B, Hq, D]``; None (the default) when
        it does not take this step or layer, and the caller runs RoPE, :meth:`store_kvcache` and
        :meth:`decode_attention` instead."""
        return None
