"""What the engine hands back for one request (rank 0 only): vLLM's ``EngineOutput`` with one
``CompletionOutput`` per sample, and the logprobs of a position."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """One token's log-probability at one position: natural log of its probability under the
    full-vocabulary softmax of the raw logits (float32); ``rank``: 1 for the most likely token;
    ``token``: its text, ``tokenizer.decode([token_id])`` (filled by the output processor; also
    ``decoded_token``, vLLM's name)."""

    token_id: int
    logprob: float
    rank: int
    token: str | None = None

    @property
    def decoded_token(self) -> str | None:
        """vLLM's name of ``token``."""
        return self.token


@dataclass(eq=True)
class PositionLogprobs(Mapping):
    """The logprobs of one position: the token that is there (sampled, or the prompt's) and the
    ``top`` k most likely tokens, most likely first (k = the request's ``logprobs`` or
    ``prompt_logprobs``; padded vocabulary ids never appear).

    It is also vLLM's ``dict[token id, Logprob]`` of the position: ``pos[token_id]``, ``keys()``,
    ``items()`` and ``len()`` cover the chosen token and the top ones (each once), so code written
    against vLLM's ``outputs[0].logprobs[i][token_id].logprob`` reads it the same way.
    """

    chosen: Logprob
    top: list[Logprob] = field(default_factory=list)

    def _entries(self) -> dict[int, Logprob]:
        return {lp.token_id: lp for lp in (self.chosen, *self.top)}

    def __getitem__(self, token_id: int) -> Logprob:
        return self._entries()[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())


@dataclass
class CompletionOutput:
    """One sample of a request.

    ``index``: 0..n-1; ``token_ids``: generated ids (an EOS or stop-token id that ended generation
    included); ``text``: their text, cut before a matched stop string (kept with
    ``include_stop_str_in_output``), special tokens skipped unless ``skip_special_tokens`` is false;
    ``finish_reason``: "stop" | "length" | "abort" (None while unfinished); ``logprobs``: one
    :class:`PositionLogprobs` per token id when the request asked for logprobs, else None;
    ``cumulative_logprob``: the sum of the chosen tokens' logprobs (None without logprobs).
    """

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class EngineOutput:
    """One request: its samples in ``outputs`` (n of them; empty for an error).

    ``text``, ``token_ids`` and ``finish_reason`` are sample 0's (the only one when n is 1).
    ``prompt_logprobs``: with the request's ``prompt_logprobs``, one entry per prompt token, the
    first None (nothing predicts it). ``error``: a message when the request could not run (then
    ``outputs`` is empty). ``num_cached_tokens``: prompt tokens whose KV came from the prefix cache
    (OpenAI's ``usage.prompt_tokens_details.cached_tokens``). Times in seconds: ``ttft_s`` arrival ->
    first token, ``latency_s`` arrival -> finish, ``queue_s`` arrival -> first scheduled (None before),
    ``itl_s`` sample 0's inter-token latencies (the seconds between its consecutive tokens; final
    outputs only, else empty). ``finished``: False for the output so far of a
    streaming request (then each sample's ``text`` is the text safe to show yet, ``token_ids`` every
    id generated yet, and ``latency_s`` is None). ``embedding``: a pooling engine's result
    (:mod:`tpengine.engine.pooling`), float32 ``[hidden_size]`` (or ``dimensions``) on the CPU, None
    otherwise and for an aborted request; such an output holds one empty sample whose
    ``finish_reason`` is "stop" (or "abort").
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    queue_s: float | None = None
    itl_s: tuple[float, ...] = ()
    spec_num_draft_tokens: int | None = None
    spec_num_accepted_tokens: int | None = None
    error: str | None = None
    error_field: str | None = None
    finished: bool = True
    embedding: Any = None  # a torch.Tensor or None (this module imports no torch)

    @property
    def text(self) -> str:
        """Sample 0's text ("" without samples)."""
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        """Sample 0's generated ids ([] without samples)."""
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        """Sample 0's finish reason (None without samples)."""
        return self.outputs[0].finish_reason if self.outputs else None

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens over all samples."""
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, seconds: ``(latency - ttft) / (tokens - 1)`` over
        sample 0; None with fewer than two tokens or unknown times."""
        n = len(self.token_ids)
        if self.ttft_s is None or self.latency_s is None or n < 2:
            return None
        return (self.latency_s - self.ttft_s) / (n - 1)
