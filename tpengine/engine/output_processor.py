"""Rank 0's per-request output state: each sample's detokenizer, whether the request streams, and
the EngineOutputs built from its sequences (after vLLM's ``OutputProcessor``).

A request with ``n`` samples is one :class:`RequestState` holding its ``n`` sequences (sample 0 is
the request's first sequence; the others join when they fork from it, see
:meth:`tpengine.engine.scheduler.Scheduler.fork`); its output is built once every sample finished.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tpengine.engine.detokenizer import IncrementalDetokenizer
from tpengine.engine.outputs import CompletionOutput, EngineOutput, PositionLogprobs
from tpengine.engine.sequence import Sequence
from tpengine.sampling_params import SamplingParams


def failed_output(request_id: str, prompt_token_ids: list[int], stage: str, exc: Exception) -> EngineOutput:
    """The error output of a request whose content raised ``exc`` while ``stage`` ("scheduling",
    "sampling", "detokenizing", ...): ``"<stage> failed: <Exception>: <message>"``."""
    return failed_request(request_id, f"{stage} failed: {type(exc).__name__}: {exc}", prompt_token_ids)


def failed_request(request_id: str, message: str, prompt_token_ids: list[int] | None = None) -> EngineOutput:
    """The error output of a failed request with ``message``; the one line also goes to stderr."""
    print(f"[tpengine] request {request_id!r}: {message}", file=sys.stderr, flush=True)
    return EngineOutput(request_id, list(prompt_token_ids or []), error=message)


@dataclass
class Sample:
    """One sample's output state: its sequence, detokenizer, and the text handed out so far."""

    seq: Sequence
    detok: IncrementalDetokenizer
    emitted: str = ""
    flushed: bool = False

    def flush(self) -> None:
        """The sample finished: take the detokenizer's held-back text (once)."""
        if not self.flushed and not self.detok.stopped:
            self.emitted += self.detok.finish()
        self.flushed = True


@dataclass
class RequestState:
    """One live request: its ``n`` samples (fewer until they fork), whether it streams, and the
    params it asked for when the engine runs it with others (``asked.max_tokens`` 0: a prompt
    scored through one token that its output leaves out)."""

    n: int
    stream: bool
    asked: SamplingParams | None = None
    samples: list[Sample] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        """Every one of the ``n`` samples exists and is finished."""
        return len(self.samples) == self.n and all(s.seq.is_finished for s in self.samples)


