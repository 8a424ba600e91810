"""Structured outputs: constrained decoding with xgrammar or llguidance (see ``docs/design.md``).

``params`` is plain Python (the protocol layer and ``SamplingParams`` import it); ``backends`` and
``manager`` import torch and the grammar libraries, and load on first use.
"""

from tpengine.structured.params import STRUCTURED_BACKENDS, StructuredOutputsParams

__all__ = ["STRUCTURED_BACKENDS", "GrammarError", "StructuredOutputManager", "StructuredOutputsParams"]


def __getattr__(name: str):
    if name == "GrammarError":
        from tpengine.structured.backends import GrammarError

        return GrammarError
    if name == "StructuredOutputManager":
        from tpengine.structured.manager import StructuredOutputManager

        return StructuredOutputManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
