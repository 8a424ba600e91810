"""A step's update from its output on rank 0 (vLLM's ``update_from_output``): the tokens each
sequence takes, what they end, and the outputs they give.

:class:`StepUpdater` takes a :class:`ScheduledStep` and the model's result: the prompt logprobs rows,
the new samples of ``n > 1`` requests (:class:`~tpengine.engine.parallel_sampling.SampleForker`), one
token per sequence (:class:`~tpengine.engine.row_sampler.RowSampler`), the grammar's advance, the
text and its stop strings, the verification of speculative proposals
(:meth:`~tpengine.engine.spec_decode.SpecDecoder.verify`), the scheduler's bookkeeping, and the
outputs of finished and streaming requests. A request whose content fails any of these ends with its
own error output; the others go on as if it had not been there.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tpengine.engine.output_processor import OutputProcessor, failed_output
from tpengine.engine.outputs import EngineOutput
from tpengine.engine.parallel_sampling import SampleForker
from tpengine.engine.row_sampler import RowSampler
from tpengine.engine.sequence import Sequence
from tpengine.engine.spec_decode import SpecDecoder, output_rows
from tpengine.engine.step import StepPlan
from tpengine.engine.structured_output import Failures, StructuredOutputs


@dataclass
class ScheduledStep:
    """One step as scheduled on rank 0: the sequences ``seqs`` (a prefill step when ``is_prefill``),
    whether some carry speculative proposals (``speculative``), the :class:`StepPlan` every rank
    runs, which rows sample a token (``sampled``; False: a prefill chunk), the future grammar
    bitmask of the constrained rows (``masks``, None without any) and the ``time.perf_counter()``
    second it was scheduled (``started``)."""

    seqs: list[Sequence]
    is_prefill: bool
    speculative: bool
    plan: StepPlan
    sampled: list[bool]
    masks: Future | None
    started: float


class StepUpdater:
    """Rank 0's update of a step from its output.

    Args:
        scheduler: the engine's :class:`~tpengine.engine.scheduler.Scheduler`.
        outputs: the engine's :class:`~tpengine.engine.output_processor.OutputProcessor`.
        rows: takes the rows' tokens.
        forker: starts the samples of ``n > 1`` requests.
        spec: speculative decoding, or None without it.
    """

    def __init__(self, scheduler, outputs: OutputProcessor, rows: RowSampler, forker: SampleForker,
                 spec: SpecDecoder | None) -> None:
        self.scheduler, self.outputs, self.rows, self.forker, self.spec = scheduler, outputs, rows, forker, spec

    def update(self, step: ScheduledStep, out: torch.Tensor) -> tuple[list[EngineOutput], int]:
        """Take the tokens of ``step`` from its result ``out`` (argmax ids of a greedy step, else the
        sampled rows' logits, then the prompt rows', then the proposed positions'). Returns the
        outputs (the requests finished in it, then the outputs so far of streaming requests that got a
        token) and the number of tokens emitted."""
        seqs, plan, done = step.seqs, step.plan, []
        batch, rows = self.forker.fork(seqs, step.sampled)  # + the new samples, on their parent's row
        sampled = step.sampled + [True] * (len(batch) - len(seqs))
        emitted, failed = sum(sampled), {}
        b, p = len(seqs), int(plan.prompt_idx.numel())
        if not plan.greedy:
            self.rows.prompt_logprobs(seqs, out[b:b + p], failed)
        row = output_rows(seqs, b + p)
        proposed = 0 if self.spec is None else self.spec.count_proposed(seqs)
        tokens = self.rows.take(out, plan.greedy, batch, [row(r, 0) for r in rows], rows, sampled, failed, step.masks)
        self.accept(batch, tokens, sampled, failed, done)
        if step.speculative:  # position j of a sequence, while its position j - 1 took the proposed token
            def take(live: list[int], j: int) -> list[int]:
                sub, ok, sub_failed = [seqs[i] for i in live], [True] * len(live), {}
                sub_tokens = self.rows.take(out, plan.greedy, sub, [row(i, j) for i in live], live, ok, sub_failed,
                                            None)
                self.accept(sub, sub_tokens, ok, sub_failed, done)
                return sub_tokens

            emitted += self.spec.verify(seqs, tokens, take, self.scheduler.block_manager.trim)
        if self.spec is not None and not step.is_prefill:  # a decode step: how fast each kind emits tokens
            self.spec.policy.record(b, step.speculative, time.perf_counter() - step.started, emitted, proposed)
        for rid in dict.fromkeys(seq.request_id for seq, ok in zip(batch, sampled) if ok):
            if (partial := self.outputs.stream_output(rid)) is not None:
                done.append(partial)
        return done, emitted

    def accept(self, batch: list[Sequence], tokens: list[int], sampled: list[bool], failed: Failures,
               done: list[EngineOutput]) -> None:
        """Take one token per ``batch`` sequence (``sampled`` False: a prefill chunk, none): the grammar
        advances, the text grows and is checked for stop strings, the failed requests (``failed``)
        end with their error output, and the scheduler appends the tokens and finishes what stops
        (outputs into ``done``)."""
        stopped = []
        for i, (seq, tok, ok) in enumerate(zip(batch, tokens, sampled)):
            if ok and i not in failed and seq.structured is not None:
                if (error := StructuredOutputs.advance(seq, tok)) is not None:
                    failed[i] = ("structured output", error)
            try:
                ended = StructuredOutputs.is_complete(seq)  # the grammar is complete: the sample ends
                stopped.append(i not in failed and ok and (self.outputs.detokenize(seq, tok) or ended))
            except Exception as e:  # noqa: BLE001 -- this request's own failure
                failed[i] = ("detokenizing", e)
                stopped.append(False)
        for i, (stage, e) in sorted(failed.items()):
            if not batch[i].is_finished:  # one error output per request, whichever sample failed
                done.append(self.fail(batch[i], stage, e))  # finished now: postprocess skips it
        for seq in self.scheduler.postprocess(batch, tokens, stopped):
            try:
                if (final := self.outputs.finish_sample(seq)) is not None:
                    done.append(final)
            except Exception as e:  # noqa: BLE001
                done.append(self.fail(seq, "detokenizing", e))

    def fail(self, seq: Sequence, stage: str, exc: Exception) -> EngineOutput:
        """End ``seq``'s request (every sample's blocks freed) with the error output of ``exc`` raised
        while ``stage``."""
        for s in self.outputs.sequences(seq.request_id) or [seq]:
            self.scheduler.finish(s, "abort")
        self.outputs.drop(seq.request_id)
        return failed_output(seq.request_id, seq.token_ids[: seq.num_prompt_tokens], stage, exc)
