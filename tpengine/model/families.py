"""The decoder families tpengine runs, as data: what each changes from Llama, in one table.

Every family here is a Llama-style decoder (token embedding, N blocks of attention and a gated MLP on a
residual stream, a final norm, a vocabulary head). What differs is declared in :class:`Family` and read
by surgery (:func:`tpengine.model.surgery.build_model`), the ``ShardPlan``'s layer kinds and the
loader; the layers' forwards read the values these give (a window, a cap, a scale, which norm sits where)
and branch on no family name. HF's ``modeling_<family>.py`` is the oracle for each row (transformers
5.x):

* norm placement: Llama normalizes before each sub-block (``input_layernorm``, ``post_attention_layernorm``);
  Gemma 2/3 also normalize each sub-block's output before the residual add
  (``post_attention_layernorm``, ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``); OLMo 2
  normalizes only the outputs (``post_attention_layernorm``, ``post_feedforward_layernorm``);
* norm form: Llama rounds the normalized value to the model's dtype, then multiplies by the weight;
  Gemma and OLMo 2 multiply in float32 and round once, Gemma by ``1 + weight``
  (:attr:`Family.norm_offset`, folded into the float32 weight at load);
* scales: Gemma multiplies the embeddings by ``sqrt(hidden_size)`` rounded to the model's dtype, Granite by
  ``embedding_multiplier`` and each sub-block's output by ``residual_multiplier`` and divides the logits by
  ``logits_scaling``; Gemma 2 soft-caps the logits (``final_logit_softcapping``);
* checkpoint tensors: Phi-3 stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``
  (:func:`fused_parts` names their row ranges, so every reader sees the unfused names);
* mixture of experts (:class:`MoE`, Mixtral and Qwen3-MoE): a layer's MLP is a router and routed experts,
  each a gated MLP of its own; where the config's counts live, how the router weighs the top-k, and
  Mixtral's checkpoint names (``block_sparse_moe.experts.E.w1/w3/w2``) as tpengine's
  (``mlp.experts.E.gate_proj/up_proj/down_proj``, Qwen3-MoE's own: :func:`checkpoint_name`).

The attention-side values (the softmax scale, the sliding window, the logit soft cap, q/k norms and
their span, RoPE tables per layer type) are read from HF's own meta-device modules, which compute
them from the config the same way for every family.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tpengine.errors import UserError

#: a block's four norm roles, in order: before attention, after attention, before the MLP, after the MLP
ROLES = ("pre_attn", "post_attn", "pre_mlp", "post_mlp")
LLAMA_NORMS = ("input_layernorm", None, "post_attention_layernorm", None)
SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")
POST_NORMS = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")


def _none(config: Any, dtype: torch.dtype) -> float | None:
    return None


def _gemma_embed_scale(config: Any, dtype: torch.dtype) -> float:
    # HF keeps sqrt(hidden) in a float32 buffer and casts it to the weights' dtype before multiplying
    return float(torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32).to(dtype))


def _attr(name: str) -> Callable[[Any, torch.dtype], float | None]:
    def read(config: Any, dtype: torch.dtype) -> float | None:
        value = getattr(config, name, None)
        return None if value is None else float(value)
    return read


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts family's sparse MLP, as HF's ``modeling_mixtral.py`` / ``modeling_qwen3_moe.py``
    (transformers 5) compute it. The router: ``logits = x @ gate.T`` in the model's dtype, ``softmax`` of
    them in float32 over every expert, the ``top_k`` largest, divided by their sum where ``renormalize``
    says (Mixtral always; Qwen3-MoE when ``norm_topk_prob``), and cast back to the model's dtype where
    ``weights_in_dtype`` (Qwen3-MoE; Mixtral keeps them float32). Each chosen expert's
    ``down(act(gate(x)) * up(x))`` times its weight is summed per token.

    ``experts`` / ``intermediate``: the config fields of the routed experts' count and each expert's
    intermediate size; ``renormalize``: a config field (its value decides) or True; ``renames``:
    checkpoint-name pieces -> tpengine's (Mixtral's HF 4 names, which its checkpoints hold); ``dense``:
    ``(config, layer index) -> bool``, a layer whose MLP is dense (Qwen3-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step``).
    """

    experts: str
    intermediate: str
    renormalize: str | bool = True
    weights_in_dtype: bool = False
    renames: tuple[tuple[str, str], ...] = ()
    dense: Callable[[Any, int], bool] = lambda config, i: False

    def num_experts(self, config: Any) -> int:
        return int(getattr(config, self.experts))

    def expert_intermediate(self, config: Any) -> int:
        return int(getattr(config, self.intermediate))

    def renormalizes(self, config: Any) -> bool:
        return self.renormalize if isinstance(self.renormalize, bool) else bool(getattr(config, self.renormalize))


