"""Surgery: the name -> layer-kind table, and swapping modules of a meta-device HF model.

The table maps the leaf module name of every weight to its partition kind (see
:mod:`tpengine.plan`). The shard tool and the loader both use :func:`kind_of`, so a weight is
sliced the same way offline and online.
"""

from __future__ import annotations

import copy

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoModelForCausalLM

from tpengine import plan as P
from tpengine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tpengine.layers.linear import ColumnParallelLinear, RowParallelLinear

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


def build_meta_model(hf_config, dtype: torch.dtype):
    """The HF causal-LM for ``hf_config`` with every parameter and buffer on the meta device
    (accelerate's ``init_empty_weights``), attention set to tpengine's."""
    config = copy.deepcopy(hf_config)
    config._attn_implementation = "sdpa"  # interim (kernels branch): fuse_layers swaps attention for paged
    with init_empty_weights(include_buffers=True):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def apply_tensor_parallel(model: nn.Module, plan: P.ShardPlan, rank: int, dtype: torch.dtype) -> nn.Module:
    """Swap every ``nn.Linear``/``nn.Embedding`` of ``model`` for its parallel layer, by name, from
    :data:`LAYER_KINDS`, sized from ``plan.ranks[rank]`` (new parameters on meta). Attention
    modules get ``tp_q_to_kv`` (a [Hq_local] int64 buffer) and their local head counts.

    Raises:
        ValueError: an ``nn.Linear`` or ``nn.Embedding`` whose name is not in the table (never
            silently replicated).
    """
    rp = plan.ranks[rank]
    hd, hidden = plan.head_dim, plan.hidden_size
    for name, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        leaf = name.rsplit(".", 1)[-1]
        kind = LAYER_KINDS.get(leaf)
        if kind is None:
            raise ValueError(
                f"module {name!r} ({type(module).__name__}) is not in tpengine's layer table "
                f"(known: {', '.join(sorted(LAYER_KINDS))}); refusing to replicate it silently"
            )
        bias = getattr(module, "bias", None) is not None
        if kind == P.VOCAB:
            cls = VocabParallelEmbedding if isinstance(module, nn.Embedding) else ParallelLMHead
            new = cls(*rp.vocab, plan.vocab_size, hidden, dtype=dtype)
        elif kind in (P.Q, P.K, P.V, P.COLUMN):
            _, start, end = plan.slice_spec(kind, False, rank)
            new = ColumnParallelLinear(module.in_features, end - start, bias, dtype=dtype)
        else:
            _, start, end = plan.slice_spec(kind, False, rank)
            new = RowParallelLinear(end - start, module.out_features, bias, dtype=dtype)
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, leaf, new)
    for module in model.modules():
        if hasattr(module, "q_proj") and hasattr(module, "o_proj"):
            module.num_heads, module.num_key_value_heads = rp.num_q_heads, rp.num_kv_heads
            module.tp_q_to_kv = torch.tensor(rp.q_to_kv, dtype=torch.int64)
            assert module.head_dim == hd, (module.head_dim, hd)
    return model


# HF modules whose forward the fused modules reproduce exactly (tpengine.layers.fused)
FUSABLE_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")
FUSABLE_MLP = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
FUSABLE_NORM = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
FUSABLE_MODEL = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")


def fuse_layers(model: nn.Module) -> int:
    """After loading: swap every known HF attention module for a
    :class:`~tpengine.layers.fused.FusedAttention` (one q/k/v GEMM), every known gated MLP for a
    :class:`~tpengine.layers.fused.FusedMLP` (one gate/up GEMM) and every known RMSNorm for
    :class:`~tpengine.layers.fused.RMSNorm` (``F.rms_norm``). The fused weights are the
    concatenation of the loaded per-name ShardPlan slices; the separate ones are dropped. A known
    decoder stack whose layers are all fused runs :func:`~tpengine.layers.fused.lean_decoder_forward`.
    Other modules keep their HF forward. Returns the number of modules swapped."""
    import types

    from tpengine.layers.fused import FusedAttention, FusedMLP, RMSNorm, lean_decoder_forward

    swapped = 0
    for name, module in list(model.named_modules()):
        kind = type(module).__name__
        if kind in FUSABLE_ATTENTION and isinstance(getattr(module, "q_proj", None), ColumnParallelLinear):
            new = FusedAttention(module)
        elif kind in FUSABLE_MLP and isinstance(getattr(module, "gate_proj", None), ColumnParallelLinear):
            new = FusedMLP(module)
        elif kind in FUSABLE_NORM:
            new = RMSNorm(module)
        else:
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)
        swapped += 1
    for module in model.modules():
        if type(module).__name__ in FUSABLE_MODEL and all(
                isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedMLP)
                for layer in module.layers):
            module.forward = types.MethodType(lean_decoder_forward, module)
            swapped += 1
    return swapped



def pack_cpu_weights(model: nn.Module) -> int:
    """CPU, after loading and :func:`fuse_layers`: give every parallel linear layer and the LM head
    a oneDNN-packed copy of its weight (:func:`tpengine.layers.linear.prepack`; the weight itself
    stays, so this costs the memory of the linear weights once more). Returns the layers packed."""
    return sum(m.pack() for m in model.modules() if hasattr(m, "pack"))


def check_model_limits(hf_config, max_model_len: int) -> None:
    """Refuse settings the model cannot honour, before any weight is read.

    Raises:
        ValueError: ``max_model_len`` above the model's ``max_position_embeddings``, or a model
            whose sliding-window attention would start to matter below ``max_model_len``
            (tpengine's attention is full causal attention), naming both values.
    """
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} is larger than the model's "
                         f"max_position_embeddings={limit}; use --max-model-len {limit} or less")
    window = getattr(hf_config, "sliding_window", None)
    uses_window = getattr(hf_config, "use_sliding_window", True)  # Qwen2/3 carry a switch
    if window and uses_window and max_model_len > window:
        raise ValueError(f"this model uses sliding-window attention (sliding_window={window}), which "
                         f"tpengine does not implement; use --max-model-len {window} or less "
                         f"(now {max_model_len})")
