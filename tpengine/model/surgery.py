"""Surgery: the name -> layer-kind table, and building a rank's model in its final form.

The table maps the leaf module name of every checkpoint weight to its partition kind (see
:mod:`tpengine.model.plan`). The shard tool and the loader both use :func:`kind_of`, so a weight is
sliced the same way offline and online. :func:`build_model` turns a meta-device HF model into
tpengine's tensor-parallel one (fused q/k/v and gate/up layers from the start);
:func:`checkpoint_targets` says where each checkpoint tensor goes in it.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoModelForCausalLM

from tpengine.errors import UserError
from tpengine.model import families as F
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
    "gate": P.REPLICATED,  # a MoE layer's router (mlp.gate), held whole on every rank
    "shared_expert_gate": P.REPLICATED,  # Qwen2-MoE's shared expert's sigmoid gate [1, hidden]
}

#: a shared expert's leaf name -> its kind (tensors under ``...mlp.shared_expert.``)
SHARED_KINDS: dict[str, str] = {"gate_proj": P.SHARED_COLUMN, "up_proj": P.SHARED_COLUMN, "down_proj": P.SHARED_ROW}

#: a routed expert's leaf name -> its kind (tensors under ``...mlp.experts.<E>.``: :func:`expert_of`)
EXPERT_KINDS: dict[str, str] = {"gate_proj": P.EXPERT_COLUMN, "up_proj": P.EXPERT_COLUMN, "down_proj": P.EXPERT_ROW}


#: q/k norms over the whole projection (OLMo 2: ``[num_heads * head_dim]``) are split as the heads are
PROJECTION_NORM_KINDS = {"q_norm": P.Q, "k_norm": P.K}


def kind_of(param_name: str, ndim: int, numel: int | None = None, head_dim: int | None = None) -> str:
    """Partition kind of checkpoint tensor ``param_name`` (e.g.
    ``model.layers.0.self_attn.q_proj.weight``) with ``ndim`` dimensions (``numel`` elements, in a model
    of ``head_dim``: what tells a per-head q/k norm from one over the whole projection).

    1-D tensors not in the table (norm weights, per-head q_norm/k_norm) are replicated; a q_norm/k_norm
    of more than ``head_dim`` elements is split as the query/key heads are. A routed expert's tensor
    (tpengine's name ``...mlp.experts.<E>.gate_proj|up_proj|down_proj.weight``, see
    :func:`tpengine.model.families.checkpoint_name`) is an expert kind (:data:`EXPERT_KINDS`), a shared
    expert's (``...mlp.shared_expert.<leaf>.weight``) a shared kind (:data:`SHARED_KINDS`).

    Raises:
        ValueError: a 2-D or larger tensor whose module is not in the table; it would otherwise
            be silently replicated.
    """
    parts = param_name.split(".")
    leaf = parts[-2] if len(parts) >= 2 else parts[-1]
    if leaf in EXPERT_KINDS and expert_of(param_name) is not None:
        return EXPERT_KINDS[leaf]
    if leaf in SHARED_KINDS and len(parts) >= 3 and parts[-3] == "shared_expert":
        return SHARED_KINDS[leaf]
    if leaf in LAYER_KINDS:
        return LAYER_KINDS[leaf]
    if leaf in PROJECTION_NORM_KINDS and ndim == 1 and numel is not None and head_dim and numel != head_dim:
        return PROJECTION_NORM_KINDS[leaf]
    if ndim <= 1:
        return P.REPLICATED
    raise ValueError(
        f"tensor {param_name!r} ({ndim}-D) belongs to module {leaf!r}, which tpengine's layer table "
        f"does not cover (known: {', '.join(sorted(LAYER_KINDS))}); refusing to replicate it silently"
    )


def expert_of(param_name: str) -> int | None:
    """The routed expert a checkpoint tensor (tpengine's name) belongs to:
    ``model.layers.3.mlp.experts.5.up_proj.weight`` -> 5; None for any other tensor."""
    parts = param_name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "experts" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def holds(plan: P.ShardPlan, param_name: str, rank: int) -> bool:
    """Whether rank ``rank`` holds (a slice of) checkpoint tensor ``param_name`` (tpengine's name): every
    tensor but, under expert parallelism, the routed experts of the other ranks (:meth:`ShardPlan.holds_expert`)."""
    expert = expert_of(param_name)
    return expert is None or plan.holds_expert(expert, rank)


def kind_in(plan: P.ShardPlan, name: str, shape: tuple[int, ...]) -> str:
    """:func:`kind_of` for checkpoint tensor ``name`` of ``shape`` under ``plan`` (its head size)."""
    return kind_of(name, len(shape), math.prod(shape), plan.head_dim)


def build_meta_model(hf_config, dtype: torch.dtype) -> nn.Module:
    """The HF causal-LM for ``hf_config`` with every parameter and buffer on the meta device
    (accelerate's ``init_empty_weights``): the structure :func:`build_model` rebuilds."""
    with init_empty_weights(include_buffers=True):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=dtype)
    return model.eval()


def _unsupported(what: str, found: str, hf_config) -> UserError:
    return UserError(f"model_type {getattr(hf_config, 'model_type', '?')!r}: {what} {found!r} is not supported; "
                     f"tpengine runs {F.supported_names()}")


def _child(module: nn.Module, *names: str) -> nn.Module | None:
    return next((getattr(module, n) for n in names if isinstance(getattr(module, n, None), nn.Module)), None)


def _has_bias(module: nn.Module, *names: str) -> bool:
    child = _child(module, *names)
    return child is not None and getattr(child, "bias", None) is not None


def _no_row_bias(mlp: nn.Module) -> bool:
    """Whether ``mlp``'s output needs no bias after its all-reduce (a MoE block's experts have none)."""
    down = getattr(mlp, "down_proj", None)
    return down is None or down.bias is None


def _kv_share(plan: P.ShardPlan, rank: int) -> tuple[float, ...]:
    """Each of ``rank``'s KV heads' share in a sum over every KV head once: ``1 / (ranks holding it)``."""
    def holders(g: int) -> int:
        return sum(rp.kv_heads[0] <= g < rp.kv_heads[1] for rp in plan.ranks)
    return tuple(1.0 / holders(g) for g in range(*plan.ranks[rank].kv_heads))


def build_model(hf_config, plan: P.ShardPlan, rank: int, dtype: torch.dtype, device: torch.device,
                cpu_kernels: bool = True, stage: int = 0) -> nn.Module:
    """This rank's tensor-parallel model in its final form, weights still on meta.

    Builds HF's model for ``hf_config`` on the meta device, then swaps, by name, each decoder
    layer's ``self_attn`` for a :class:`~tpengine.model.layers.fused.FusedAttention` (one
    column-parallel q/k/v GEMM, row-parallel ``o_proj``), its ``mlp`` for a
    :class:`~tpengine.model.layers.fused.FusedMLP` (one gate/up GEMM, row-parallel ``down_proj``), every
    RMSNorm for :class:`~tpengine.model.layers.fused.RMSNorm`, ``embed_tokens``/``lm_head`` for the
    vocabulary-parallel layers, and HF's decoder stack for a
    :class:`~tpengine.model.layers.fused.DecoderStack` holding them; every size comes from ``plan.ranks[rank]``.
    What the family changes (:mod:`tpengine.model.families`: norm roles and form, scales, logit
    transforms) comes from its row; the softmax scale, sliding window, logit soft cap, q/k norms and
    RoPE tables from HF's own modules. RoPE tables and the per-layer ``tp_q_to_kv`` maps are real
    tensors on ``device``; the loader (:func:`tpengine.model.loader.load_model`) fills every parameter
    through :func:`checkpoint_targets`. Tied embeddings share one Parameter. Every layer gets the one
    element-wise ops object of the model, ``device``'s platform's
    (:meth:`tpengine.backends.platform.Platform.fused_ops`; ``cpu_kernels``: on the CPU the C kernels
    where they take the tensors, ``EngineConfig.cpu_kernels``).

    Pipeline stage ``stage`` of ``plan.pp_size`` keeps only its decoder layers
    (:meth:`~tpengine.model.plan.ShardPlan.stage_layers`; the stack's ``layer_offset`` is the first one's
    index, so checkpoint names stay global), the embedding on the first stage (and on the last when the
    embeddings are tied: the LM head's weight), the final norm and the LM head on the last; what a stage
    does not hold is None.

    Raises:
        UserError: a model type or config feature tpengine does not run (naming it and the families
            it runs: :func:`tpengine.model.families.check_config`).
        ValueError: an ``nn.Linear``/``nn.Embedding`` left that the layer table does not cover.
    """
    from tpengine.backends import get_platform
    from tpengine.model.layers.fused import DecoderStack

    F.check_config(hf_config)
    family = F.family_of(hf_config)
    model = build_meta_model(hf_config, dtype)
    stack = getattr(model, "model", None)
    if type(stack).__name__ != family.decoder:
        found = type(model).__name__ if stack is None else type(stack).__name__
        raise _unsupported("decoder", found, hf_config)
    b = _Builder(hf_config, family, plan, rank, dtype, device, get_platform(device).fused_ops(cpu_kernels))
    roles = [b.swap_layer(layer, stack.config) for layer in stack.layers]
    residual_scale = family.residual_scale(hf_config, dtype)
    reduce_in_norm = plan.tp_size > 1 and residual_scale is None and all(
        r[0] is not None and r[1] is None and r[2] is not None and r[3] is None for r in roles) and all(
        layer.self_attn.o_proj.bias is None and _no_row_bias(layer.mlp) for layer in stack.layers)
    rotary = type(stack.rotary_emb)(config=stack.config).to(device)  # real tables; honours rope scaling
    rope_types = [None] * len(roles)
    if "layer_type" in inspect.signature(rotary.forward).parameters:  # one table per layer type (Gemma 3)
        rope_types = list(stack.config.layer_types[: len(roles)])
    rp, hidden = plan.ranks[rank], plan.hidden_size
    lo, hi = plan.stage_layers(stage, len(roles))  # (every layer was swapped: reduce_in_norm is the model's)
    first, last = stage == 0, stage == plan.pp_size - 1
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    embed = (VocabParallelEmbedding(*rp.vocab, plan.vocab_size, hidden, dtype=dtype)
             if first or (last and tied) else None)
    layers = stack.layers if (lo, hi) == (0, len(roles)) else nn.ModuleList(list(stack.layers)[lo:hi])
    model.model = stack = DecoderStack(stack.config, embed, layers, b.norm(stack.norm) if last else None, rotary,
                                       reduce_in_norm, roles[lo:hi], family.embed_scale(hf_config, dtype),
                                       residual_scale, rope_types[lo:hi])
    stack.layer_offset, stack.first_stage = lo, first
    if getattr(rotary, "rope_type", None) == "longrope":  # (Phi-3's long contexts: per sequence, DecoderStack._rope)
        stack.longrope_bound = int(rotary.config.rope_parameters["original_max_position_embeddings"])
        stack.longrope_past = torch.tensor([stack.longrope_bound], dtype=torch.int64, device=device)
    model.lm_head = ParallelLMHead(*rp.vocab, plan.vocab_size, hidden, dtype=dtype, ops=b.ops,
                                   divisor=family.logits_divisor(hf_config, dtype),
                                   soft_cap=family.logits_soft_cap(hf_config, dtype)) if last else None
    if tied and last:
        model.lm_head.weight = stack.embed_tokens.weight
    left = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    if left:
        raise ValueError(f"modules {left} are not covered by tpengine's layer table "
                         f"(known: {', '.join(sorted(LAYER_KINDS))}); refusing to replicate them silently")
    return model


@dataclass(frozen=True)
class _Builder:
    """What :func:`build_model` swaps one HF decoder layer's modules for, on this rank: the family's row,
    the plan, the dtype, the device and the model's one ops object."""

    hf_config: Any
    family: F.Family
    plan: P.ShardPlan
    rank: int
    dtype: torch.dtype
    device: torch.device
    ops: Any

    def norm(self, m: nn.Module | None, size: int | None = None) -> nn.Module | None:
        """tpengine's RMSNorm for HF's norm ``m`` in the family's form (``size``: this rank's part of a
        norm over the whole projection); None for None.

        Raises:
            UserError: ``m`` is not an RMSNorm.
        """
        from tpengine.model.layers.fused import RMSNorm

        if m is None:
            return None
        if not type(m).__name__.endswith("RMSNorm"):
            raise _unsupported("norm", type(m).__name__, self.hf_config)
        eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
        return RMSNorm(size or m.weight.shape[0], eps, self.dtype, self.ops, self.family.norm_float32,
                       self.family.norm_offset)

    def attention(self, attn: nn.Module, config: Any) -> nn.Module:
        """The :class:`~tpengine.model.layers.fused.FusedAttention` for HF's attention ``attn``: its scale,
        window, soft cap and q/k norms (per head, or over the projection: this rank's part) read from it.

        Raises:
            UserError: no q/k/v or o projection; ValueError: a head size other than the plan's.
        """
        from tpengine.model.layers.fused import FusedAttention

        plan, rp = self.plan, self.plan.ranks[self.rank]
        if _child(attn, "q_proj", "qkv_proj") is None or _child(attn, "o_proj") is None:
            raise _unsupported("attention", type(attn).__name__, self.hf_config)
        if attn.head_dim != plan.head_dim:
            raise ValueError(f"attention head_dim {attn.head_dim} differs from the plan's {plan.head_dim}")
        qk_norms, spans = None, None
        if getattr(attn, "q_norm", None) is not None:  # per head, or over this rank's part of the projection
            if attn.q_norm.weight.shape[0] != plan.head_dim:
                spans = (plan.num_heads * plan.head_dim, plan.num_kv_heads * plan.head_dim)
            qk_norms = (self.norm(attn.q_norm, spans and rp.num_q_heads * plan.head_dim),
                        self.norm(attn.k_norm, spans and rp.num_kv_heads * plan.head_dim))
        window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
        return FusedAttention(
            plan.hidden_size, rp, plan.head_dim, _has_bias(attn, "q_proj", "qkv_proj"), _has_bias(attn, "o_proj"),
            attn.scaling, attn.layer_idx, qk_norms, self.dtype, self.device, self.ops, sliding_window=window or None,
            logit_soft_cap=getattr(attn, "attn_logit_softcapping", None), projection_sizes=spans,
            kv_share=_kv_share(plan, self.rank) if plan.tp_size > 1 else None)

    def mlp(self, mlp: nn.Module) -> nn.Module:
        """The :class:`~tpengine.model.layers.fused.FusedMLP` for HF's gated MLP ``mlp`` (its activation), or
        for a MoE family's sparse block (a router ``gate`` and ``experts``) the
        :class:`~tpengine.model.layers.moe.MoEBlock` of this rank's experts (:meth:`moe`).

        Raises:
            UserError: no gate/up or down projection, or no activation.
        """
        from tpengine.model.layers.fused import FusedMLP

        if self.family.moe is not None and _child(mlp, "experts") is not None:
            return self.moe(mlp)
        act = getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))
        if _child(mlp, "gate_proj", "gate_up_proj") is None or _child(mlp, "down_proj") is None or act is None:
            raise _unsupported("MLP", type(mlp).__name__, self.hf_config)
        return FusedMLP(self.plan.hidden_size, self.plan.ranks[self.rank].intermediate_size,
                        _has_bias(mlp, "gate_proj", "gate_up_proj"), _has_bias(mlp, "down_proj"), act, self.dtype,
                        self.ops)

    def moe(self, mlp: nn.Module) -> nn.Module:
        """The :class:`~tpengine.model.layers.moe.MoEBlock` for HF's sparse MLP ``mlp`` (HF's experts'
        activation; counts and router from the family's :class:`~tpengine.model.families.MoE` row), holding
        this rank's experts as the plan lays them out.

        Raises:
            UserError: HF's block has no router or no activation, or experts of another count than the plan's.
        """
        from tpengine.model.layers.fused import FusedMLP
        from tpengine.model.layers.moe import MoEBlock

        experts, moe, rp = mlp.experts, self.family.moe, self.plan.ranks[self.rank]
        act = getattr(experts, "act_fn", None)
        if _child(mlp, "gate") is None or act is None or int(experts.num_experts) != self.plan.num_experts:
            raise _unsupported("MoE block", type(mlp).__name__, self.hf_config)
        shared = None
        if _child(mlp, "shared_expert") is not None:  # Qwen2-MoE: split as a dense MLP, its own partial sum
            if _child(mlp, "shared_expert_gate") is None:
                raise _unsupported("MoE block", type(mlp).__name__, self.hf_config)
            rp_shared = rp.shared_expert_intermediate[1] - rp.shared_expert_intermediate[0]
            shared = FusedMLP(self.plan.hidden_size, rp_shared, False, False, mlp.shared_expert.act_fn, self.dtype,
                              self.ops)
        return MoEBlock(self.plan.hidden_size, self.plan.num_experts, int(self.hf_config.num_experts_per_tok),
                        rp.experts, rp.expert_intermediate_size, self.plan.expert_parallel,
                        moe.renormalizes(self.hf_config), moe.weights_in_dtype, act, self.dtype, self.ops, shared)

    def swap_layer(self, layer: nn.Module, config: Any) -> tuple:
        """Swap HF's decoder ``layer``'s attention, MLP and norms in place; returns its norms in the order
        of :data:`tpengine.model.families.ROLES` (None where the family has none).

        Raises:
            UserError: a module the family's row names is missing, or one of the above.
        """
        layer.self_attn = self.attention(layer.self_attn, config)
        layer.mlp = self.mlp(layer.mlp)
        names = self.family.norms
        named = [None if n is None else getattr(layer, n, None) for n in names]
        if any(n is not None and m is None for n, m in zip(names, named)):
            raise _unsupported("decoder layer", type(layer).__name__, self.hf_config)
        swapped = tuple(self.norm(m) for m in named)
        for n, m in zip(names, swapped):
            if n is not None:
                setattr(layer, n, m)
        return swapped


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
    ``lm_head.weight`` has no target (the LM head shares the embedding). A pipeline stage's layer ``i``
    is the checkpoint's ``model.layers.<layer_offset + i>``."""
    from tpengine.model.layers.linear import MergedColumnParallelLinear

    out: dict[str, Target] = {}
    offset = getattr(getattr(model, "model", None), "layer_offset", 0)
    for name, module in model.named_modules():
        if offset and name.startswith("model.layers."):
            index, _, rest = name.removeprefix("model.layers.").partition(".")
            name = f"model.layers.{int(index) + offset}" + (f".{rest}" if rest else "")
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