def _qwen3_moe_dense(config: Any, i: int) -> bool:
    # HF's Qwen3MoeDecoderLayer: sparse unless in mlp_only_layers or off the decoder_sparse_step
    return (i in (getattr(config, "mlp_only_layers", None) or []) or int(config.num_experts) <= 0
            or (i + 1) % int(getattr(config, "decoder_sparse_step", 1) or 1) != 0)


@dataclass(frozen=True)
class Family:
    """One decoder family's differences from Llama (see the module docstring).

    ``name``: what README and errors call it; ``decoder``: HF's decoder-stack class (``model.model``);
    ``norms``: the decoder layer's norm attribute for each of :data:`ROLES` (None: no norm there);
    ``norm_offset``: a constant added to every norm weight (Gemma's ``1 + weight``); ``norm_float32``: the
    norm multiplies by its weight in float32 and rounds once; ``embed_scale`` / ``residual_scale`` /
    ``logits_divisor`` / ``logits_soft_cap``: ``(config, dtype) -> float | None``; ``fused``: a checkpoint
    tensor that holds several of tpengine's parts -> the part names, in row order; ``moe``: a
    mixture-of-experts family's sparse MLP (:class:`MoE`), None for a dense one.
    """

    name: str
    decoder: str
    norms: tuple[str | None, str | None, str | None, str | None] = LLAMA_NORMS
    norm_offset: float = 0.0
    norm_float32: bool = False
    embed_scale: Callable[[Any, torch.dtype], float | None] = _none
    residual_scale: Callable[[Any, torch.dtype], float | None] = _none
    logits_divisor: Callable[[Any, torch.dtype], float | None] = _none
    logits_soft_cap: Callable[[Any, torch.dtype], float | None] = _none
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    moe: MoE | None = None


GEMMA = dict(norms=SANDWICH_NORMS, norm_offset=1.0, norm_float32=True, embed_scale=_gemma_embed_scale)

