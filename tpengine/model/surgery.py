"""Surgery: the name -> layer-kind table, and building a rank's model in its final form.

The table maps the leaf module name of every checkpoint weight to its partition kind (see
:mod:`tpengine.model.plan`). The shard tool and the loader both use :func:`kind_of`, so a weight is
sliced the same way offline and online. :func:`build_model` turns a meta-device HF model into
tpengine's tensor-parallel one (fused q/k/v and gate/up layers from the start);
:func:`checkpoint_targets` says where each checkpoint tensor goes in it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoModelForCausalLM

from tpengine.errors import UserError
from tpengine.model import plan as P
from tpengine.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding

# leaf module name -> partition kind
LAYER_KINDS: dict[str, str] = {
    "q_proj": P.Q,
    "k_proj": P.K,
    "v_proj": P.V,
    "o_proj": P.ROW_HEADS,
    "gate_proj": P.COLUMN,
    "up_proj": P.COLUMN,
    "down_proj": P.ROW,
    "embed_tokens": P.VOCAB,
    "lm_head": P.VOCAB,
}


def kind_of(param_name: str, ndim: int) -> str:
    """Partition kind of checkpoint tensor ``param_name`` (e.g.
    ``model.layers.0.self_attn.q_proj.weight``) with ``ndim`` dimensions.

    1-D tensors not in the table (norm weights, q_norm/k_norm) are replicated.

    Raises:
        ValueError: a 2-D or larger tensor whose module is not in the table; it would otherwise
            be silently replicated.
    """
    parts = param_name.split(".")
    leaf = parts[-2] if len(parts) >= 2 else parts[-1]
    if leaf in LAYER_KINDS:
        return LAYER_KINDS[leaf]
    if ndim <= 1:
        return P.REPLICATED
    raise ValueError(
        f"tensor {param_name!r} ({ndim}-D) belongs to module {leaf!r}, which tpengine's layer table "
        f"does not cover (known: {', '.join(sorted(LAYER_KINDS))}); refusing to replicate it silently"
    )


# HF classes whose forwards tpengine's layers reproduce exactly (tpengine.model.layers.fused)
SUPPORTED_MODELS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
SUPPORTED_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")
SUPPORTED_MLP = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
SUPPORTED_NORM = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def build_meta_model(hf_config, dtype: torch.dtype) -> nn.Module:
    """The HF causal-LM for ``hf_config`` with every parameter and buffer on the meta device
    (accelerate's ``init_empty_weights``): the structure :func:`build_model` rebuilds."""
    with init_empty_weights(include_buffers=True):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=dtype)
    return model.eval()


def _unsupported(what: str, found: str, known: tuple[str, ...], hf_config) -> UserError:
    return UserError(f"model_type {getattr(hf_config, 'model_type', '?')!r}: {what} {found!r} is not supported; "
                      f"tpengine runs {', '.join(known)}")