class OutputProcessor:
    """Per-request output state of the live requests, keyed by request id.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
        is_stop_token: ``(seq, token_id) -> bool``: the token ends ``seq`` as EOS / a stop-token id
            (such a token stays in ``token_ids``; its text joins the output only with
            ``include_stop_str_in_output``, as in vLLM).
    """

    def __init__(self, tokenizer, is_stop_token: Callable[[Sequence, int], bool]) -> None:
        self.tokenizer = tokenizer
        self.is_stop_token = is_stop_token
        self.states: dict[str, RequestState] = {}
        self._token_text: dict[int, str] = {}  # token id -> decode([id]), for logprobs

    def _sample(self, seq: Sequence) -> Sample:
        p = seq.params
        return Sample(seq, IncrementalDetokenizer(self.tokenizer, p.stop, p.skip_special_tokens,
                                                  p.include_stop_str_in_output, p.min_tokens,
                                                  prompt_token_ids=seq.prompt_token_ids))

    def add(self, seq: Sequence, stream: bool = False, asked: SamplingParams | None = None) -> None:
        """Start tracking request ``seq`` (sample 0 of its ``params.n``; its id must not be live);
        ``asked``: the request's own params when they differ from ``seq.params`` (a prompt-only
        request: its output holds ``asked.n`` empty samples, finish reason "length", or "abort"
        when it was aborted).

        Raises:
            ValueError: the request id is already live; an empty stop string.
        """
        if seq.request_id in self.states:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        state = RequestState(seq.params.n, stream, asked if asked is not seq.params else None)
        state.samples.append(self._sample(seq))
        self.states[seq.request_id] = state

    def add_sample(self, seq: Sequence) -> None:
        """Track ``seq``, sample ``seq.index`` of a live request, forked from its sample 0."""
        self.states[seq.request_id].samples.append(self._sample(seq))

    def get(self, request_id: str) -> Sequence | None:
        """The live request's sample 0 sequence, or None."""
        state = self.states.get(request_id)
        return None if state is None else state.samples[0].seq

    def sequences(self, request_id: str) -> list[Sequence]:
        """Every sequence of live ``request_id`` (its samples so far; [] when not live)."""
        state = self.states.get(request_id)
        return [] if state is None else [s.seq for s in state.samples]

    def detokenize(self, seq: Sequence, token_id: int) -> bool:
        """Feed ``token_id`` to ``seq``'s detokenizer; True when a stop string matched."""
        if seq.is_finished:
            return False
        sample = self.states[seq.request_id].samples[seq.index]
        if self.is_stop_token(seq, token_id):  # its text only with include_stop_str_in_output (vLLM)
            sample.emitted += sample.detok.append_stop_token(token_id)
            return False
        sample.emitted += sample.detok.append(token_id)
        return sample.detok.stopped

    def finish_sample(self, seq: Sequence) -> EngineOutput | None:
        """``seq`` finished: flush its detokenizer. Returns the request's final output once every
        sample finished (and stops tracking it), else None (also for a request already output)."""
        state = self.states.get(seq.request_id)
        if state is None:
            return None
        state.samples[seq.index].flush()
        if not state.finished:
            return None
        del self.states[seq.request_id]
        for sample in state.samples:
            sample.flush()
        return self._build(state, finished=True)

    def stream_output(self, request_id: str) -> EngineOutput | None:
        """A live streaming request's output so far (``finished`` False: each sample's text that is
        safe to show and every token id generated), or None for one that does not stream."""
        state = self.states.get(request_id)
        if state is None or not state.stream:
            return None
        return self._build(state, finished=False)

    def output(self, request_id: str) -> EngineOutput:
        """The final output of ``request_id`` now (its unfinished samples as they are: an aborted
        request); stops tracking it."""
        state = self.states.pop(request_id)
        for sample in state.samples:
            sample.flush()
        return self._build(state, finished=True)

    def drop(self, request_id: str) -> None:
        """Stop tracking ``request_id`` (failed)."""
        self.states.pop(request_id, None)

    def _texts(self, logprobs: list[PositionLogprobs | None] | None) -> None:
        """Fill in the ``token`` text of every Logprob (``tokenizer.decode([id])``, cached per id)."""
        for pos in logprobs or ():
            if pos is None:
                continue
            for lp in (pos.chosen, *pos.top):
                if lp.token is None:
                    text = self._token_text.get(lp.token_id)
                    if text is None:
                        text = self._token_text[lp.token_id] = self.tokenizer.decode([lp.token_id])
                    lp.token = text

    def _build(self, state: RequestState, finished: bool) -> EngineOutput:
        first = state.samples[0].seq
        outputs = []
        if state.asked is not None and state.asked.prompt_only:
            lp = None if state.asked.logprobs is None else []
            reason = None if not finished else "abort" if first.finish_reason == "abort" else "length"
            outputs = [CompletionOutput(i, "", [], reason, lp, None if lp is None else 0.0)
                       for i in range(state.asked.n)]
        for sample in state.samples if not outputs else ():
            seq = sample.seq
            text = sample.detok.text if finished else sample.emitted
            logprobs = None if seq.logprobs is None else list(seq.logprobs)
            self._texts(logprobs)
            outputs.append(CompletionOutput(seq.index, text, list(seq.completion_token_ids),
                                            seq.finish_reason if seq.is_finished or finished else None, logprobs,
                                            None if logprobs is None else seq.cumulative_logprob))
        prompt_logprobs = None if first.prompt_logprobs is None else [None, *first.prompt_logprobs]
        self._texts(prompt_logprobs)
        t0 = first.arrival_time
        ends = [s.seq.finish_time for s in state.samples if s.seq.finish_time is not None]
        return EngineOutput(
            request_id=first.request_id, prompt_token_ids=first.token_ids[: first.num_prompt_tokens],
            outputs=outputs, prompt_logprobs=prompt_logprobs, num_cached_tokens=first.num_prefix_cached_tokens or 0,
            ttft_s=None if first.first_token_time is None else first.first_token_time - t0,
            latency_s=(max(ends) if ends else time.monotonic()) - t0 if finished else None, finished=finished,
            queue_s=None if first.scheduled_time is None else first.scheduled_time - t0,
            itl_s=tuple(first.itl) if finished else (),
            spec_num_draft_tokens=_total(state, "proposed"),
            spec_num_accepted_tokens=_total(state, "accepted"),
        )


def _total(state: RequestState, name: str) -> int | None:
    """The sum of a speculative counter (a :class:`~tpengine.engine.spec_decode.SpecState` field)
    over the request's samples (None: no speculative decoding)."""
    specs = [s.seq.spec for s in state.samples]
    return None if any(v is None for v in specs) else sum(getattr(v, name) for v in specs)
