"""Parallel sampling (``n > 1``) on rank 0: a request's samples 1..n-1 start from sample 0 once its
prompt is computed, sharing its KV blocks (vLLM's parallel sampling; the prompt runs once)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from tpengine.engine.sequence import Sequence
from tpengine.engine.spec_decode import SpecState
from tpengine.sampling_params import SEED_END


class SampleForker:
    """Starts the other samples of ``n > 1`` requests.

    Args:
        scheduler: the engine's :class:`~tpengine.engine.scheduler.Scheduler` (``room``, ``fork``).
        outputs: the engine's :class:`~tpengine.engine.output_processor.OutputProcessor` (``add_sample``).
        next_id: gives the next engine-unique sequence id.
    """

    def __init__(self, scheduler, outputs, next_id: Callable[[], int]) -> None:
        self.scheduler, self.outputs, self.next_id = scheduler, outputs, next_id

    def fork(self, seqs: list[Sequence], sampled: list[bool]) -> tuple[list[Sequence], list[int]]:
        """Start samples 1..n-1 of every ``n > 1`` request whose first token this step samples
        (``sampled[i]``) while the scheduler has room for them. Returns ``(batch, rows)``: ``seqs``
        then the new samples, and the logits row of each (a new sample draws from its parent's row)."""
        batch, rows = list(seqs), list(range(len(seqs)))
        for i, (seq, ok) in enumerate(zip(seqs, sampled)):
            if ok and seq.params.n > 1 and self.scheduler.room(seq) > 1:
                children = [self.new_sample(seq, k) for k in range(1, seq.params.n)]
                self.scheduler.fork(seq, children)
                for child in children:
                    self.outputs.add_sample(child)
                batch += children
                rows += [i] * len(children)
        return batch, rows

    def new_sample(self, parent: Sequence, k: int) -> Sequence:
        """Sample ``k`` of ``parent``'s request: its prompt, its params with seed ``seed + k``
        (wrapping at 2**64, as vLLM's parallel sampling seeds its children) and no prompt logprobs
        (sample 0 collects them); its own speculative counters from 0 and its own grammar matcher."""
        p = parent.params
        seed = None if p.seed is None else p.seed + k - (SEED_END if p.seed + k >= SEED_END else 0)
        child = Sequence(self.next_id(), parent.request_id, parent.prompt_token_ids,
                         replace(p, seed=seed, prompt_logprobs=None), arrival_time=parent.arrival_time)
        child.index = k
        if parent.spec is not None:  # speculative decoding: its own counts, from 0
            child.spec = SpecState()
        if parent.structured is not None:  # its own matcher, at the grammar's start (no token sampled yet)
            child.structured = parent.structured.fork()
        return child