def build_model(hf_config, plan: P.ShardPlan, rank: int, dtype: torch.dtype, device: torch.device,
                cpu_kernels: bool = True) -> nn.Module:
    """This rank's tensor-parallel model in its final form, weights still on meta.

    Builds HF's model for ``hf_config`` on the meta device, then swaps, by name, each decoder
    layer's ``self_attn`` for a :class:`~tpengine.model.layers.fused.FusedAttention` (one
    column-parallel q/k/v GEMM, row-parallel ``o_proj``), its ``mlp`` for a
    :class:`~tpengine.model.layers.fused.FusedMLP` (one gate/up GEMM, row-parallel ``down_proj``), every
    RMSNorm for :class:`~tpengine.model.layers.fused.RMSNorm`, ``embed_tokens``/``lm_head`` for the
    vocabulary-parallel layers, and HF's decoder stack for a
    :class:`~tpengine.model.layers.fused.DecoderStack` holding them; every size comes from ``plan.ranks[rank]``.
    RoPE tables and the per-layer ``tp_q_to_kv`` maps are real tensors on ``device``; the
    loader (:func:`tpengine.model.loader.load_model`) fills every parameter through
    :func:`checkpoint_targets`. Tied embeddings share one Parameter. Every layer gets the one
    element-wise ops object of the model, ``device``'s platform's
    (:meth:`tpengine.backends.platform.Platform.fused_ops`; ``cpu_kernels``: on the CPU the C kernels
    where they take the tensors, ``EngineConfig.cpu_kernels``).

    Raises:
        UserError: an architecture other than Llama, Mistral, Qwen2 or Qwen3 (naming it).
        ValueError: an
            ``nn.Linear``/``nn.Embedding`` left that the layer table does not cover.
    """
    from tpengine.backends import get_platform
    from tpengine.model.layers.fused import DecoderStack, FusedAttention, FusedMLP, RMSNorm

    model = build_meta_model(hf_config, dtype)
    stack = getattr(model, "model", None)
    if type(stack).__name__ not in SUPPORTED_MODELS:
        found = type(model).__name__ if stack is None else type(stack).__name__
        raise _unsupported("decoder", found, SUPPORTED_MODELS, hf_config)
    rp, hidden, ops = plan.ranks[rank], plan.hidden_size, get_platform(device).fused_ops(cpu_kernels)

    def norm(m: nn.Module) -> nn.Module:
        if type(m).__name__ not in SUPPORTED_NORM:
            raise _unsupported("norm", type(m).__name__, SUPPORTED_NORM, hf_config)
        return RMSNorm(m.weight.shape[0], m.variance_epsilon, dtype, ops)

    for layer in stack.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn).__name__ not in SUPPORTED_ATTENTION:
            raise _unsupported("attention", type(attn).__name__, SUPPORTED_ATTENTION, hf_config)
        if type(mlp).__name__ not in SUPPORTED_MLP:
            raise _unsupported("MLP", type(mlp).__name__, SUPPORTED_MLP, hf_config)
        if attn.head_dim != plan.head_dim:
            raise ValueError(f"attention head_dim {attn.head_dim} differs from the plan's {plan.head_dim}")
        q_norm = getattr(attn, "q_norm", None)
        layer.self_attn = FusedAttention(
            hidden, rp, plan.head_dim, attn.q_proj.bias is not None, attn.o_proj.bias is not None, attn.scaling,
            attn.layer_idx, None if q_norm is None else q_norm.variance_epsilon, dtype, device, ops)
        layer.mlp = FusedMLP(hidden, rp.intermediate_size, mlp.gate_proj.bias is not None,
                             mlp.down_proj.bias is not None, mlp.act_fn, dtype, ops)
        layer.input_layernorm = norm(layer.input_layernorm)
        layer.post_attention_layernorm = norm(layer.post_attention_layernorm)
    reduce_in_norm = plan.tp_size > 1 and all(
        layer.self_attn.o_proj.bias is None and layer.mlp.down_proj.bias is None for layer in stack.layers)
    rotary = type(stack.rotary_emb)(config=stack.config).to(device)  # real tables; honours rope scaling
    model.model = stack = DecoderStack(stack.config, VocabParallelEmbedding(*rp.vocab, plan.vocab_size, hidden,
                                                                            dtype=dtype),
                                       stack.layers, norm(stack.norm), rotary, reduce_in_norm)
    model.lm_head = ParallelLMHead(*rp.vocab, plan.vocab_size, hidden, dtype=dtype, ops=ops)
    if getattr(hf_config, "tie_word_embeddings", False):
        model.lm_head.weight = stack.embed_tokens.weight
    left = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    if left:
        raise ValueError(f"modules {left} are not covered by tpengine's layer table "
                         f"(known: {', '.join(sorted(LAYER_KINDS))}); refusing to replicate them silently")
    return model


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes in a model from :func:`build_model`: parameter ``attr``
    of ``module``, rows ``start:start + rows`` (dim 0; the whole parameter but for the parts of
    a merged q/k/v or gate/up layer)."""

    module: nn.Module
    attr: str
    start: int
    rows: int


def checkpoint_targets(model: nn.Module, tied: bool) -> dict[str, Target]:
    """Checkpoint tensor name (HF's, e.g. ``model.layers.0.self_attn.k_proj.weight``) -> its
    :class:`Target`, for every parameter of ``model``: a merged layer's part ``k_proj`` of
    ``...self_attn.qkv_proj`` takes the checkpoint's ``...self_attn.k_proj.*``. A tied
    ``lm_head.weight`` has no target (the LM head shares the embedding)."""
    from tpengine.model.layers.linear import MergedColumnParallelLinear

    out: dict[str, Target] = {}
    for name, module in model.named_modules():
        prefix = name.rsplit(".", 1)[0] + "." if "." in name else ""
        for attr, p in module.named_parameters(recurse=False):
            if tied and module is model.get_output_embeddings():
                continue
            if isinstance(module, MergedColumnParallelLinear):
                for part, a, b in zip(module.part_names, module.offsets, module.offsets[1:]):
                    out[f"{prefix}{part}.{attr}"] = Target(module, attr, a, b - a)
            else:
                out[f"{name}.{attr}"] = Target(module, attr, 0, p.shape[0])
    return out


def check_model_limits(hf_config, max_model_len: int) -> None:
    """Refuse settings the model cannot honour, before any weight is read.

    Raises:
        UserError: ``max_model_len`` above the model's ``max_position_embeddings``, or a model
            whose sliding-window attention would start to matter below ``max_model_len``
            (tpengine's attention is full causal attention), naming both values.
    """
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and max_model_len > limit:
        raise UserError(f"max_model_len={max_model_len} is larger than the model's "
                         f"max_position_embeddings={limit}; use --max-model-len {limit} or less")
    window = getattr(hf_config, "sliding_window", None)
    uses_window = getattr(hf_config, "use_sliding_window", True)  # Qwen2/3 carry a switch
    if window and uses_window and max_model_len > window:
        raise UserError(f"this model uses sliding-window attention (sliding_window={window}), which "
                         f"tpengine does not implement; use --max-model-len {window} or less "
                         f"(now {max_model_len})")
