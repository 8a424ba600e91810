"""The sampling fields every request shape shares (vLLM's SamplingParams names)."""

from __future__ import annotations

from typing import Any, ClassVar

from tpengine.protocol.base import Problem
from tpengine.protocol.fields import (
    Flag,
    LogitBias,
    MaxTokens,
    MinP,
    MinTokens,
    N,
    NumLogprobs,
    Penalty,
    RepetitionPenalty,
    Seed,
    Stop,
    StopTokenIds,
    Temperature,
    TopK,
    TopP,
    as_json,
)
from tpengine.protocol.structured import StructuredFields

#: Fields copied to SamplingParams kwargs as they are (when given).
_AS_IS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "n", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "min_tokens", "include_stop_str_in_output",
          "skip_special_tokens", "prompt_logprobs")


class SamplingFields(StructuredFields):
    """``max_tokens`` (>= 1), ``temperature`` (>= 0; 0 greedy), ``top_p`` in (0, 1], ``top_k`` >= -1
    (0 or -1 disabled), ``min_p`` in [0, 1], ``seed`` in [-2**63, 2**64), ``stop`` (a string or a
    list), ``ignore_eos``, ``n`` (>= 1 samples), ``presence_penalty`` and ``frequency_penalty`` in
    [-2, 2], ``repetition_penalty`` > 0, ``min_tokens`` >= 0 (<= ``max_tokens``), ``logit_bias``
    (``{"<token id>": bias in [-100, 100]}``), ``stop_token_ids``, ``include_stop_str_in_output``,
    ``skip_special_tokens``, ``prompt_logprobs`` in [0, 20]; at most one output constraint
    (:class:`~tpengine.protocol.structured.StructuredFields`: ``response_format``,
    ``structured_outputs``, ``guided_*``). ``null`` (or leaving a field out) means
    "not given". (``logprobs`` is each shape's own: an integer in the simple and completions
    shapes, a flag with ``top_logprobs`` in chat.)"""

    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    ignore_eos: Flag | None = None
    n: N | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: MinTokens | None = None
    logit_bias: LogitBias | None = None
    stop_token_ids: StopTokenIds | None = None
    include_stop_str_in_output: Flag | None = None
    skip_special_tokens: Flag | None = None
    prompt_logprobs: NumLogprobs | None = None

    #: The fields whose value is the request's max_tokens, the last given winning.
    MAX_TOKENS_KEYS: ClassVar[tuple[str, ...]] = ("max_tokens",)

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[Problem]:
        """``min_tokens`` greater than the request's ``max_tokens`` (both given as integers)."""
        out = cls.structured_problems(data)
        lo = data.get("min_tokens")
        hi = next((data[k] for k in reversed(cls.MAX_TOKENS_KEYS) if _int(data.get(k))), None)
        if _int(lo) and hi is not None and lo > hi:
            name = next(k for k in reversed(cls.MAX_TOKENS_KEYS) if _int(data.get(k)))
            out.append((("min_tokens",), f"must be <= {name} ({hi}), got {as_json(lo)}"))
        return out

    def sampling_kwargs(self) -> dict[str, Any]:
        """:class:`tpengine.sampling_params.SamplingParams` kwargs for the fields given:
        ``top_k`` -1 becomes 0 (disabled), ``stop`` and ``stop_token_ids`` tuples, ``logit_bias``
        keys ints, the output constraint ``structured_outputs``.

        Raises:
            ValueError: a ``json`` constraint given as text that is not JSON."""
        kw: dict[str, Any] = {}
        for name in _AS_IS:
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        if kw.get("top_k") == -1:
            kw["top_k"] = 0
        if self.stop is not None:
            kw["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.stop_token_ids is not None:
            kw["stop_token_ids"] = tuple(self.stop_token_ids)
        if self.logit_bias is not None:
            kw["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
        if (constraint := self.structured_params()) is not None:
            kw["structured_outputs"] = constraint
        return kw


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
