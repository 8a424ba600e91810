"""The attention backend interface: what the model's attention layers
(:class:`tpengine.model.layers.fused.FusedAttention`, one call :meth:`AttentionBackend.forward` per layer)
and the model runner call, implemented by :class:`tpengine.backends.cpu.attention.CPUAttentionBackend` (torch + C
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

    Attributes: ``name`` ("cpu" or "triton"); ``graph_safe``: its decode steps never sync with
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
        """Called by :meth:`bind_model` for each attention layer once its ``k_cache``/``v_cache`` are
        set: keep any per-layer state the backend needs (the CPU backend's KV mirror), in the backend,
        keyed by ``module.layer_idx``."""

    def bind_model(self, stack: torch.nn.Module, tp_size: int) -> None:
        """Called once by the model runner after the KV cache is bound to every layer of the decoder
        ``stack``: :meth:`bind_layer` for each, and whatever the backend binds into the layers (the CPU
        backend's kernel calls and measured kernel paths)."""
        for layer in stack.layers[: stack.config.num_hidden_layers]:
            self.bind_layer(layer.self_attn)

    def bind_head(self, head: torch.nn.Module, tp_size: int) -> str | None:
        """Called once by the model runner after :meth:`bind_model` with the model's LM ``head``: a backend
        whose bound decode step can also pick a greedy step's tokens (the CPU's decode program: the head's
        product and the argmax in the same C call) takes it here; the runner then asks a step for greedy
        ids through ``Context.greedy`` and reads them from ``Context.ids``. Returns why it took none (the
        base: never), or None."""
        return "no bound decode step"

    def describe(self) -> str | None:
        """A line about what :meth:`bind_model` measured and chose on this machine, or None."""
        return None

    def cache_changed(self) -> None:
        """The model runner wrote the KV cache outside a step (copy-on-write block copies): drop any
        state that mirrors it."""

    def forward(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layer: torch.nn.Module,
                ctx: Any) -> torch.Tensor:
        """One layer's attention in one step: ``qkv [T, (Hq + 2 Hkv) D]`` is the fused q/k/v output (the
        query heads, then the key heads, then the value heads; rows of unit stride, any row stride;
        its q and k may be rotated in place); RoPE (``rope = (cos, sin)``, ``[T, D]`` each) on the query
        and key heads, the store of the keys and values into ``layer``'s ``k_cache``/``v_cache`` at
        the step's slot mapping, then prefill or decode attention over them -> ``[T, Hq D]``.
        ``layer`` holds ``num_heads``, ``num_key_value_heads``, ``head_dim``, ``tp_q_to_kv`` (``[Hq]``
        int64, from the ShardPlan: uneven and replicated KV heads work), ``scaling``, ``ops`` (its
        fused ops, which apply RoPE), ``sliding_window`` and ``logit_soft_cap`` (None, or the layer's
        window and attention-logit soft cap: :mod:`tpengine.backends.reference` has their semantics;
        every path applies them), ``kv_scales`` (None, or an int8 cache's ``(k_scale, v_scale)``
        ``[num_blocks, block_size, Hkv]`` float32: :mod:`tpengine.backends.kv_quant`; every path reads
        it). A backend with a faster path for some steps (the CPU paged kernel:
        RoPE, store and attention in one C call) takes it inside this method."""
        hq, hkv, attn = layer.num_heads, layer.num_key_value_heads, ctx.attn
        qk, v = qkv.view(qkv.shape[0], hq + 2 * hkv, layer.head_dim).split_with_sizes((hq + hkv, hkv), 1)
        qk = layer.ops.rope_(qk, *rope)
        q, k = qk[..., :hq, :], qk[..., hq:, :]
        scales = getattr(layer, "kv_scales", None)  # (None too for a layer without the attribute)
        self.store_kvcache(k, v, layer.k_cache, layer.v_cache, attn, kv_scales=scales)
        window, cap = layer.sliding_window, layer.logit_soft_cap
        if ctx.is_prefill:
            out = self.prefill_attention(q, k, v, layer.k_cache, layer.v_cache, layer.tp_q_to_kv, layer.scaling, attn,
                                         window, cap, kv_scales=scales)
        else:
            out = self.decode_attention(q, layer.k_cache, layer.v_cache, layer.tp_q_to_kv, layer.scaling, attn,
                                        self.layer_state(layer), window, cap, kv_scales=scales)
        return out.flatten(1)

    def layer_state(self, layer: torch.nn.Module) -> Any:
        """The per-layer state :meth:`bind_layer` keeps for ``layer`` (None by default)."""
        return None

    def store_kvcache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      attn: Any, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Write this step's ``key``/``value [N, Hkv, D]`` into the caches at ``attn``'s slot mapping
        (int8 caches with ``kv_scales``: quantized, :mod:`tpengine.backends.kv_quant`)."""
        raise NotImplementedError

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, q_to_kv: torch.Tensor, scale: float, attn: Any,
                          sliding_window: int | None = None, soft_cap: float | None = None,
                          kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``q [N, Hq, D]``, this step's ``k``/``v [N, Hkv, D]`` -> ``[N, Hq, D]``; ``sliding_window`` and
        ``soft_cap``: the layer's (None: off; see the reference); ``kv_scales``: an int8 cache's."""
        raise NotImplementedError

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_to_kv: torch.Tensor,
                         scale: float, attn: Any, mirror: Any = None, sliding_window: int | None = None,
                         soft_cap: float | None = None,
                         kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``q [B, Hq, D]`` -> ``[B, Hq, D]`` over the cached keys; ``mirror``: the layer's per-layer state
        (:meth:`layer_state`), or None; ``sliding_window`` and ``soft_cap``: the layer's (None: off);
        ``kv_scales``: an int8 cache's."""
        raise NotImplementedError
