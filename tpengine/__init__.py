"""tpengine: a small tensor-parallel inference engine for Hugging Face decoder LLMs.

The Python API (after vLLM's): ``from tpengine import LLM, SamplingParams`` (see
:mod:`tpengine.entrypoints.llm`). The names are imported on first use, so ``import tpengine.config``
(the command line's start) does not load torch or the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "LLM": "tpengine.entrypoints.llm",
    "SamplingParams": "tpengine.sampling_params",
    "RequestOutput": "tpengine.entrypoints.outputs",
    "CompletionOutput": "tpengine.entrypoints.outputs",
    "StructuredOutputsParams": "tpengine.structured.params",
}

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "__version__"]

if TYPE_CHECKING:
    from tpengine.entrypoints.llm import LLM
    from tpengine.entrypoints.outputs import CompletionOutput, RequestOutput
    from tpengine.sampling_params import SamplingParams
    from tpengine.structured.params import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    """Import an exported name on first access (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tpengine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