#: HF ``model_type`` -> its family. A new Llama-like family is a row here (and a test).
FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", "LlamaModel"),
    "mistral": Family("Mistral", "MistralModel"),
    "qwen2": Family("Qwen2", "Qwen2Model"),
    "qwen3": Family("Qwen3", "Qwen3Model"),
    "gemma": Family("Gemma", "GemmaModel", norm_offset=1.0, norm_float32=True, embed_scale=_gemma_embed_scale),
    "gemma2": Family("Gemma 2", "Gemma2Model", **GEMMA, logits_soft_cap=_attr("final_logit_softcapping")),
    "gemma3_text": Family("Gemma 3", "Gemma3TextModel", **GEMMA, logits_soft_cap=_attr("final_logit_softcapping")),
    "phi3": Family("Phi-3", "Phi3Model", fused={"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                                "gate_up_proj": ("gate_proj", "up_proj")}),
    "olmo2": Family("OLMo 2", "Olmo2Model", norms=POST_NORMS, norm_float32=True),
    "olmo3": Family("OLMo 3", "Olmo3Model", norms=POST_NORMS, norm_float32=True),  # OLMo 2 + sliding layers
    "granite": Family("Granite", "GraniteModel", embed_scale=_attr("embedding_multiplier"),
                      residual_scale=_attr("residual_multiplier"), logits_divisor=_attr("logits_scaling")),
    "mixtral": Family("Mixtral", "MixtralModel", moe=MoE(
        "num_local_experts", "intermediate_size", renames=(
            (".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")))),
    "qwen3_moe": Family("Qwen3-MoE", "Qwen3MoeModel", moe=MoE(
        "num_experts", "moe_intermediate_size", renormalize="norm_topk_prob", weights_in_dtype=True,
        dense=_qwen3_moe_dense)),
    # Qwen3-MoE's router and layer rule, plus a shared expert behind a sigmoid gate on every sparse layer
    "qwen2_moe": Family("Qwen2-MoE", "Qwen2MoeModel", moe=MoE(
        "num_experts", "moe_intermediate_size", renormalize="norm_topk_prob", weights_in_dtype=True,
        dense=_qwen3_moe_dense)),
}


def family_of(hf_config: Any) -> Family:
    """The :class:`Family` of ``hf_config`` (by its ``model_type``).

    Raises:
        UserError: a model type tpengine does not run, naming it and the ones it runs.
    """
    model_type = getattr(hf_config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise UserError(f"model_type {model_type!r} is not supported; tpengine runs "
                        f"{', '.join(sorted(FAMILIES))} ({supported_names()})")
    return family


def supported_names() -> str:
    """The families' names, for messages: ``"Llama, Mistral, ..."``."""
    return ", ".join(f.name for f in FAMILIES.values())


def fused_parts(hf_config: Any) -> dict[str, list[tuple[str, int]]]:
    """A fused checkpoint tensor's leaf name (``qkv_proj``) -> its parts as ``(leaf name, rows)`` in row
    order, for ``hf_config``'s family (empty for most): what :func:`unfuse_name` and the readers split on."""
    family = FAMILIES.get(getattr(hf_config, "model_type", None))
    if family is None or not family.fused:
        return {}
    nh = int(hf_config.num_attention_heads)
    nkv = int(getattr(hf_config, "num_key_value_heads", None) or nh)
    hd = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // nh)
    rows = {"q_proj": nh * hd, "k_proj": nkv * hd, "v_proj": nkv * hd,
            "gate_proj": int(hf_config.intermediate_size), "up_proj": int(hf_config.intermediate_size)}
    return {leaf: [(p, rows[p]) for p in parts] for leaf, parts in family.fused.items()}


def unfuse(name: str, shape: tuple[int, ...], parts: dict[str, list[tuple[str, int]]]
           ) -> list[tuple[str, int, int]] | None:
    """The parts of checkpoint tensor ``name`` of ``shape`` when it is a fused one in ``parts``
    (:func:`fused_parts`): ``[(part's checkpoint name, first row, rows), ...]``, e.g.
    ``model.layers.0.self_attn.qkv_proj.weight`` -> ``...q_proj.weight`` rows ``0:Hq*D``, ...; None for
    any other tensor.

    Raises:
        ValueError: a fused tensor whose first dimension is not the parts' total, naming both.
    """
    if not parts:
        return None
    bits = name.split(".")
    if len(bits) < 2 or bits[-2] not in parts:
        return None
    layout = parts[bits[-2]]
    total = sum(r for _, r in layout)
    if not shape or shape[0] != total:
        raise ValueError(f"checkpoint tensor {name!r} has shape {list(shape)}; its parts "
                         f"{', '.join(f'{p} ({r} rows)' for p, r in layout)} need {total} rows")
    out, start = [], 0
    for part, rows in layout:
        out.append((".".join(bits[:-2] + [part, bits[-1]]), start, rows))
        start += rows
    return out


def check_config(hf_config: Any) -> None:
    """Refuse, before any weight is read, a config feature no layer of tpengine computes.

    Raises:
        UserError: the model type is not supported (:func:`family_of`), or a feature of it is not
            (partial rotary embeddings), naming the field and its value.
    """
    family = family_of(hf_config)
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None and not math.isclose(float(partial), 1.0):
        raise UserError(f"model_type {hf_config.model_type!r}: partial_rotary_factor={partial} (RoPE on part of "
                        "each head) is not supported; tpengine rotates whole heads (partial_rotary_factor 1.0)")
    if family.moe is not None:
        _check_moe(hf_config, family.moe)


#: the router scoring a MoE family's row computes (a config naming another is refused)
ROUTER_SCORING = "softmax"


def _check_moe(hf_config: Any, moe: MoE) -> None:
    """Refuse a MoE config whose router or expert counts no layer computes: one ``UserError`` naming the field.
    """
    mtype = hf_config.model_type
    scoring = getattr(hf_config, "scoring_func", None)
    if scoring is not None and scoring != ROUTER_SCORING:
        raise UserError(f"model_type {mtype!r}: scoring_func={scoring!r} (the router's scoring) is not supported; "
                        f"tpengine's router computes {ROUTER_SCORING!r} over the experts, then the top k")
    experts = getattr(hf_config, moe.experts, None)
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    if not isinstance(experts, int) or experts < 1:
        raise UserError(f"model_type {mtype!r}: {moe.experts}={experts!r} must be an integer >= 1 (the routed "
                        "experts of each sparse layer)")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise UserError(f"model_type {mtype!r}: num_experts_per_tok={top_k!r} must be an integer between 1 and "
                        f"{moe.experts}={experts}")
    size = getattr(hf_config, moe.intermediate, None)
    if not isinstance(size, int) or size < 1:
        raise UserError(f"model_type {mtype!r}: {moe.intermediate}={size!r} must be an integer >= 1 (each "
                        "expert's intermediate size)")


def has_dense_mlp(hf_config: Any) -> bool:
    """Whether some decoder layer of ``hf_config`` has a dense MLP (every layer of a dense family; a MoE
    family's layers its :attr:`MoE.dense` names, none of Mixtral's)."""
    family = FAMILIES.get(getattr(hf_config, "model_type", None))
    if family is None or family.moe is None:
        return True
    return any(family.moe.dense(hf_config, i) for i in range(int(hf_config.num_hidden_layers)))


def checkpoint_name(name: str, hf_config: Any) -> str:
    """Checkpoint tensor ``name`` as tpengine names it: a MoE family's renames applied (Mixtral's
    ``model.layers.0.block_sparse_moe.experts.3.w1.weight`` -> ``model.layers.0.mlp.experts.3.gate_proj.weight``,
    the router ``...block_sparse_moe.gate.weight`` -> ``...mlp.gate.weight``); any other name unchanged."""
    family = FAMILIES.get(getattr(hf_config, "model_type", None))
    if family is None or family.moe is None:
        return name
    for old, new in family.moe.renames:
        name = name.replace(old, new)
    return name


def renamed(infos: dict, hf_config: Any) -> dict:
    """A safetensors header's tensors (name -> ``TensorInfo``) under tpengine's names
    (:func:`checkpoint_name`), and a MoE layer's experts stored fused as transformers 5 holds them in
    memory (``mlp.experts.gate_up_proj [E, 2 I, H]``: each expert's gate rows, then its up rows;
    ``mlp.experts.down_proj [E, H, I]``) as each expert's tensors (``mlp.experts.<e>.gate_proj.weight``
    ...): every one a contiguous block of the fused tensor, read like any other. Each info's own
    ``name`` stays the file's, so errors name what the file holds. Order kept; the same dict for a
    family without either.

    Raises:
        ValueError: a fused expert tensor whose shape is not ``[E, 2 I, H]`` / ``[E, H, I]``, naming it.
    """
    family = FAMILIES.get(getattr(hf_config, "model_type", None))
    if family is None or family.moe is None:
        return infos
    out = {}
    for name, info in infos.items():
        name = checkpoint_name(name, hf_config)
        base, _, leaf = name.rpartition(".")
        if base.endswith(".experts") and leaf in ("gate_up_proj", "down_proj"):
            out.update(_expert_parts(base, leaf, info, family.moe.expert_intermediate(hf_config)))
        else:
            out[name] = info
    return out


def _expert_parts(base: str, leaf: str, info: Any, inter: int) -> dict:
    """A fused expert tensor's per-expert ``TensorInfo``s (see :func:`renamed`)."""
    from tpengine.model.tensor_file import TensorInfo

    shape = tuple(info.shape)
    rows = 2 * inter if leaf == "gate_up_proj" else None
    if len(shape) != 3 or (rows is not None and shape[1] != rows) or (rows is None and shape[2] != inter):
        want = "[experts, 2 x intermediate, hidden]" if rows else "[experts, hidden, intermediate]"
        raise ValueError(f"checkpoint tensor {info.name!r} has shape {list(shape)}; a fused {leaf} is {want} "
                         f"with intermediate {inter}")
    per = info.nbytes // shape[0]
    out = {}
    for e in range(shape[0]):
        start = info.offset + e * per
        if rows is None:
            out[f"{base}.{e}.down_proj.weight"] = TensorInfo(info.name, info.dtype, shape[1:], start, per)
            continue
        for i, part in enumerate(("gate_proj", "up_proj")):
            out[f"{base}.{e}.{part}.weight"] = TensorInfo(info.name, info.dtype, (inter, shape[2]),
                                                          start + i * per // 2, per // 2)
    return out


def expand_fused(infos: dict, parts: dict[str, list[tuple[str, int]]]) -> dict:
    """A safetensors header's tensors (name -> :class:`tpengine.model.tensor_file.TensorInfo`, from
    :func:`~tpengine.model.tensor_file.read_header`) with each fused tensor of ``parts``
    (:func:`fused_parts`) replaced by its parts: each part is a range of whole rows, so it is itself a
    contiguous tensor in the file (its own offset and size), read like any other. Order kept.

    Raises:
        ValueError: a fused tensor whose rows are not its parts' total (:func:`unfuse`).
    """
    if not parts:
        return infos
    from tpengine.model.tensor_file import TensorInfo

    out = {}
    for name, info in infos.items():
        split = unfuse(name, info.shape, parts)
        if split is None:
            out[name] = info
            continue
        row = info.nbytes // info.shape[0]
        for part, start, rows in split:
            out[part] = TensorInfo(part, info.dtype, (rows, *info.shape[1:]), info.offset + start * row, rows * row)
    return out
