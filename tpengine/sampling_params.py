"""Per-request sampling parameters (vLLM's ``SamplingParams`` names and ranges)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tpengine.structured.params import StructuredOutputsParams

#: The sampling fields a request line (and the config file's ``[sampling]`` table) may set, in the
#: order error messages list them; each is a :class:`SamplingParams` field of the same name.
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos",
                 "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                 "logit_bias", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                 "logprobs", "prompt_logprobs")

#: Most top logprobs a request may ask for per position (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20
#: A seed's valid range: the int64 range and the uint64 range together, [-2**63, 2**64), as
#: ``torch.Generator.manual_seed`` takes it (a negative seed s is the seed 2**64 + s).
SEED_MIN, SEED_END = -(2**63), 2**64
#: ``logit_bias`` values must lie in [-100, 100] (OpenAI's range).
MAX_LOGIT_BIAS = 100.0


def _number(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")


def _integer(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    Sampling, applied to a row of raw logits in this order (vLLM's): ``logit_bias`` is added;
    while fewer than ``min_tokens`` tokens are generated, EOS and ``stop_token_ids`` get -inf; then
    the penalties: ``repetition_penalty`` (HF's and CTRL's: a logit of a token in the prompt or the
    output is divided by it when > 0, multiplied when < 0; 1.0 off), ``presence_penalty`` (OpenAI's:
    subtracted once from every token in the output; 0 off) and ``frequency_penalty`` (subtracted
    once per occurrence in the output; 0 off); then ``temperature`` (0 greedy: argmax), ``top_k``
    (<= 0 off), ``top_p`` (1.0 off), ``min_p`` (keep tokens with prob >= min_p * max prob; 0 off).

    * ``seed``: a per-request generator advanced only by this request's own draws, so a seeded
      request samples the same tokens whatever else is batched and at any tp; ``n > 1`` samples use
      seeds ``seed + i`` (mod 2**64), as vLLM's parallel sampling.
    * ``n``: independent samples of one prompt; its KV blocks are computed once and shared.
    * ``max_tokens``: most generated tokens per sample (>= 0); None: until EOS, a stop, or
      ``max_model_len``; 0: score the prompt only (vLLM's ``echo`` with ``max_tokens`` 0): the
      prompt runs through prefill, its ``prompt_logprobs`` come back when asked, and every sample
      is empty with finish reason "length". ``min_tokens``: no EOS, stop token or stop string ends a sample before it
      has this many tokens. ``stop``: strings that end generation (not in the text unless
      ``include_stop_str_in_output``); ``stop_token_ids``: extra ids that end generation (kept in
      token_ids; as an EOS id, their text is in the output only with
      ``include_stop_str_in_output``, vLLM's rule); ``ignore_eos``: never stop on EOS ids.
    * ``logprobs``: None, or k in [0, MAX_LOGPROBS]: each generated token's logprob plus the k
      most likely tokens' (from the full-vocabulary log-softmax of the raw logits, as vLLM's
      default ``raw_logprobs``). ``prompt_logprobs``: the same for every prompt position after the
      first (such a request does not read the prefix cache: every position is computed).
    * ``logit_bias``: token id -> bias in [-100, 100] added to its logit; ``skip_special_tokens``:
      leave special tokens out of the text.
    * ``structured_outputs``: a :class:`~tpengine.structured.StructuredOutputsParams` (a JSON schema,
      regex, choice or grammar) the output must match: before anything else, every token the grammar
      does not allow next gets -inf, and the sample ends ("stop") once the grammar is complete.
    * ``thinking``: the output starts inside a reasoning parser's thought (the engine's
      ``reasoning_parser``): ``structured_outputs`` applies only after the thought's end token
      (:mod:`tpengine.frontend.reasoning`, whose chat front ends set it per request); False (default):
      constrained from the first token. Not a request field.

    Raises:
        ValueError: a value out of range or of the wrong type; the message names the field, the
            valid range and the value.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    thinking: bool = False

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _number(name, getattr(self, name))
        for name in ("top_k", "n", "min_tokens"):
            _integer(name, getattr(self, name))
        for name in ("max_tokens", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _integer(name, getattr(self, name))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed < SEED_END):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (0: score the prompt only), got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be integer token ids >= 0, got {t!r}")
        if self.logit_bias is not None:
            bias: dict[int, float] = {}
            for k, v in dict(self.logit_bias).items():
                if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                    raise ValueError(f"logit_bias keys must be integer token ids >= 0, got {k!r}")
                _number(f"logit_bias[{k}]", v)
                if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias[{k}] must be in [-100, 100], got {v}")
                bias[k] = float(v)
            object.__setattr__(self, "logit_bias", bias or None)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")

    @property
    def prompt_only(self) -> bool:
        """``max_tokens`` 0: the prompt is scored, nothing is generated."""
        return self.max_tokens == 0

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax is taken."""
        return self.temperature == 0.0

    @property
    def needs_logits(self) -> bool:
        """Whether rank 0 needs this request's full logits row (anything beyond a plain argmax:
        sampling, penalties, a bias, min_tokens or logprobs); False lets a step of such requests take
        the argmax on each rank's vocabulary shard (a structured output's mask, broadcast, applied to
        each shard first)."""
        return (not self.greedy or self.logprobs is not None or self.logit_bias is not None
                or self.min_tokens > 0 or self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def ids_to_check(self) -> tuple[int, ...]:
        """Token ids the request names (``stop_token_ids``, ``logit_bias`` keys), for the engine to
        check against the vocabulary."""
        return self.stop_token_ids + tuple(self.logit_bias or ())
