"""Rank 0's per-request output state: the detokenizer, whether the request streams, and the
RequestOutputs built from a sequence (after vLLM's ``OutputProcessor``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from tpengine.engine.detokenizer import IncrementalDetokenizer
from tpengine.engine.outputs import CompletionOutput, RequestOutput
from tpengine.engine.sequence import Sequence


def failed_output(request_id: str, prompt_token_ids: list[int], stage: str, exc: Exception) -> RequestOutput:
    """The error output of a request whose content raised ``exc`` while ``stage`` ("scheduling",
    "sampling", "detokenizing", ...): ``"<stage> failed: <Exception>: <message>"``."""
    return failed_request(request_id, f"{stage} failed: {type(exc).__name__}: {exc}", prompt_token_ids)


def failed_request(request_id: str, message: str, prompt_token_ids: list[int] | None = None) -> RequestOutput:
    """The error output of a failed request with ``message``; the one line also goes to stderr."""
    print(f"[tpengine] request {request_id!r}: {message}", file=sys.stderr, flush=True)
    return RequestOutput(request_id, list(prompt_token_ids or []), error=message)


@dataclass
class RequestState:
    """One live request: its sequence, detokenizer, and whether it streams."""

    seq: Sequence
    detok: IncrementalDetokenizer
    stream: bool
    emitted: str = ""  # a streaming request's text handed out so far


class OutputProcessor:
    """Per-request output state of the live requests, keyed by request id.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
        is_stop_token: ``(seq, token_id) -> bool``: the token ends ``seq`` as EOS / a stop-token id
            (such a token stays in ``token_ids`` and is never detokenized).
    """

    def __init__(self, tokenizer, is_stop_token: Callable[[Sequence, int], bool]) -> None:
        self.tokenizer = tokenizer
        self.is_stop_token = is_stop_token
        self.states: dict[str, RequestState] = {}

    def add(self, seq: Sequence, stream: bool = False) -> None:
        """Start tracking ``seq`` (its request id must not be live).

        Raises:
            ValueError: the request id is already live; an empty stop string.
        """
        if seq.request_id in self.states:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        p = seq.params
        self.states[seq.request_id] = RequestState(seq, IncrementalDetokenizer(
            self.tokenizer, p.stop, p.skip_special_tokens), stream)

    def get(self, request_id: str) -> Sequence | None:
        """The live sequence of ``request_id``, or None."""
        state = self.states.get(request_id)
        return None if state is None else state.seq

    def detokenize(self, seq: Sequence, token_id: int) -> bool:
        """Feed ``token_id`` to ``seq``'s detokenizer; True when a stop string matched."""
        if seq.is_finished or self.is_stop_token(seq, token_id):
            return False
        state = self.states[seq.request_id]
        state.emitted += state.detok.append(token_id)
        return state.detok.stopped

    def stream_output(self, seq: Sequence) -> RequestOutput | None:
        """An unfinished streaming request's output so far (``finished`` False: the text that is safe
        to show, every token id generated), or None for a request that does not stream."""
        state = self.states.get(seq.request_id)
        if state is None or not state.stream or seq.is_finished:
            return None
        return self._build(seq, state.emitted, finished=False)

    def output(self, seq: Sequence) -> RequestOutput:
        """The final output of finished ``seq``; stops tracking it."""
        state = self.states.pop(seq.request_id)
        if not state.detok.stopped:
            state.detok.finish()
        return self._build(seq, state.detok.text, finished=True)

    def drop(self, seq: Sequence) -> None:
        """Stop tracking ``seq`` (failed or aborted)."""
        self.states.pop(seq.request_id, None)

    @staticmethod
    def _build(seq: Sequence, text: str, finished: bool) -> RequestOutput:
        t0 = seq.arrival_time
        sample = CompletionOutput(seq.index, text, list(seq.completion_token_ids),
                                  seq.finish_reason if finished else None)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens], outputs=[sample],
            num_cached_tokens=seq.num_prefix_cached_tokens or 0,
            ttft_s=None if seq.first_token_time is None else seq.first_token_time - t0,
            latency_s=(seq.finish_time or time.monotonic()) - t0 if finished else None, finished=finished,
        )
