"""The per-step context: what the attention layers need to know about the current step.

The model runner builds one :class:`Context` per step and passes it explicitly down the forward
(``model.model(input_ids, positions, ctx)`` -> every layer -> the attention backend's
:meth:`tpengine.backends.base.AttentionBackend.forward`); there is no global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepIndex:
    """One step's index tensors (int64, on the model's device), as the StepPlan carries them.

    * ``is_prefill``: a prefill step (else decode: one new token per sequence).
    * ``slot_mapping [N]``: cache slot of each of the N tokens in this step (-1: store nothing).
    * ``block_tables [B, max_blocks]``: physical block ids per sequence, -1 padded.
    * ``cu_seqlens_q [B+1]`` / ``cu_seqlens_k [B+1]``: prefill only; new tokens / total tokens
      (cached prefix + new) per sequence, as cumulative offsets.
    * ``context_lens [B]``: decode only; tokens in the cache per sequence including this one.

    The base of :class:`Context` and of each backend's attention metadata.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    context_lens: torch.Tensor | None


@dataclass
class Context(StepIndex):
    """One step's context: its :class:`StepIndex` tensors, plus

    * ``backend``: the engine's :class:`tpengine.backends.base.AttentionBackend`;
    * ``attn``: ``backend.prepare(...)`` of this step (host lengths, gather indices, ...);
    * ``greedy``: the model runner takes this step's greedy token ids (one rank, no mask, one token a
      sequence) from ``ids`` where the backend's bound step sets them
      (:meth:`tpengine.backends.base.AttentionBackend.bind_head`); ``ids``: those ids ``[B]`` int64, or None
      (the runner then runs the LM head).
    """

    backend: Any
    attn: Any
    greedy: bool = False
    ids: torch.Tensor | None = None

    @classmethod
    def build(cls, backend, is_prefill: bool, slot_mapping: torch.Tensor, block_tables: torch.Tensor | None,
              cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
              context_lens: torch.Tensor | None = None) -> Context:
        """The context of one step, with ``attn = backend.prepare(...)`` (called once here)."""
        attn = backend.prepare(is_prefill, slot_mapping, block_tables, cu_seqlens_q, cu_seqlens_k, context_lens)
        return cls(is_prefill, slot_mapping, block_tables, cu_seqlens_q, cu_seqlens_k, context_lens, backend, attn)
