"""Structured outputs on rank 0 (vLLM's ``StructuredOutputManager`` beside its scheduler): grammar
admission, the step's token bitmask, and each sample's matcher.

A request with ``params.structured_outputs`` waits in :class:`StructuredOutputs` while its grammar
compiles on a worker thread (:meth:`StructuredOutputs.submit`), joins the scheduler once compiled
(:meth:`StructuredOutputs.admit`), and carries a :class:`StructuredState` (``Sequence.structured``):
the grammar, its sample's matcher and, while a thinking model's sample is inside its thought, the
``</think>`` token id that ends it (the grammar applies only after it: the one decision the chat
response's reasoning split reads too, :mod:`tpengine.engine.thoughts`). Each step fills the
constrained rows' bitmask while the forward runs (:meth:`StructuredOutputs.masks`); rank 0 masks the
gathered rows (:meth:`StructuredOutputs.apply`) or, in a greedy step, every rank masks its vocabulary
shard at the LM head; each taken token advances the matcher (:meth:`StructuredOutputs.advance`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch

from tpengine.engine.output_processor import failed_output
from tpengine.engine.outputs import EngineOutput
from tpengine.engine.sequence import Sequence
from tpengine.engine.thoughts import ThoughtTags

#: the failure record of a batch row: row -> (stage, exception)
Failures = dict[int, tuple[str, Exception]]


@dataclass
class StructuredState:
    """One sample's structured output: the compiled ``grammar``, this sample's ``matcher`` in it
    (:mod:`tpengine.structured`), and ``reasoning_end``: while the sample still thinks, the token id
    that ends its thought (``</think>``; the grammar waits for it), else None."""

    grammar: object
    matcher: object
    reasoning_end: int | None = None

    def fork(self) -> StructuredState:
        """A new sample's state: its own matcher at the grammar's start (no token taken yet)."""
        return StructuredState(self.grammar, self.grammar.matcher(), self.reasoning_end)

    @property
    def constrains(self) -> bool:
        """Whether the grammar constrains the next token (False while the sample thinks)."""
        return self.reasoning_end is None


class StructuredOutputs:
    """Rank 0's structured outputs: the requests whose grammar compiles, the grammar manager, the masks.

    Args:
        make_manager: builds the :class:`tpengine.structured.StructuredOutputManager` (on first use:
            the grammar libraries read the tokenizer's vocabulary then).
        tags: a thinking model's tag ids (``--reasoning-parser``,
            :func:`tpengine.engine.thoughts.thought_tags`), or None. A request whose
            ``params.thinking`` is set starts inside its thought: its grammar applies after the
            first ``tags.end_id`` it writes. Without ``thinking`` (completions, the ``LLM`` API,
            every request of an engine without tags) it is constrained from its first token.
    """

    def __init__(self, make_manager: Callable[[], object], tags: ThoughtTags | None = None) -> None:
        self._make_manager, self.tags = make_manager, tags
        self._manager = None
        self._lock = threading.Lock()
        self.compiling: list[tuple[Sequence, Future]] = []  # constrained requests waiting for their grammar

    @property
    def manager(self):
        """The grammar manager, made on first use (the server's request threads ask for it too)."""
        with self._lock:
            if self._manager is None:
                self._manager = self._make_manager()
            return self._manager

    def submit(self, seq: Sequence) -> None:
        """Start compiling ``seq``'s grammar; :meth:`admit` schedules it once compiled."""
        self.compiling.append((seq, self.manager.compile(seq.params.structured_outputs)))

    def admit(self, add: Callable[[Sequence], None], drop: Callable[[str], None], idle: bool) -> list[EngineOutput]:
        """Hand the requests whose grammar is compiled to ``add`` (the scheduler's); one whose grammar
        failed, or that ``add`` refuses, becomes its error output (``error_field`` "structured_outputs"
        or "prompt") and is ``drop``-ped from the output processor; an aborted one is forgotten.
        ``idle`` (nothing else can run): first wait at most 50 ms for a compile to finish, so a loop
        of steps does not spin. Returns the error outputs."""
        if not self.compiling:
            return []
        if idle:
            wait_futures([f for _, f in self.compiling], timeout=0.05, return_when=FIRST_COMPLETED)
        errors, still = [], []
        for seq, fut in self.compiling:
            if seq.is_finished:  # aborted while compiling; its output was given then
                continue
            if not fut.done():
                still.append((seq, fut))
                continue
            prompt, grammar = seq.token_ids[: seq.num_prompt_tokens], None
            try:
                grammar = fut.result()
                seq.structured = StructuredState(grammar, grammar.matcher())
                if self.tags is not None and seq.params.thinking:  # the chat front end's decision
                    seq.structured.reasoning_end = self.tags.end_id
                add(seq)
            except ValueError as e:  # GrammarError, or a prompt the scheduler refuses
                drop(seq.request_id)
                field = "prompt" if grammar is not None else "structured_outputs"
                errors.append(EngineOutput(seq.request_id, prompt, error=str(e), error_field=field))
            except Exception as e:  # noqa: BLE001 -- one request's failure is its own error output
                drop(seq.request_id)
                errors.append(failed_output(seq.request_id, prompt, "compiling the grammar", e))
        self.compiling = still
        return errors

    def masks(self, seqs: list[Sequence], sampled: list[bool]) -> Future | None:
        """The bitmask (int32 ``[len(seqs), words]``) of the sampled rows whose grammar constrains the
        next token, filled on a worker thread while the forward runs; None when no row is constrained."""
        matchers = [s.structured.matcher if ok and s.structured is not None and s.structured.constrains else None
                    for s, ok in zip(seqs, sampled)]
        return self.manager.fill_async(matchers) if any(m is not None for m in matchers) else None

    def apply(self, logits: torch.Tensor, masks: torch.Tensor, batch: list[Sequence], rows: list[int],
              sampled: list[bool], failed: Failures) -> torch.Tensor:
        """``logits [len(batch), V]`` with the bitmask ``masks`` (row per scheduled sequence) applied (a
        new tensor when a row changes). Row i is ``batch[i]``'s, from the scheduled sequence ``rows[i]``
        (a new sample of an n > 1 request starts where its parent is, so it takes its parent's mask).
        Only the sampled rows of constrained sequences change; a failure enters those rows in
        ``failed`` as ("structured output", exception) and leaves ``logits`` as they were."""
        hit = [i for i, seq in enumerate(batch) if sampled[i] and seq.structured is not None]
        if not hit:
            return logits
        try:
            idx = torch.tensor(hit, device=logits.device)
            sub = logits.index_select(0, idx)
            self.manager.apply(sub, masks[[rows[i] for i in hit]])
            return logits.index_copy(0, idx, sub)
        except Exception as e:  # noqa: BLE001 -- the constrained requests' own failure
            failed.update({i: ("structured output", e) for i in hit})
            return logits

    @staticmethod
    def advance(seq: Sequence, token: int) -> Exception | None:
        """Take ``token`` into ``seq``'s grammar: while thinking, only watch for the thought's end;
        else the matcher accepts it. Returns the error of a token the grammar does not allow."""
        state = seq.structured
        if state.reasoning_end is not None:  # thinking: unconstrained until its end token
            if token == state.reasoning_end:  # ThoughtTags.thought_end's rule, one token at a time
                state.reasoning_end = None
            return None
        if not state.matcher.accept(token):
            return RuntimeError(f"the grammar does not allow the sampled token {token}")
        return None

    @staticmethod
    def is_complete(seq: Sequence) -> bool:
        """Whether ``seq``'s grammar is complete (its sample ends)."""
        state = seq.structured
        return state is not None and state.constrains and state.matcher.is_terminated
