"""What :class:`tpengine.LLM` returns per prompt, in vLLM's shape (``vllm.outputs``).

The samples are the engine's own :class:`tpengine.engine.outputs.CompletionOutput` (vLLM's
fields: ``index``, ``text``, ``token_ids``, ``finish_reason``, ``logprobs``,
``cumulative_logprob``); :class:`RequestOutput` adds the prompt text. A pooling engine's
:meth:`tpengine.LLM.embed` returns :class:`EmbeddingRequestOutput` (vLLM's, its ``outputs.embedding``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpengine.engine import outputs as engine_outputs
from tpengine.engine.outputs import CompletionOutput, PositionLogprobs

__all__ = ["CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "RequestOutput"]


@dataclass
class RequestOutput:
    """One prompt's result.

    ``request_id``: the LLM's own counter as a string ("0", "1", ...; unique per :class:`LLM`);
    ``prompt``: the prompt text, None for a token-id prompt or a conversation;
    ``prompt_token_ids``: the ids the model saw (a conversation's after the chat template; [] when
    tokenizing failed); ``outputs``: one :class:`CompletionOutput` per sample (``n`` of them), or []
    when the request could not run; ``error``: then the reason (e.g. the prompt is longer than
    ``max_model_len``), else None; ``finished``: always True (``generate`` returns finished requests
    only); ``num_cached_tokens``: prompt tokens whose KV came from the prefix cache;
    ``prompt_logprobs``: with ``SamplingParams.prompt_logprobs``, one entry per prompt token (the
    first None), else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @classmethod
    def from_engine(cls, out: engine_outputs.EngineOutput, prompt: str | None) -> RequestOutput:
        """The vLLM-shaped output of the engine's ``out`` for ``prompt`` (the text, or None)."""
        completions = [] if out.error is not None else list(out.outputs)
        return cls(out.request_id, prompt, list(out.prompt_token_ids), completions, out.finished, out.error,
                   out.num_cached_tokens, out.prompt_logprobs)


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingOutput``): ``embedding``, the pooled and (unless
    asked otherwise) L2-normalized final hidden state as float32 values in a list of floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """The embedding's length."""
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """One prompt's result of :meth:`tpengine.LLM.embed` (vLLM's ``EmbeddingRequestOutput``).

    ``request_id``: the LLM's own counter as a string; ``prompt_token_ids``: the ids the model saw;
    ``outputs``: the :class:`EmbeddingOutput`, None when the prompt could not run; ``error``: then the
    reason (e.g. the prompt is longer than ``max_model_len``), else None; ``finished``: always True;
    ``prompt``: the prompt text, None for a token-id prompt.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool = True
    error: str | None = None
    prompt: str | None = None

    @classmethod
    def from_engine(cls, out: engine_outputs.EngineOutput, prompt: str | None) -> EmbeddingRequestOutput:
        """The vLLM-shaped embedding output of the engine's ``out`` for ``prompt`` (the text, or None)."""
        vec = None if out.error is not None or out.embedding is None else EmbeddingOutput(out.embedding.tolist())
        error = out.error if out.error is not None or vec is not None else "aborted before its embedding was made"
        return cls(out.request_id, list(out.prompt_token_ids), vec, out.finished, error, prompt)

    @classmethod
    def failed(cls, request: RequestOutput) -> EmbeddingRequestOutput:
        """The embedding output of a prompt that failed before the engine (``request.error`` set)."""
        return cls(request.request_id, list(request.prompt_token_ids), None, True, request.error, request.prompt)