def stage_holds(plan: P.ShardPlan, name: str, stage: int, num_layers: int, tied: bool) -> bool:
    """Whether pipeline stage ``stage`` of ``plan`` (a model of ``num_layers`` decoder layers, ``tied``
    embeddings) keeps checkpoint tensor ``name``: a layer's if the layer is in its range, the embedding on
    the first stage (and the last when tied), the final norm and the LM head on the last; anything else
    on every stage. Always True with one stage."""
    if plan.pp_size == 1:
        return True
    first, last = stage == 0, stage == plan.pp_size - 1
    if name.startswith("model.layers."):
        lo, hi = plan.stage_layers(stage, num_layers)
        index = name.removeprefix("model.layers.").partition(".")[0]
        return not index.isdigit() or lo <= int(index) < hi
    if name.startswith("model.embed_tokens."):
        return first or (last and tied)
    if name.startswith(("model.norm.", "lm_head.")):
        return last
    return True


def check_model_limits(hf_config, max_model_len: int) -> None:
    """Refuse settings the model cannot honour, before any weight is read. (Sliding-window layers need
    no limit: the window is a property of each attention call.)

    Raises:
        UserError: a model type or feature tpengine does not run
            (:func:`tpengine.model.families.check_config`), or ``max_model_len`` above the model's
            ``max_position_embeddings``, naming both values.
    """
    F.check_config(hf_config)
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and max_model_len > limit:
        raise UserError(f"max_model_len={max_model_len} is larger than the model's "
                         f"max_position_embeddings={limit}; use --max-model-len {limit} or less")
