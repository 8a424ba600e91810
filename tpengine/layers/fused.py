"""Fused attention and MLP modules for the Llama-style decoder families (Llama, Mistral, Qwen2,
Qwen3), swapped in by :func:`tpengine.surgery.fuse_projections` after the weights are loaded.

* q/k/v run as one column-parallel GEMM and gate/up as another
  (:class:`tpengine.layers.linear.MergedColumnParallelLinear`: the concatenation of the
  ShardPlan slices the loader assigned, so the partition math stays in the plan);
* RoPE runs once over the query and key heads together (they are adjacent in the fused output),
  with HF's formula ``x * cos + rotate_half(x) * sin``;
* inside an engine step, attention takes the step's packed ``[T, H, D]`` tokens straight from the
  GEMM output, with no transposes.

HF's RMSNorm (eight tensor ops) becomes :class:`RMSNorm` (``F.rms_norm``: one op in float32, four
in half precision), and the decoder stack's forward becomes :func:`lean_decoder_forward`. The
forwards mirror the HF ones they replace (same operations in the same order on each element), so
results match HF's bit for bit in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from tpengine.kernels import cpu_fused
from tpengine.kernels.cpu_fused import rotate_half  # noqa: F401  (re-exported for the lead's merge)
from tpengine.layers.attention import paged_attention
from tpengine.layers.linear import MergedColumnParallelLinear


class FusedAttention(nn.Module):
    """Replaces an HF attention module (``q_proj``/``k_proj``/``v_proj``/``o_proj`` already
    tensor-parallel, optional per-head ``q_norm``/``k_norm`` as in Qwen3).

    ``forward(hidden_states [B, T, hidden], position_embeddings=(cos, sin) [B, T, D])`` ->
    ``(out [B, T, hidden], None)`` like the HF module; in an engine step B == 1.
    """

    native = True  # EngineConfig.cpu_kernels (set per engine)

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.qkv_proj = MergedColumnParallelLinear([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.layer_idx, self.head_dim, self.scaling = attn.layer_idx, attn.head_dim, attn.scaling
        self.num_heads, self.num_key_value_heads = attn.num_heads, attn.num_key_value_heads
        self.tp_q_to_kv = attn.tp_q_to_kv

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                ctx) -> tuple[torch.Tensor, None]:
        hq, hkv = self.num_heads, self.num_key_value_heads
        qkv = self.qkv_proj(hidden_states).unflatten(-1, (hq + 2 * hkv, self.head_dim))  # [B, T, H, D]
        qk, v = qkv[..., : hq + hkv, :], qkv[..., hq + hkv :, :]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[..., :hq, :]), self.k_norm(qk[..., hq:, :])), dim=-2)
        qk = cpu_fused.rope_(qk, *position_embeddings, self.native)  # CPU bfloat16: one C kernel, in place
        q, k = qk[..., :hq, :], qk[..., hq:, :]
        out = paged_attention(self, q, k, v, self.scaling, ctx)
        return self.o_proj(out.flatten(-2)), None


class FusedMLP(nn.Module):
    """Replaces an HF gated MLP ``down(act(gate(x)) * up(x))`` (parallel layers, HF ``act_fn``)."""

    native = True  # EngineConfig.cpu_kernels (set per engine)

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear([mlp.gate_proj, mlp.up_proj])
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn
        self.intermediate = mlp.gate_proj.out_features
        self.silu = isinstance(mlp.act_fn, nn.SiLU) or type(mlp.act_fn).__name__ == "SiLUActivation"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu:  # CPU bfloat16: one C kernel
            return self.down_proj(cpu_fused.silu_mul(gate_up, self.intermediate, self.native))
        h = self.act_fn(gate_up[..., : self.intermediate])
        return self.down_proj(h.mul_(gate_up[..., self.intermediate :]))


class RMSNorm(nn.Module):
    """Replaces an HF Llama-style RMSNorm (``weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype)``)
    with the same arithmetic through ``F.rms_norm`` (bit-identical in float32 and bfloat16)."""

    native = True  # EngineConfig.cpu_kernels (set per engine)

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon
        self.shape = tuple(norm.weight.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_forward(x, None)[1]

    def add_forward(self, h: torch.Tensor, x: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + x, self(h + x))`` (``h`` itself when ``x`` is None): the residual add before the
        norm, fused with it by a C kernel on CPU in bfloat16 (tpengine.kernels.cpu_fused)."""
        return cpu_fused.add_rms_norm(h, x, self.weight, self.eps, self.native)


def lean_decoder_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
    """Replaces the forward of an HF decoder stack (``LlamaModel`` and its Mistral/Qwen2/Qwen3
    twins) whose layers are all fused: HF's computation (embedding, RoPE tables, then per layer
    ``h = h + attn(norm1(h))`` and ``h = h + mlp(norm2(h))``, final norm) without HF's causal-mask
    building, cache and kwargs plumbing and per-layer wrappers, which tpengine's attention does
    not use; each residual add runs inside the next norm's :meth:`RMSNorm.add_forward` (the same
    ops in the same order, or one C kernel on CPU in bfloat16). ``input_ids``/``positions [N]`` int64,
    ``ctx`` the step's :class:`tpengine.context.Context`; returns ``[N, hidden]``."""
    h = self.embed_tokens(input_ids)
    position_embeddings = tuple(t[0] for t in self.rotary_emb(h, positions[None]))  # cos, sin [N, D]
    delta = None  # each block's output, added to the residual stream by the next norm (fused on CPU bf16)
    for layer in self.layers[: self.config.num_hidden_layers]:
        h, x = _add_norm(layer.input_layernorm, h, delta)
        delta = layer.self_attn(x, position_embeddings, ctx)[0]
        h, x = _add_norm(layer.post_attention_layernorm, h, delta)
        delta = layer.mlp(x)
    return _add_norm(self.norm, h, delta)[1]


def _add_norm(norm: nn.Module, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + delta, norm(h + delta))``; fused for tpengine's :class:`RMSNorm`."""
    if isinstance(norm, RMSNorm):
        return norm.add_forward(h, delta)
    h = h if delta is None else h + delta
    return h, norm(h)
