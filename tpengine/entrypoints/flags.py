"""The command-line flags of the engine settings: one per :class:`tpengine.config.EngineConfig`
field, named as vLLM names it (``max_num_seqs`` -> ``--max-num-seqs``; a bool field gets
``--x/--no-x``), generated from the one table :data:`ENGINE_FLAGS`.

A flag left out is None, so a config file's value (or the field's default) stands; ``--help``
shows the field's default.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Annotated, Any

import typer

from tpengine.config import (
    BACKENDS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DTYPES,
    FIELD_TYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    EngineConfig,
)

#: Per EngineConfig field: (help, default shown in --help or None for the field's own default).
ENGINE_FLAGS: dict[str, tuple[str, str | None]] = {
    "model": ("Hugging Face model folder, or a `tpengine-shard split` folder; MODEL-tpN is used instead when it "
              "holds shards for this tp", None),
    "dtype": (f"weights and KV cache: {', '.join(DTYPES)} (auto: bfloat16 on CUDA, float32 on CPU)", None),
    "max_model_len": ("most tokens of one sequence (prompt + output)", "the model's max_position_embeddings"),
    "block_size": ("tokens per KV-cache block", None),
    "max_num_seqs": ("most sequences in one step", None),
    "max_num_batched_tokens": ("most tokens computed in one step; a longer prompt is prefilled in chunks",
                               f"{DEFAULT_MAX_NUM_BATCHED_TOKENS} with chunked prefill, else max(8192, max_model_len)"),
    "enable_prefix_caching": ("share the KV cache of prompt prefixes between requests", None),
    "enable_chunked_prefill": ("prefill a prompt longer than --max-num-batched-tokens in chunks, beside decodes",
                               None),
    "kv_cache_gb": ("CPU: GiB of KV cache per rank", None),
    "kv_cache_dtype": (f"the KV cache's storage: {', '.join(KV_CACHE_DTYPES)} (auto: the model's dtype; int8: "
                       "per token and KV head int8 codes and a float32 scale, about half of bfloat16's bytes)",
                       None),
    "num_kv_blocks": ("force the number of KV-cache blocks (for tests)",
                      "from --kv-cache-gb (CPU) or --gpu-memory-utilization (CUDA)"),
    "gpu_memory_utilization": ("CUDA: fraction of the free GPU memory after loading and warm-up given to the "
                               "KV cache", None),
    "attention_backend": (f"{', '.join(BACKENDS)} (auto: triton on CUDA, cpu on CPU; torch: the old name of cpu)",
                          None),
    "enforce_eager": ("CUDA: run decode steps eagerly, without CUDA graphs", None),
    "kv_mirror": ("CPU, half precision, decode off the paged C kernel: keep the batch's gathered KV across "
                  "steps (up to one more copy of the KV cache)", None),
    "cpu_kernels": ("CPU: C kernels built at run time where they take the tensors (paged decode attention, GEMV, "
                    "GEMM, quantized GEMV, add + RMSNorm, SiLU*up, RoPE, softmax, KV writes, the LM head's "
                    "argmax; bfloat16 and float32 as each has them), else torch ops (all of them without a C "
                    "compiler)", None),
    "cpu_linear": ("CPU: the linear weights' layout per weight shape: auto (the fastest of plain/MKL, "
                   "oneDNN-packed and tpengine's blocked layout (bfloat16 and float32), measured on this machine "
                   "and cached), plain, packed or blocked", None),
    "cpu_huge_pages": ("CPU, a job longer than one token: once loaded, move the weights into 2 MiB transparent huge "
                       "pages (Linux >= 6.1, THP not never; fewer TLB misses a step, some load time)", None),
    "dist_timeout_s": ("seconds a collective waits for the other ranks before the job fails", None),
    "tensor_parallel_size": ("ranks per pipeline stage of a model replica (tensor parallelism); the world size is "
                             "data_parallel_size x pipeline_parallel_size x tensor_parallel_size",
                             "the world size / (--data-parallel-size x --pipeline-parallel-size)"),
    "data_parallel_size": ("model replicas (data parallelism), each a TP group of consecutive ranks with its own "
                           "scheduler and KV cache; requests are routed between them", None),
    "pipeline_parallel_size": ("pipeline stages per model replica: the decoder layers split into stages of "
                               "consecutive TP groups, hidden states sent stage to stage; world size = "
                               "data_parallel_size x pipeline_parallel_size x tensor_parallel_size", None),
    "pp_layer_partition": ("the layers of each pipeline stage, e.g. \"8,8,6\" (vLLM's VLLM_PP_LAYER_PARTITION)",
                           "as even as possible; the extra layers on the stages before the last, as vLLM"),
    "enable_expert_parallel": ("mixture-of-experts models: whole experts on each rank of the TP group (8 experts on 3 "
                               "ranks: 3, 3, 2), attention still tensor-parallel; without it every expert is "
                               "split over the ranks. One all-reduce per MoE layer either way", None),
    "threads": ("intra-op threads per rank", "cores / ranks on this host"),
    "seed": ("seed of the sampler (a request's own seed takes precedence)", None),
    "generation_config": ("sampling defaults: auto (the model folder's generation_config.json: temperature, "
                          "top_p, top_k, min_p, repetition_penalty, max_new_tokens, do_sample), ignore "
                          "(tpengine's built-in defaults) or a folder holding a generation_config.json; a "
                          "request's fields, flags and the [sampling] table take precedence", None),
    "quantization": (f"quantize the linear layers' weights at load (CPU): {', '.join(QUANTIZATIONS)} (int8: per "
                     "output channel; int4: group 32, a scale and an int8 zero code per group), the embedding / LM "
                     "head too (the same scheme)",
                     "none"),
    "structured_outputs_backend": ("structured outputs' grammar library (vLLM's structured_outputs_config."
                                   "backend): auto (xgrammar, falling back to guidance for what it cannot "
                                   "compile), xgrammar or guidance", None),
    "reasoning_parser": ("a thinking model's reasoning tags: qwen3 or deepseek_r1 (<think>...</think>): a "
                         "structured output starts after them; the chat API returns them as reasoning_content",
                         "none"),
    "speculative_config": ("speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                           "\"prompt_lookup_max\": 4}' or '{\"model\": DRAFT_DIR, \"num_speculative_tokens\": 4}' "
                           "(greedy and seeded outputs stay exactly those without it)", "none"),
    "runner": ("what the model runs for (vLLM's --runner): auto or generate (text), or pooling: embeddings "
               "(/v1/embeddings, LLM.embed; prefill only, the final hidden states pooled)", None),
    "pooler_config": ("a pooling engine's pooling, vLLM's JSON: '{\"pooling_type\": \"LAST\", \"normalize\": true}' "
                      "(pooling_type LAST or MEAN; MEAN turns prefix caching off)", "LAST, normalized"),
}


def option(name: str, help: str, default: str | bool = True) -> Any:
    """A command's own typer option ``name`` with ``help``; ``default``: True shows the parameter's
    default in ``--help``, a string shows that text instead, False shows none."""
    return typer.Option(name, help=help, show_default=default)


def flag_name(field: str) -> str:
    """The flag of an EngineConfig field: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + field.replace("_", "-")


