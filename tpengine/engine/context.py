"""The per-step context: what the attention function needs to know about the current step.

The model runner sets it before the HF forward and clears it after; attention layers read it
with :func:`get_context` (one global, since one step runs at a time per process).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass
class Context:
    """One step's attention metadata (all int64 tensors on the model's device).

    * ``slot_mapping [N]``: cache slot of each of the N tokens in this step.
    * ``cu_seqlens_q [B+1]`` / ``cu_seqlens_k [B+1]``: prefill only; new tokens / total tokens
      (cached prefix + new) per sequence, as cumulative offsets.
    * ``block_tables [B, max_blocks]``: physical block ids per sequence, -1 padded.
    * ``context_lens [B]``: decode only; tokens in the cache per sequence including this one.
    * ``backend``: the kernels module (:mod:`tpengine.kernels.reference` or Triton).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    backend: ModuleType
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None


_CONTEXT: Context | None = None


def set_context(ctx: Context | None) -> None:
    """Install ``ctx`` for the next forward (None clears it)."""
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> Context | None:
    """The current step's :class:`Context`, or None outside an engine step."""
    return _CONTEXT
