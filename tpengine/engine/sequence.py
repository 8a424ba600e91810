"""One request's token state as the scheduler, block manager and sampler see it (rank 0 only)."""

from __future__ import annotations

import enum
import time
from array import array
from typing import TYPE_CHECKING

import torch

from tpengine.engine.outputs import PositionLogprobs
from tpengine.sampling_params import SamplingParams
from tpengine.utils import cdiv

if TYPE_CHECKING:
    from tpengine.engine.spec_decode import SpecState
    from tpengine.engine.structured_output import StructuredState


class SequenceStatus(enum.Enum):
    """Where a sequence is: in the waiting queue, in the running queue, or done."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """Token ids (prompt + generated), KV-block table and lifecycle of one request.

    Args:
        seq_id: engine-unique integer id.
        request_id: the user's request id (e.g. the JSONL ``id``).
        prompt_token_ids: prompt ids (copied). May be empty here; ``Scheduler.add`` rejects
            empty prompts.
        params: how to sample and when to stop.
        arrival_time: ``time.monotonic()`` seconds when the request arrived (default: now).
            ``first_token_time``, ``scheduled_time`` (first scheduled), ``last_token_time`` and
            ``finish_time`` use the same clock; ``itl`` holds the seconds between its consecutive
            tokens (tokens accepted together in one speculative step are ~0 apart).

    Attributes:
        token_ids: prompt ids followed by generated ids.
        num_prompt_tokens: length of the prompt.
        status: a ``SequenceStatus``.
        block_table: physical KV block ids, one per ``block_size`` tokens, in order.
        num_cached_tokens: tokens whose K/V is already in the cache (computed, or shared from
            the prefix cache); 0 while waiting, the cached prefix's length once blocks are
            allocated, advanced by each prefill chunk, ``num_tokens - 1`` once the prefill is done
            (the newest token's K/V is written by the next decode step).
        num_new_tokens: tokens the current step computes, from position ``num_cached_tokens``
            (set by the scheduler: 1 in a decode, a chunk or the rest of the prompt in a prefill).
        num_prefix_cached_tokens: prompt tokens found in the prefix cache when the sequence was
            first scheduled (None before): ``usage.prompt_tokens_details.cached_tokens``.
        block_hashes: chained hashes of its full blocks (``BlockManager.hashes``);
            ``num_registered_blocks`` of its table are registered in the prefix cache.
        finish_reason: None while unfinished, else "stop", "length" or "abort".
        generator: per-request ``torch.Generator`` seeded from ``params.seed``; created lazily
            by the ``Sampler`` on the logits' device (None for unseeded requests).
        index: the sample's index (0..n-1) among a request's ``n`` samples.
        logprobs: one :class:`~tpengine.engine.outputs.PositionLogprobs` per generated token when
            ``params.logprobs`` is set (else None); ``cumulative_logprob`` their chosen logprobs' sum.
        structured: with ``params.structured_outputs``, its
            :class:`~tpengine.engine.structured_output.StructuredState` (grammar, this sample's matcher,
            the end of a thought still running), None until the grammar is compiled.
        prompt_logprobs: with ``params.prompt_logprobs``, the entries for prompt positions
            1.. computed so far (position 0 has none), else None.
        proposal: the speculative tokens the current step verifies after the last token
            (:mod:`tpengine.engine.spec_decode`; counted in ``num_new_tokens``), [] for none.
        spec: with speculative decoding, its :class:`~tpengine.engine.spec_decode.SpecState` (tokens
            proposed and accepted, the draft model's cached tokens); None without it.
    """

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.token_ids: list[int] = [int(t) for t in prompt_token_ids]
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.num_new_tokens = 0
        self.num_prefix_cached_tokens: int | None = None
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.scheduled_time: float | None = None  # first scheduled (the end of its queueing)
        self.last_token_time: float | None = None
        self.itl: array = array("d")  # seconds between its consecutive tokens (inter-token latencies)
        self.generator: torch.Generator | None = None
        self.index = 0
        self.structured: StructuredState | None = None  # set once its grammar is compiled
        self.logprobs: list[PositionLogprobs] | None = None if params.logprobs is None else []
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[PositionLogprobs] | None = None if params.prompt_logprobs is None else []
        self.proposal: list[int] = []
        self.spec: SpecState | None = None  # with speculative decoding: its counters

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, "
            f"status={self.status.name}, tokens={self.num_prompt_tokens}+"
            f"{self.num_completion_tokens}, cached={self.num_cached_tokens}, "
            f"blocks={self.block_table}, finish_reason={self.finish_reason!r})"
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt ids (a copy)."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        """The generated ids (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_prefilling(self) -> bool:
        """Holding blocks with more than one token still to compute (a prefill cut into chunks)."""
        return bool(self.block_table) and self.num_tokens - self.num_cached_tokens > 1

    @property
    def samples(self) -> bool:
        """True if this step's ``num_new_tokens`` reach the last token, so its logits are sampled."""
        return self.num_cached_tokens + self.num_new_tokens >= self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks(self, block_size: int) -> int:
        """KV blocks needed to hold all ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return cdiv(self.num_tokens, block_size)

    def append_token(self, token_id: int) -> None:
        """Append one generated token (its K/V is not in the cache yet)."""
        self.token_ids.append(int(token_id))
