"""EngineConfig: the one frozen engine configuration, validated once.

Loaded from ``configs/*.toml`` (an ``[engine]`` table, or top-level keys; a ``[sampling]`` table
holds request defaults; anything else is refused, naming it) plus CLI overrides:
``load_config(path, **overrides)``. Values discovered at run time (number of KV blocks chosen from
memory, world size) are not stored here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tpengine.errors import UserError
from tpengine.sampling_params import SAMPLING_KEYS
from tpengine.structured.params import STRUCTURED_BACKENDS

DEFAULT_MODEL_DIR = "models/smollm2-135m-instruct"
#: Tokens per step with chunked prefill (the most a prefill or mixed step computes), chosen by the
#: measurement in docs/notes/chunked-prefill.md.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
#: Floating dtypes of weights and KV cache, by name; each name is also the ``torch`` attribute.
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
#: Bytes per element of each of :data:`WEIGHT_DTYPES`.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: The values of ``EngineConfig.dtype``: "auto" (see :meth:`EngineConfig.torch_dtype`) or a name.
DTYPES = ("auto", *WEIGHT_DTYPES)
#: The values of ``EngineConfig.attention_backend`` (:func:`tpengine.backends.get_backend`).
BACKENDS = ("auto", "cpu", "torch", "triton")  # "torch": the old name of "cpu", still accepted
#: The values of ``EngineConfig.cpu_linear``: "auto" measures and chooses the CPU weight layout per
#: weight shape, the others force one (:mod:`tpengine.backends.cpu.linear_layout`; "blocked": tpengine's
#: blocked layout, :mod:`tpengine.backends.cpu.cpu_blocked`, bfloat16 and float32 on AVX-512 (bfloat16: with
#: AVX512-BF16) and AVX2 builds; a weight it does not take stays plain).
CPU_LINEAR_CHOICES = ("auto", "plain", "packed", "blocked")
#: The values of ``EngineConfig.reasoning_parser`` besides None (:mod:`tpengine.frontend.reasoning`).
REASONING_PARSER_NAMES = ("qwen3", "deepseek_r1")
#: The values of ``EngineConfig.quantization`` besides None (see :mod:`tpengine.model.quant.weights`).
QUANTIZATIONS = ("int8", "int4")
#: ``kv_cache_dtype`` values (vLLM's flag): "auto" the model's dtype, "int8" int8 codes with a float32 scale
#: per token and KV head (tpengine/backends/kv_quant.py). vLLM's 8-bit float names are refused by name
#: (:data:`FP8_KV_NAMES`): this CPU path does not emulate fp8 (no fp8 arithmetic on its CPUs; int8 takes
#: the same bytes)
KV_CACHE_DTYPES = ("auto", "int8")
FP8_KV_NAMES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
#: The proposers of speculative decoding (``SpeculativeConfig.method``, vLLM's names).
SPECULATIVE_METHODS = ("ngram", "draft_model")
#: The values of ``EngineConfig.runner`` (vLLM's ``--runner``): "auto" and "generate" run the model as
#: a causal LM (every model tpengine loads is one); "pooling" serves embeddings instead
#: (:mod:`tpengine.engine.pooling`).
RUNNERS = ("auto", "generate", "pooling")
#: The pooling types of ``PoolerConfig.pooling_type`` (vLLM's names): the last token's hidden state,
#: or the mean over every prompt token's.
POOLING_TYPES = ("LAST", "MEAN")


def json_object(name: str, value: Any, example: str) -> dict:
    """A setting given as vLLM's JSON text or as a dict (``LLM(...)``, a TOML table), as a dict.

    Raises:
        ValueError: not JSON, or not an object, naming the setting ``name`` and showing ``example``.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"invalid {name} {value!r}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"invalid {name} {value!r}: must be a JSON object such as {example}")
    return value


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling engine (``runner`` "pooling") turns a prompt's final hidden states (after the
    model's final norm) into one embedding, as vLLM's ``--pooler-config`` JSON names it.

    * ``pooling_type``: "LAST" (the last prompt token's hidden state; vLLM's default for a decoder
      LM run as an embedding model) or "MEAN" (the mean over every prompt token's).
    * ``normalize``: L2-normalize the pooled vector (default True, vLLM's); a request's
      :class:`tpengine.pooling_params.PoolingParams` ``normalize`` overrides it. ``use_activation``
      (vLLM's newer name of the same switch) is accepted as an alias.

    Raises:
        ValueError: an unknown key or pooling type, a ``normalize`` that is not a bool, naming it.
    """

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.pooling_type, str):
            object.__setattr__(self, "pooling_type", self.pooling_type.upper())
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"invalid pooler_config pooling_type={self.pooling_type!r}: must be one of "
                             f"{', '.join(POOLING_TYPES)}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"invalid pooler_config normalize={self.normalize!r}: must be true or false")

    @classmethod
    def parse(cls, value: Any) -> PoolerConfig:
        """A config from vLLM's JSON text (``--pooler-config '{"pooling_type": "MEAN"}'``), a dict
        (``LLM(pooler_config=...)``, a TOML table) or a config; null values are "not given".

        Raises:
            ValueError: not JSON, not an object, an unknown key (naming the valid ones), or a bad value.
        """
        if isinstance(value, cls):
            return value
        value = json_object("pooler_config", value, '{"pooling_type": "LAST", "normalize": true}')
        value = {k: v for k, v in value.items() if v is not None}
        if "use_activation" in value:
            if "normalize" in value:
                raise ValueError("invalid pooler_config: normalize and use_activation are one setting; give one")
            value["normalize"] = value.pop("use_activation")
        known = [f.name for f in fields(cls)]
        if unknown := sorted(set(value) - set(known)):
            raise ValueError(f"invalid pooler_config: unknown key(s) {unknown}; valid: {', '.join(known)} "
                             "(use_activation: normalize's other name)")
        return cls(**value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's ``--speculative-config`` JSON names it
    (:mod:`tpengine.engine.spec_decode`).

    * ``method``: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of
      the sequence's last n tokens) or "draft_model" (a smaller model with the same vocabulary,
      ``model``); default "draft_model" when ``model`` is given.
    * ``num_speculative_tokens``: k, the most tokens proposed per sequence and step (>= 1).
    * ``prompt_lookup_min`` / ``prompt_lookup_max``: ngram's n range (vLLM's defaults: each the
      other when only one is given, 5 when neither is).
    * ``disable_by_batch_size``: propose only while at most this many sequences are decoding; unset:
      the engine measures, per batch size, what a proposed token costs and, per sequence, how often
      its recent proposals were accepted, and proposes where that pays
      (:class:`tpengine.engine.spec_decode.SpecPolicy`).

    Raises:
        ValueError: an unknown key, a missing or out-of-range value, naming it and what is valid.
    """

    num_speculative_tokens: int
    method: str = "ngram"
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, valid: str) -> ValueError:
            return ValueError(f"invalid speculative_config {name}={getattr(self, name)!r}: must be {valid}")

        def integer(name: str, lo: int, unset: bool) -> None:
            v = getattr(self, name)
            if (v is None and not unset) or v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
                raise bad(name, f"an integer >= {lo}" + (" or unset" if unset else ""))

        integer("num_speculative_tokens", 1, False)
        if self.method not in SPECULATIVE_METHODS:
            raise bad("method", f"one of {', '.join(SPECULATIVE_METHODS)}")
        for name in ("prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            integer(name, 1, True)
        if self.method == "ngram":
            if self.model is not None:
                raise bad("model", "unset with method ngram (the proposer reads the sequence itself)")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (5, 5) if lo is None and hi is None else (hi, hi) if lo is None else (lo, lo) if hi is None \
                else (lo, hi)
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if lo > hi:
                raise bad("prompt_lookup_min", f"<= prompt_lookup_max ({hi})")
        else:
            if not isinstance(self.model, str) or not self.model:
                raise bad("model", "the draft model's folder (a string) with method draft_model")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("invalid speculative_config: prompt_lookup_min / prompt_lookup_max are ngram's; "
                                 "method is draft_model")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig:
        """A config from vLLM's JSON text (``--speculative-config '{"method": "ngram", ...}'``), a
        dict (``LLM(speculative_config=...)``, a TOML table) or a config.

        Raises:
            ValueError: not JSON, not an object, an unknown key (naming the valid ones), or a bad value.
        """
        if isinstance(value, cls):
            return value
        value = json_object("speculative_config", value, '{"method": "ngram", "num_speculative_tokens": 4}')
        known = [f.name for f in fields(cls)]
        if unknown := sorted(set(value) - set(known)):
            raise ValueError(f"invalid speculative_config: unknown key(s) {unknown}; valid: {', '.join(known)}")
        value = dict(value)
        if "method" not in value and value.get("model") is not None:
            value["method"] = "draft_model"
        if "num_speculative_tokens" not in value:
            raise ValueError("invalid speculative_config: num_speculative_tokens is required")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings.

    Units: ``kv_cache_gb`` GiB of KV cache per rank (CPU); ``gpu_memory_utilization`` a
    fraction of free GPU memory; ``dist_timeout_s`` seconds for every collective;
    ``max_model_len`` tokens (prompt + output).

    Raises:
        ValueError: a value out of range, naming the field, the value and what is valid.
    """

    model: str = DEFAULT_MODEL_DIR
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU (see torch_dtype)
    max_model_len: int | None = None  # prompt + output tokens; default: the model's max_position_embeddings
    block_size: int = 16
    max_num_seqs: int = 64
    # tokens computed per step; default: DEFAULT_MAX_NUM_BATCHED_TOKENS with chunked prefill, else
    # max(8192, max_model_len)
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True  # share the KV blocks of prompt prefixes (hash-chained full blocks)
    enable_chunked_prefill: bool = True  # a prompt longer than max_num_batched_tokens is prefilled in chunks
    kv_cache_gb: float = 1.0
    # the KV cache's storage (vLLM's --kv-cache-dtype): "auto" (the model's dtype) or "int8" (per token and
    # KV head: int8 codes and a float32 scale, ~half of bfloat16's bytes; tpengine/backends/kv_quant.py)
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None  # force the block count (tests); else from memory
    gpu_memory_utilization: float = 0.85
    attention_backend: str = "auto"  # auto: triton on CUDA, cpu on CPU ("torch": the same as cpu)
    enforce_eager: bool = False  # GPU: disable CUDA graphs
    # CPU, half precision, decode steps the paged C kernel does not take (cpu_kernels off, or its head
    # sizes): keep the running batch's gathered KV across steps (costs up to one more copy of the KV
    # cache, never more: see tpengine/backends/cpu/kv_mirror.py)
    kv_mirror: bool = True
    # CPU: run through C kernels built at run time where they take the tensors
    # (tpengine/backends/cpu/cpu_library.py: AVX-512 with AVX512-BF16, else AVX2 + FMA): paged decode
    # attention, GEMV of the linears and LM head, residual add + RMSNorm, SiLU*up and the LM head's
    # argmax in bfloat16 and float32; GEMM in float32 (bfloat16 too on AVX2 builds); quantized GEMV
    # (int8, int4); RoPE, causal softmax and KV writes in bfloat16; torch ops for the rest and without
    # a C compiler. false: always torch ops
    cpu_kernels: bool = True
    # CPU: the layout of the linear weights, per weight shape: "auto" (the faster of plain/MKL and
    # oneDNN-packed, measured on this machine and cached; tpengine/backends/cpu/linear_layout.py),
    # "plain" or "packed"
    cpu_linear: str = "auto"
    # CPU, a long job (not tpengine/backends/cpu/measured.py's short_job): once loaded, move the weights
    # into 2 MiB transparent huge pages (tpengine/backends/cpu/memory.py, collapse_huge_pages; Linux >= 6.1,
    # THP not "never"): fewer TLB misses as a step streams them, at some load time. false: 4 KiB pages
    cpu_huge_pages: bool = True
    dist_timeout_s: float = 60.0
    # the launch's parallel layout (vLLM's names): world size = data_parallel_size x pipeline_parallel_size x
    # tensor_parallel_size; tensor_parallel_size unset: world size / (data_parallel_size x
    # pipeline_parallel_size) (see parallel_sizes)
    tensor_parallel_size: int | None = None
    data_parallel_size: int = 1
    # pipeline parallelism: the decoder layers split into this many stages of consecutive ranks
    pipeline_parallel_size: int = 1
    # the layers of each stage, "8,8,6" (vLLM's VLLM_PP_LAYER_PARTITION); None: as even as possible
    pp_layer_partition: str | None = None
    # a mixture-of-experts model's routed experts whole on each rank of the TP group (vLLM's flag), instead
    # of every expert split by its intermediate; attention stays tensor-parallel; a dense model ignores it
    enable_expert_parallel: bool = False
    threads: int | None = None  # intra-op threads per rank; default cores // ranks on this host
    seed: int = 0
    # sampling defaults: "auto" (the model's generation_config.json), "ignore" (tpengine's built-in
    # ones) or a folder holding a generation_config.json (see tpengine/entrypoints/generation_defaults.py)
    generation_config: str = "auto"
    # weight-only quantization of the column/row-parallel linears and the embedding / LM head, at load (CPU):
    # "int8" (per output channel, the embedding / LM head too), "int4" (group 32, a scale and an int8 zero
    # code per group; the embedding / LM head the same int4) or None; see tpengine/model/quant/weights.py
    quantization: str | None = None
    # the grammar library of structured outputs (vLLM's structured_outputs_config.backend): "auto"
    # (xgrammar, falling back to guidance for what it cannot compile), "xgrammar" or "guidance"
    structured_outputs_backend: str = "auto"
    # the thinking models' reasoning tags (vLLM's --reasoning-parser): "qwen3", "deepseek_r1" or None; a
    # structured output then starts after </think>, and the chat API splits off reasoning_content
    reasoning_parser: str | None = None
    # speculative decoding (vLLM's --speculative-config): a SpeculativeConfig, given as its JSON text or a
    # dict; None: off
    speculative_config: SpeculativeConfig | None = None
    # what the engine runs the model for (vLLM's --runner): "auto" / "generate" (text), or "pooling":
    # prefill only, each prompt's final hidden states pooled into one embedding (tpengine/engine/pooling.py)
    runner: str = "auto"
    # a pooling engine's pooling (vLLM's --pooler-config): a PoolerConfig, given as its JSON text or a dict;
    # None: LAST, normalized
    pooler_config: PoolerConfig | None = None

    def __post_init__(self) -> None:
        def bad(name: str, valid: str) -> ValueError:
            return ValueError(f"invalid {name}={getattr(self, name)!r}: must be {valid}")

        for f in fields(self):  # types first, so the range checks below compare numbers
            value, kinds = getattr(self, f.name), FIELD_TYPES[f.name]
            if value is None and None in kinds:
                continue
            if isinstance(value, bool) and bool not in kinds or not isinstance(value, tuple(k for k in kinds if k)):
                names = " or ".join("unset" if k is None else k.__name__ for k in kinds)
                raise ValueError(f"invalid {f.name}={value!r}: must be {names}")
            if isinstance(value, float) and not math.isfinite(value):
                raise bad(f.name, "a finite number")
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        self._check_runner()
        if self.max_num_batched_tokens is None and self.enable_chunked_prefill:
            object.__setattr__(self, "max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
        if self.max_num_batched_tokens is None and self.max_model_len is not None:
            object.__setattr__(self, "max_num_batched_tokens", max(8192, self.max_model_len))
        if self.dtype not in DTYPES:
            raise bad("dtype", f"one of {', '.join(DTYPES)}")
        if self.attention_backend not in BACKENDS:
            raise bad("attention_backend", f"one of {', '.join(BACKENDS)}")
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise bad(name, "an integer >= 1")
        if None not in (self.max_model_len, self.max_num_batched_tokens) and not self.enable_chunked_prefill \
                and self.max_num_batched_tokens < self.max_model_len:
            raise bad("max_num_batched_tokens", f">= max_model_len ({self.max_model_len}) without "
                      "enable_chunked_prefill (a prompt is then prefilled in one step)")
        if self.kv_cache_gb <= 0:
            raise bad("kv_cache_gb", "> 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            why = (" (vLLM's fp8 KV cache is not emulated on this engine's CPU path; int8 takes the same bytes)"
                   if self.kv_cache_dtype in FP8_KV_NAMES else "")
            raise bad("kv_cache_dtype", f"one of {', '.join(KV_CACHE_DTYPES)}{why}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", "an integer >= 1 or unset")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "in (0, 1]")
        if self.dist_timeout_s <= 0:
            raise bad("dist_timeout_s", "> 0 seconds")
        if self.tensor_parallel_size is not None and self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", "an integer >= 1 or unset")
        if self.data_parallel_size < 1:
            raise bad("data_parallel_size", "an integer >= 1")
        self._check_pipeline()
        if self.threads is not None and self.threads < 1:
            raise bad("threads", "an integer >= 1 or unset")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"one of {', '.join(QUANTIZATIONS)} or unset")
        if self.cpu_linear not in CPU_LINEAR_CHOICES:
            raise bad("cpu_linear", f"one of {', '.join(CPU_LINEAR_CHOICES)}")
        if self.structured_outputs_backend not in STRUCTURED_BACKENDS:
            raise bad("structured_outputs_backend", f"one of {', '.join(STRUCTURED_BACKENDS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSER_NAMES:
            raise bad("reasoning_parser", f"one of {', '.join(REASONING_PARSER_NAMES)} or unset")
        if self.generation_config == "":
            raise bad("generation_config", "auto, ignore or a folder holding a generation_config.json")

    def _check_pipeline(self) -> None:
        """``pipeline_parallel_size`` >= 1; ``pp_layer_partition`` one positive layer count per stage; and
        the features that do not run across stages yet refused by name (pooling, a draft model)."""
        pp, part = self.pipeline_parallel_size, self.pp_layer_partition
        if pp < 1:
            raise ValueError(f"invalid pipeline_parallel_size={pp!r}: must be an integer >= 1")
        if part is not None:
            counts = layer_partition(part)
            if counts is None or len(counts) != pp:
                raise ValueError(f"invalid pp_layer_partition={part!r}: must be {pp} positive layer counts "
                                 f"separated by commas, one per stage (pipeline_parallel_size={pp}), e.g. "
                                 f"{','.join(['4'] * pp)!r}")
        if pp == 1:
            return
        if self.runner == "pooling":
            raise ValueError("invalid runner='pooling' with pipeline_parallel_size > 1: pooling does not run "
                             "across pipeline stages in this version")
        sc = self.speculative_config
        if sc is not None and sc.method == "draft_model":
            raise ValueError("invalid speculative_config with method 'draft_model' and pipeline_parallel_size > 1: "
                             "a draft model does not run across pipeline stages in this version (ngram does)")

    def _check_runner(self) -> None:
        """``runner`` and ``pooler_config``: a known runner; a pooler config only for a pooling engine,
        which runs no speculative decoding; MEAN pooling reads every prompt token's hidden state, so a
        cached prefix (computed by no step) would be missing from it: prefix caching is off for it, as
        vLLM turns it off for every pooling type but LAST."""
        if self.runner not in RUNNERS:
            raise ValueError(f"invalid runner={self.runner!r}: must be one of {', '.join(RUNNERS)}")
        if self.pooler_config is not None:
            object.__setattr__(self, "pooler_config", PoolerConfig.parse(self.pooler_config))
            if not self.pooling:
                raise ValueError(f"invalid pooler_config: it sets a pooling engine's pooling, but runner is "
                                 f"{self.runner!r}; add runner pooling (--runner pooling)")
        if self.pooling:
            if self.speculative_config is not None:
                raise ValueError("invalid speculative_config: a pooling engine (runner pooling) generates no "
                                 "tokens to speculate on; leave it unset")
            if self.pooler.pooling_type != "LAST" and self.enable_prefix_caching:
                object.__setattr__(self, "enable_prefix_caching", False)

    @property
    def pooling(self) -> bool:
        """Whether the engine serves embeddings (``runner`` "pooling") instead of generating."""
        return self.runner == "pooling"

    @property
    def pooler(self) -> PoolerConfig:
        """The pooling a pooling engine applies: ``pooler_config``, or the default (LAST, normalized)."""
        return self.pooler_config or PoolerConfig()

    def torch_dtype(self, device: Any) -> Any:
        """The model/KV-cache ``torch.dtype`` on ``device`` (the one place "auto" is resolved):
        "auto" is bfloat16 on CUDA and float32 elsewhere; other names map to themselves."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        return torch_dtype(self.dtype)

    @property
    def layer_counts(self) -> list[int] | None:
        """``pp_layer_partition`` as each stage's layer count, or None (as even as possible)."""
        return None if self.pp_layer_partition is None else layer_partition(self.pp_layer_partition)

    def parallel_sizes(self, world_size: int) -> tuple[int, int]:
        """``(data_parallel_size, tensor_parallel_size)`` of a launch of ``world_size`` ranks
        (:func:`parallel_sizes`, with ``pipeline_parallel_size`` stages per replica).

        Raises:
            UserError: ``world_size`` is not ``data_parallel_size x pipeline_parallel_size x
                tensor_parallel_size``.
        """
        return parallel_sizes(world_size, self.data_parallel_size, self.tensor_parallel_size,
                              self.pipeline_parallel_size)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def parallel_sizes(world_size: int, dp: int = 1, tp: int | None = None, pp: int = 1) -> tuple[int, int]:
    """``(dp, tp)`` of a launch of ``world_size`` ranks as ``dp`` data-parallel replicas of ``pp``
    pipeline stages of ``tp`` tensor-parallel ranks each; ``tp`` None: ``world_size / (dp x pp)``.

    Raises:
        UserError: ``world_size`` is not ``dp x pp x tp``, naming the numbers and what would be valid.
    """
    if tp is None and world_size % (dp * pp) == 0:
        return dp, world_size // (dp * pp)
    if tp is not None and dp * pp * tp == world_size:
        return dp, tp
    given = (f"data_parallel_size={dp}" + (f" x pipeline_parallel_size={pp}" if pp > 1 else "")
             + ("" if tp is None else f" x tensor_parallel_size={tp}"))
    if pp > 1:
        valid = ", ".join(f"{d} x {pp} x {world_size // (d * pp)}" for d in range(1, world_size + 1)
                          if world_size % (d * pp) == 0) or "none"
        shape = "data_parallel_size x pipeline_parallel_size x tensor_parallel_size"
    else:
        valid = ", ".join(f"{d} x {world_size // d}" for d in range(1, world_size + 1) if world_size % d == 0)
        shape = "data_parallel_size x tensor_parallel_size"
    raise UserError(f"{given} does not fit the world size {world_size} (torchrun's --nnodes x --nproc_per_node): "
                    f"it must be {shape} ({valid}), or launch "
                    f"{dp * pp * (tp or 1)} rank(s) for these sizes")


def layer_partition(text: str) -> list[int] | None:
    """``"8,8,6"`` -> ``[8, 8, 6]`` (each stage's layer count, vLLM's ``VLLM_PP_LAYER_PARTITION``); None
    when ``text`` is not a comma-separated list of positive integers."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        return None
    return counts if counts and all(c > 0 for c in counts) else None


def torch_dtype(name: str) -> Any:
    """The ``torch.dtype`` named ``name`` (one of :data:`WEIGHT_DTYPES`).

    Raises:
        ValueError: any other name, naming it and the valid ones.
    """
    import torch

    if name not in WEIGHT_DTYPES:
        raise ValueError(f"invalid dtype {name!r}: must be one of {', '.join(WEIGHT_DTYPES)}")
    return getattr(torch, name)


#: Accepted Python types per EngineConfig field (None: may be unset); ints are accepted where floats are.
FIELD_TYPES: dict[str, tuple] = {
    "model": (str,), "dtype": (str,), "attention_backend": (str,), "generation_config": (str,), "cpu_linear": (str,),
    "kv_cache_dtype": (str,),
    "quantization": (str, None), "structured_outputs_backend": (str,),
    "reasoning_parser": (str, None), "speculative_config": (str, dict, SpeculativeConfig, None),
    "runner": (str,), "pooler_config": (str, dict, PoolerConfig, None),
    "max_model_len": (int, None), "block_size": (int,), "max_num_seqs": (int,), "max_num_batched_tokens": (int, None),
    "num_kv_blocks": (int, None), "threads": (int, None), "seed": (int,),
    "tensor_parallel_size": (int, None), "data_parallel_size": (int,),
    "pipeline_parallel_size": (int,), "pp_layer_partition": (str, None),
    "kv_cache_gb": (float, int), "gpu_memory_utilization": (float, int), "dist_timeout_s": (float, int),
    "enforce_eager": (bool,), "kv_mirror": (bool,), "cpu_kernels": (bool,), "cpu_huge_pages": (bool,),
    "enable_prefix_caching": (bool,), "enable_chunked_prefill": (bool,), "enable_expert_parallel": (bool,),
}


#: The tables a config file may hold. Top-level keys that are not tables are engine settings
#: (the same as an ``[engine]`` table's).
CONFIG_TABLES = ("engine", "sampling")


def read_config_file(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The tables of the TOML config file ``path``: ``{"engine": {...}, "sampling": {...}}`` (a
    missing table is empty). Engine settings are the keys of an ``[engine]`` table or top-level
    keys (not both for one key); ``[sampling]`` keys are :data:`SAMPLING_KEYS` (values are
    checked by :class:`tpengine.sampling_params.SamplingParams` where they are used).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        UserError: unreadable, not valid TOML, an unknown table (``[samplng]``), an unknown
            top-level key, or an unknown ``[engine]`` / ``[sampling]`` key, a key set both at top
            level and in ``[engine]``: one line naming the file, the key or table and the valid ones.
    """
    p = Path(path)
    if p.is_dir():
        raise FileNotFoundError(f"config file {str(p)!r} is a folder; give a .toml file")
    if not p.is_file():
        raise FileNotFoundError(f"config file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read config file {str(p)!r}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    known = sorted(f.name for f in fields(EngineConfig))
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    top = {k: v for k, v in data.items() if not isinstance(v, dict)}
    valid_tables = ", ".join(f"[{t}]" for t in CONFIG_TABLES)
    for name in tables:
        if name not in CONFIG_TABLES:
            raise UserError(f"config file {str(p)!r}: unknown table [{name}]; valid tables: {valid_tables}")
    if unknown := sorted(set(top) - set(known)):
        raise UserError(f"config file {str(p)!r}: unknown top-level key(s) {unknown}; valid: the tables "
                        f"{valid_tables}, or engine settings at top level: {', '.join(known)}")
    engine = tables.get("engine", {})
    if unknown := sorted(set(engine) - set(known)):
        raise UserError(f"config file {str(p)!r}: unknown engine setting(s) {unknown} in [engine]; "
                        f"valid: {', '.join(known)}")
    if twice := sorted(set(engine) & set(top)):
        raise UserError(f"config file {str(p)!r}: {twice} set both at top level and in [engine]; set each once")
    sampling = tables.get("sampling", {})
    if unknown := sorted(set(sampling) - set(SAMPLING_KEYS)):
        raise UserError(f"config file {str(p)!r}: unknown [sampling] key(s) {unknown}; "
                        f"valid: {', '.join(SAMPLING_KEYS)}")
    return {"engine": {**top, **engine}, "sampling": dict(sampling)}


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> EngineConfig:
    """The engine settings of the config file ``path`` (see :func:`read_config_file`), then the
    ``overrides`` whose value is not None (CLI flags).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        UserError: (a ``ValueError``) what :func:`read_config_file` raises, or an unknown override
            (naming it and the valid keys).
        ValueError: an invalid value (from :class:`EngineConfig`).
    """
    values: dict[str, Any] = dict(read_config_file(path)["engine"]) if path is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(f"unknown engine setting(s) {unknown}; valid: {', '.join(sorted(known))}")
    return EngineConfig(**values)
