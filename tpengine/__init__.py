"""tpengine: a small tensor-parallel inference engine for Hugging Face decoder LLMs.

The Python API (after vLLM's): ``from tpengine import LLM, SamplingParams`` (see
:mod:`tpengine.entrypoints.llm`). The names are imported on first use, so ``import tpengine.config``
(the command line's start) does not load torch or the engine.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: ``TPENGINE_ISA`` -> the variables that cap torch to that instruction set: with ``TPENGINE_ISA=avx2``
#: an AVX-512 machine runs as the AVX2 + FMA class, its C kernels built for x86-64-v3
#: (:func:`tpengine.backends.cpu.cpu_library.march`) and torch's ATen, oneDNN and MKL kernels capped
#: alike. torch reads these when it loads, so they are set here, before tpengine imports it, where
#: the environment does not set them already (a process that imported torch before tpengine keeps
#: its own: set them yourself there, or use :func:`isa_env` for a child process).
TORCH_ISA_CAPS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                           "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def isa_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``os.environ``), copied, with :data:`TORCH_ISA_CAPS` of its ``TPENGINE_ISA``
    added where it does not set them (nothing added without ``TPENGINE_ISA`` or for "native")."""
    out = dict(os.environ if env is None else env)
    for key, value in TORCH_ISA_CAPS.get(out.get("TPENGINE_ISA", "").strip().lower(), {}).items():
        out.setdefault(key, value)
    return out


for _key, _value in isa_env().items():
    if _key not in os.environ:
        os.environ[_key] = _value

#: Public name -> the module that defines it.
_EXPORTS = {
    "LLM": "tpengine.entrypoints.llm",
    "SamplingParams": "tpengine.sampling_params",
    "PoolingParams": "tpengine.pooling_params",
    "RequestOutput": "tpengine.entrypoints.outputs",
    "CompletionOutput": "tpengine.entrypoints.outputs",
    "EmbeddingRequestOutput": "tpengine.entrypoints.outputs",
    "EmbeddingOutput": "tpengine.entrypoints.outputs",
    "StructuredOutputsParams": "tpengine.structured.params",
}

__all__ = ["LLM", "SamplingParams", "PoolingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput", "EmbeddingOutput", "__version__"]

if TYPE_CHECKING:
    from tpengine.entrypoints.llm import LLM
    from tpengine.entrypoints.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
    from tpengine.pooling_params import PoolingParams
    from tpengine.sampling_params import SamplingParams
    from tpengine.structured.params import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    """Import an exported name on first access (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tpengine' has no attribute {name!r}")
    from tpengine.startup import collector_paused

    with collector_paused():  # importing the engine's modules (tpengine/startup.py)
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
