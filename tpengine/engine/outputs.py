"""What the engine hands back for one request (rank 0 only)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """One finished request.

    ``token_ids``: generated ids (an EOS or stop-token id that ended generation included);
    ``text``: detokenized generated text, cut before a matched stop string, special tokens
    skipped; ``finish_reason``: "stop" | "length" | "abort"; ``error``: a message when the
    request could not run (then ``token_ids`` is empty and ``finish_reason`` is None).
    ``num_cached_tokens``: prompt tokens whose KV came from the prefix cache (OpenAI's
    ``usage.prompt_tokens_details.cached_tokens``).
    Times in seconds: ``ttft_s`` arrival -> first token, ``latency_s`` arrival -> finish.
    ``finished``: False for the output so far of a streaming request (then ``text`` is the text
    safe to show yet, ``token_ids`` every id generated yet, ``finish_reason`` and ``latency_s`` None).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str | None = None
    error_field: str | None = None
    finished: bool = True

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, seconds: ``(latency - ttft) / (tokens - 1)``; None
        with fewer than two tokens or unknown times."""
        n = len(self.token_ids)
        if self.ttft_s is None or self.latency_s is None or n < 2:
            return None
        return (self.latency_s - self.ttft_s) / (n - 1)
