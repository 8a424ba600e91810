"""GGUF files of the newer decoder families -> Hugging Face configs and tensor processors.

transformers' GGUF loader (``transformers.modeling_gguf_pytorch_utils``) reads Llama, Qwen2 and
Qwen3 files faithfully, and ``tpengine-shard convert`` keeps using it for them. For the families
below it either has no mapping at all (``gemma``, ``olmo2``, ``granite``) or drops metadata the model
needs (``gemma2``: both soft caps; ``gemma3``: the local RoPE base, the sliding-layer pattern, the
RoPE scaling of the global layers; ``phi3``: the sliding window and long-context RoPE factors), so
this module builds their configs itself from the keys llama.cpp's ``convert_hf_to_gguf.py`` writes,
and fills in what llama.cpp's runtime assumes when a key is absent (``src/llama-model.cpp``):

* ``gemma`` / ``gemma2`` / ``gemma3``: norms stored as ``w + 1`` (undone by transformers'
  ``Gemma2TensorProcessor``); the LM head is always the embedding (llama.cpp drops ``lm_head`` for
  Gemma 1/2); the query scale is ``head_dim ** -0.5`` except for the 27B models (46 layers for
  Gemma 2, 62 for Gemma 3), which use ``(hidden / heads) ** -0.5``, as llama.cpp decides; Gemma 2
  slides on every other layer (window 4096 and soft caps 50 / 30 unless stated), Gemma 3 on 5 of
  every 6 (RoPE base 10000 for those unless ``rope.freq_base_swa`` is stated). A ``gemma3`` file
  holds the text model only: it becomes ``gemma3_text``.
* ``phi3``: fused ``attn_qkv`` / ``ffn_up`` are HF's own ``qkv_proj`` / ``gate_up_proj``; a sliding
  window of 0 means none; ``rope_factors_long`` / ``rope_factors_short`` tensors are LongRoPE factors.
* ``olmo2``: stored as HF has it (NeoX RoPE, so no Q/K row permutation); a sliding window marks
  OLMo 3, which is refused.
* ``granite``: converted as Llama, so Q/K rows carry llama.cpp's permutation (undone by
  ``LlamaTensorProcessor``); ``attention.scale`` / ``embedding_scale`` / ``residual_scale`` /
  ``logit_scale`` are HF's ``attention_multiplier`` / ``embedding_multiplier`` /
  ``residual_multiplier`` / ``logits_scaling`` (absent: llama.cpp's ``head_dim ** -0.5`` and 1).

* mixture of experts (issue 56): ``llama`` with ``llama.expert_count`` (Mixtral, converted as Llama: Q/K
  rows permuted) becomes ``mixtral``; ``qwen3moe`` becomes ``qwen3_moe`` (``expert_feed_forward_length``
  is ``moe_intermediate_size``; every layer sparse and ``norm_topk_prob`` true unless
  ``expert_weights_norm`` says otherwise, as llama.cpp's runtime assumes). A layer's experts are three
  3-D tensors, ``ffn_gate_exps`` / ``ffn_up_exps`` [experts, intermediate, hidden] and ``ffn_down_exps``
  [experts, hidden, intermediate] (torch order), and its router ``ffn_gate_inp`` [experts, hidden];
  :func:`moe_parts` cuts them into HF's per-expert checkpoint tensors (:data:`MOE_CHECKPOINT`), the
  names ``save_pretrained`` writes and released checkpoints hold.

Float metadata is stored as float32; each float is read back as the shortest decimal that rounds to
that float32 (``1e-06`` rather than ``9.99999997e-07``), the value a config file would have held.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from tpengine.errors import UserError

#: GGUF ``general.architecture`` values transformers' own loader converts (config and tensors).
TRANSFORMERS_ARCHS = ("llama", "qwen2", "qwen3")
#: GGUF architectures whose config this module builds -> the HF ``model_type`` they become.
FAMILY_ARCHS = {"gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3",
                "olmo2": "olmo2", "granite": "granite", "qwen3moe": "qwen3_moe"}
#: HF model type of a ``llama`` file with experts
MIXTRAL = "mixtral"
#: HF MoE model type -> (router name, expert weight name, {GGUF projection: HF projection}) in the checkpoint
MOE_CHECKPOINT = {
    MIXTRAL: ("model.layers.{i}.block_sparse_moe.gate.weight",
              "model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight", {"gate": "w1", "up": "w3", "down": "w2"}),
    "qwen3_moe": ("model.layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.experts.{e}.{w}.weight",
                  {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
}
#: a GGUF MoE tensor: the router or one of the three stacked expert projections of layer ``i``
_MOE_TENSOR = re.compile(r"blk\.(?P<i>\d+)\.ffn_(?:(?P<router>gate_inp)|(?P<w>gate|up|down)_exps)\.weight")
#: a transformers module's fused MoE parameter (the experts' 3-D tensors, the router)
_MOE_MODULE = re.compile(r"model\.layers\.(?P<i>\d+)\.mlp\.(?:experts\.\w+|gate\.weight)")
#: Every GGUF architecture ``convert`` accepts.
SUPPORTED_ARCHS = TRANSFORMERS_ARCHS + tuple(FAMILY_ARCHS)

#: llama.cpp's layer counts of the 27B Gemma models, whose query scale is (hidden / heads) ** -0.5
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
#: llama.cpp's sliding-window layer pattern: layer i slides unless (i + 1) % n == 0
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}


def check_architecture(arch: str, path: str) -> None:
    """Raise unless ``convert`` converts GGUF architecture ``arch``.

    Raises:
        UserError: naming ``arch``, the file and the supported architectures.
    """
    if arch not in SUPPORTED_ARCHS:
        raise UserError(f"GGUF file {path!r} has architecture {arch!r}, which convert does not support; "
                        f"supported: {', '.join(SUPPORTED_ARCHS)}")


def builds_config(gguf) -> bool:
    """Whether :func:`build_config` (not transformers' loader) makes ``gguf``'s config: one of
    :data:`FAMILY_ARCHS`, or a ``llama`` file with experts (Mixtral)."""
    arch = gguf.architecture
    return arch in FAMILY_ARCHS or (arch == "llama" and bool(gguf.metadata.get("llama.expert_count")))


def moe_parts(model_type: str, tensor, num_experts: int) -> list[tuple[str, Any]] | None:
    """HF checkpoint tensors of GGUF tensor ``tensor`` (a :class:`shard_tool.gguf_file.GGUFTensor`)
    of a ``model_type`` model with :data:`MOE_CHECKPOINT` names: ``[(HF name, GGUFTensor)]``, one per
    expert for a stacked ``ffn_*_exps`` tensor (its 2-D slice, rows of whole blocks, so a quantized
    one stays quantized), the router ``ffn_gate_inp`` renamed; None for any other tensor.

    Raises:
        UserError: a stacked tensor whose first dimension is not ``num_experts``.
    """
    m = _MOE_TENSOR.fullmatch(tensor.name)
    if m is None or model_type not in MOE_CHECKPOINT:
        return None
    router, expert, projections = MOE_CHECKPOINT[model_type]
    i = int(m["i"])
    if m["router"]:
        return [(router.format(i=i), tensor)]
    if len(tensor.shape) != 3 or tensor.shape[0] != num_experts:
        raise UserError(f"GGUF tensor {tensor.name!r} has shape {list(tensor.shape)}; expected {num_experts} "
                        "experts' stacked [experts, rows, columns] weights")
    return [(expert.format(i=i, e=e, w=projections[m["w"]]), type(tensor)(tensor.name, tensor.shape[1:],
                                                                            tensor.qtype, tensor.data[e]))
            for e in range(num_experts)]


def checkpoint_names(model_type: str, module_names: list[str], num_experts: int) -> list[str]:
    """The tensor names a ``model_type`` checkpoint holds, from its transformers module's
    ``module_names`` (state-dict keys): the same, except that each sparse layer's fused experts and
    router become :data:`MOE_CHECKPOINT`'s per-expert names (what ``save_pretrained`` writes)."""
    if model_type not in MOE_CHECKPOINT:
        return module_names
    router, expert, projections = MOE_CHECKPOINT[model_type]
    layers = sorted({int(m["i"]) for n in module_names if (m := _MOE_MODULE.fullmatch(n))})
    out = [n for n in module_names if not _MOE_MODULE.fullmatch(n)]
    for i in layers:
        out.append(router.format(i=i))
        out += [expert.format(i=i, e=e, w=w) for e in range(num_experts) for w in projections.values()]
    return out


def _moe_fields(m: _Meta, arch: str, head_dim: int) -> dict[str, Any]:
    """The config fields of a MoE file (``llama`` with experts, ``qwen3moe``) beyond the common ones."""
    fields: dict[str, Any] = {"head_dim": head_dim, "num_experts_per_tok": m.need("expert_used_count"),
                              "hidden_act": "silu"}
    if arch == "llama":
        return {**fields, "num_local_experts": m.need("expert_count")}
    return {**fields, "num_experts": m.need("expert_count"),
            "moe_intermediate_size": m.need("expert_feed_forward_length"),
            "norm_topk_prob": bool(m.get("expert_weights_norm", True)), "decoder_sparse_step": 1,
            "mlp_only_layers": []}


def _decimal(x: Any) -> Any:
    """A float32 metadata value as the shortest decimal that rounds to it; anything else as is."""
    if isinstance(x, float):
        return float(str(np.float32(x)))
    if isinstance(x, list):
        return [_decimal(v) for v in x]
    return x


class _Meta:
    """One file's ``{arch}.*`` keys (``get("attention.head_count")``), floats as :func:`_decimal`."""

    def __init__(self, gguf, arch: str) -> None:
        self.metadata, self.arch, self.path = gguf.metadata, arch, gguf.path

    def get(self, key: str, default: Any = None, *, arch: bool = True) -> Any:
        value = self.metadata.get(f"{self.arch}.{key}" if arch else key)
        return default if value is None else _decimal(value)

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise UserError(f"GGUF file {self.path!r} lacks the metadata key {self.arch}.{key}, which a "
                            f"{self.arch} model needs")
        return value


def build_config(gguf):
    """The transformers config of ``gguf`` (a :class:`shard_tool.gguf_file.GGUFFile`) of one of
    :data:`FAMILY_ARCHS`, with ``dtype`` and ``architectures`` left for the caller to set.

    Sizes come from the metadata, the vocabulary from ``token_embd``'s rows (llama.cpp may trim a
    padded HF vocabulary to the tokenizer's), tying from whether ``output.weight`` exists.

    Raises:
        UserError: another architecture, a missing required key, or a variant tpengine does not run
            (OLMo 3's sliding windows, a RoPE scaling type other than the family's).
    """
    from transformers import AutoConfig

    arch, path, tensors = gguf.architecture, gguf.path, gguf.tensors
    if not builds_config(gguf):
        check_architecture(arch, path)
        raise UserError(f"GGUF architecture {arch!r} is converted by transformers, not by build_config")
    m = _Meta(gguf, arch)
    if "token_embd.weight" not in tensors:
        raise UserError(f"GGUF file {path!r} has no token_embd.weight tensor")
    heads = m.need("attention.head_count")
    hidden = m.need("embedding_length")
    cfg: dict[str, Any] = {
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": m.need("feed_forward_length"),
        "num_hidden_layers": m.need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": m.get("attention.head_count_kv", heads),
        "max_position_embeddings": m.need("context_length"),
        "rms_norm_eps": m.need("attention.layer_norm_rms_epsilon"),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    for hf_key, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        value = m.get(f"tokenizer.ggml.{key}", arch=False)
        if value is not None:
            cfg[hf_key] = value
    head_dim = m.get("attention.key_length") or m.get("rope.dimension_count") or hidden // heads
    theta = m.get("rope.freq_base", 10000.0)  # llama.cpp's default when the file has none
    rope = {"rope_type": "default", "rope_theta": theta}
    scaling = m.get("rope.scaling.type")
    if scaling not in (None, "none"):
        if arch == "gemma3" and scaling == "linear":
            rope = {"rope_type": "linear", "rope_theta": theta, "factor": m.need("rope.scaling.factor")}
        elif not (arch == "phi3" and scaling == "longrope"):
            raise UserError(f"GGUF file {path!r}: rope.scaling.type {scaling!r} is not supported for {arch}")

    if arch in ("gemma", "gemma2", "gemma3"):
        cfg["head_dim"] = head_dim
        cfg["hidden_activation" if arch != "gemma" else "hidden_act"] = "gelu_pytorch_tanh"
        if arch == "gemma":
            cfg["rope_parameters"] = rope
        else:
            big = cfg["num_hidden_layers"] == GEMMA_27B_LAYERS[arch]
            cfg["query_pre_attn_scalar"] = hidden // heads if big else head_dim
            window = m.get("attention.sliding_window", 4096 if arch == "gemma2" else 0)
            # llama.cpp's defaults when a Gemma 2 file states no cap: 30 on the logits, 50 on attention
            cfg["final_logit_softcapping"] = m.get("final_logit_softcapping", 30.0 if arch == "gemma2" else None)
            cfg["attn_logit_softcapping"] = m.get("attn_logit_softcapping", 50.0) if arch == "gemma2" else None
            pattern = m.get("attention.sliding_window_pattern")
            n = SWA_PATTERN[arch]
            if not window:  # no sliding window stated: every layer attends to the whole context
                sliding = [False] * cfg["num_hidden_layers"]
                window = None
            elif isinstance(pattern, list):
                sliding = [bool(s) for s in pattern]
            else:
                sliding = [(i + 1) % n != 0 for i in range(cfg["num_hidden_layers"])]
            cfg["sliding_window"] = window
            cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
            if arch == "gemma2":
                cfg["rope_parameters"] = rope
            else:
                local = {"rope_type": "default", "rope_theta": m.get("rope.freq_base_swa", 10000.0)}
                cfg["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    elif arch == "phi3":
        cfg["hidden_act"] = "silu"
        cfg["sliding_window"] = m.get("attention.sliding_window") or None
        cfg["original_max_position_embeddings"] = m.get("rope.scaling.original_context_length",
                                                        cfg["max_position_embeddings"])
        rope_dims = m.get("rope.dimension_count", head_dim)
        rope["partial_rotary_factor"] = rope_dims / head_dim
        if "rope_factors_long.weight" in tensors:
            from gguf import dequantize

            def factors(name: str) -> list[float]:
                t = tensors[name]
                return _decimal([float(x) for x in dequantize(t.data, t.qtype).reshape(-1)])

            rope.update(rope_type="longrope", long_factor=factors("rope_factors_long.weight"),
                        short_factor=factors("rope_factors_short.weight"))
            rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        cfg["rope_parameters"] = rope
    elif arch in ("llama", "qwen3moe"):  # mixture of experts (builds_config: llama with experts)
        cfg["rope_parameters"] = rope
        cfg.update(_moe_fields(m, arch, head_dim))
    elif arch == "olmo2":
        if m.get("attention.sliding_window"):
            raise UserError(f"GGUF file {path!r} is an olmo2 file with sliding-window layers (OLMo 3), which "
                            "tpengine does not run")
        cfg["hidden_act"] = "silu"
        cfg["rope_parameters"] = rope
    else:  # granite
        cfg["hidden_act"] = "silu"
        cfg["rope_parameters"] = rope
        cfg["attention_multiplier"] = m.get("attention.scale") or (hidden // heads) ** -0.5
        cfg["embedding_multiplier"] = m.get("embedding_scale") or 1.0
        cfg["residual_multiplier"] = m.get("residual_scale") or 1.0
        cfg["logits_scaling"] = m.get("logit_scale") or 1.0
        if "blk.0.ffn_up.bias" in tensors:
            cfg["mlp_bias"] = True
    if arch != "phi3" and "blk.0.attn_q.bias" in tensors:
        cfg["attention_bias"] = True
    return AutoConfig.for_model(FAMILY_ARCHS.get(arch, MIXTRAL), **cfg)


def tensor_processor(arch: str, config: dict):
    """transformers' ``TensorProcessor`` that undoes what llama.cpp's converter did to ``arch``'s
    tensors: Gemma's ``w + 1`` norms, Granite's and Mixtral's (``llama``) Q/K row permutation; a no-op
    for the rest (a MoE file's experts are cut by :func:`moe_parts`, not by the processor).
    ``config`` is the HF config as a dict (``num_attention_heads``, ``num_key_value_heads``)."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        Gemma2TensorProcessor,
        LlamaTensorProcessor,
        TensorProcessor,
    )

    own = {"gemma": Gemma2TensorProcessor, "gemma2": Gemma2TensorProcessor, "gemma3": Gemma2TensorProcessor,
           "granite": LlamaTensorProcessor, "phi3": TensorProcessor, "olmo2": TensorProcessor,
           "qwen3moe": TensorProcessor}  # (experts: moe_parts; a llama file with experts: Llama's)
    cls = own.get(arch) or TENSOR_PROCESSORS.get(arch, TensorProcessor)
    return cls(config=config)
