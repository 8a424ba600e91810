"""What :class:`tpengine.LLM` returns per prompt, in vLLM's shape (``vllm.outputs``).

The engine's own :class:`tpengine.engine.outputs.RequestOutput` is flat (one completion's fields
on the request); :meth:`RequestOutput.from_engine` nests it as vLLM does, so code written against
vLLM's ``RequestOutput.outputs[0].text`` reads tpengine's the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpengine.engine import outputs as engine_outputs


@dataclass
class CompletionOutput:
    """One generated completion (tpengine generates one per prompt: ``n`` = 1).

    ``index``: 0; ``text``: detokenized generated text (special tokens skipped, cut before a
    matched stop string); ``token_ids``: generated ids (an EOS or stop-token id that ended
    generation included); ``finish_reason``: "stop" | "length" | "abort".
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    """One prompt's result.

    ``request_id``: the LLM's own counter as a string ("0", "1", ...; unique per :class:`LLM`);
    ``prompt``: the prompt text, None for a token-id prompt or a conversation;
    ``prompt_token_ids``: the ids the model saw (a conversation's after the chat template; [] when
    tokenizing failed); ``outputs``: ``[CompletionOutput]``, or [] when the request could not run;
    ``error``: then the reason (e.g. the prompt is longer than ``max_model_len``), else None;
    ``finished``: always True (``generate`` returns finished requests only);
    ``num_cached_tokens``: prompt tokens whose KV came from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    error: str | None = None
    num_cached_tokens: int = 0

    @classmethod
    def from_engine(cls, out: engine_outputs.RequestOutput, prompt: str | None) -> RequestOutput:
        """The vLLM-shaped output of the engine's ``out`` for ``prompt`` (the text, or None)."""
        completions = [] if out.error is not None else [
            CompletionOutput(0, out.text, list(out.token_ids), out.finish_reason)]
        return cls(out.request_id, prompt, list(out.prompt_token_ids), completions, out.finished, out.error,
                   out.num_cached_tokens)
