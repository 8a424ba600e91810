"""The engine's counters on rank 0: the scheduler's queues and KV pool, and the engine's steps and
tokens (what ``/metrics``, the run summary and the benchmarks read)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the queues and the KV pool (counts)."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_cached_blocks: int = 0
    prompt_tokens: int = 0  # prompt tokens of the sequences scheduled so far (first scheduling only)
    cached_prompt_tokens: int = 0  # of those, found in the prefix cache

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens (0.0 before any prompt)."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class EngineStats:
    """Counters on rank 0: steps run (a mixed step of decodes and a prefill chunk counts as a
    prefill step), tokens (``prompt_tokens`` of the requests scheduled, ``cached_prompt_tokens`` of
    them found in the prefix cache, ``computed_tokens`` run through the model, ``output_tokens``
    sampled), preemptions, and the KV-block (``num_cached_blocks``: free ones still holding a cached
    prefix) and queue state now. With speculative decoding, vLLM's ``spec_decode_*`` counters:
    ``spec_num_drafts`` (sequence-steps that verified proposals), ``spec_num_draft_tokens`` (tokens
    proposed), ``spec_num_accepted_tokens`` (of those, accepted) and ``spec_accepted_per_pos``
    (accepted at each proposal position); ``speculative`` False without it."""

    steps: int
    prefill_steps: int
    decode_steps: int
    prompt_tokens: int
    output_tokens: int
    num_preemptions: int
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    cached_prompt_tokens: int = 0
    computed_tokens: int = 0
    num_cached_blocks: int = 0
    speculative: bool = False
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens (0.0 before any prompt)."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed speculative tokens (None before any proposal)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        """Tokens emitted per sequence-step that verified proposals, 1 + accepted / drafts (vLLM's mean
        acceptance length; None before any proposal)."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None