def _option(field: Any) -> tuple[type, Any]:
    """(annotation type, typer.Option) of one EngineConfig field."""
    help_text, shown = ENGINE_FLAGS[field.name]
    kind = next(k for k in FIELD_TYPES[field.name] if k is not None)  # float before int for numbers
    flag = flag_name(field.name)
    if kind is bool:
        decl = f"{flag}/--no-{flag[2:]}"
        shown = shown or (flag[2:] if field.default else f"no-{flag[2:]}")
    else:
        decl = flag
        shown = shown or str(field.default)
    return kind, typer.Option(decl, help=help_text, show_default=shown, rich_help_panel="Engine settings")


def engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for a typer command ``command(..., engine: dict[str, Any])``: the command gets
    one option per EngineConfig field (after its own), and is called with the values of those
    options as ``engine`` (field name -> value, None where the flag was not given), ready for
    ``load_config(path, **engine)``.

    Raises:
        KeyError: an EngineConfig field without a row in :data:`ENGINE_FLAGS` (at import).
    """
    sig = inspect.signature(command)
    hints = typing.get_type_hints(command, include_extras=True)
    own = [p.replace(annotation=hints[p.name]) for p in sig.parameters.values() if p.name != "engine"]
    names = [f.name for f in fields(EngineConfig)]
    added = []
    for f in fields(EngineConfig):
        assert f.default is not MISSING, f.name
        kind, opt = _option(f)
        added.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                       annotation=Annotated[kind | None, opt]))

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        engine = {n: kwargs.pop(n) for n in names}
        return command(**kwargs, engine=engine)

    params = own + added
    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    del wrapper.__wrapped__  # typer reads __signature__ / __annotations__, not the wrapped function's
    return wrapper
