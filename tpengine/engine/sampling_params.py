"""Per-request sampling parameters (the subset of vLLM's SamplingParams tpengine supports)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: The sampling fields a request line (and the config file's ``[sampling]`` table) may set, in the
#: order error messages list them; each is a :class:`SamplingParams` field of the same name.
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos")


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    * ``temperature`` 0 means greedy (argmax); otherwise logits are divided by it.
    * ``top_k`` <= 0 disables top-k; ``top_p`` 1.0 disables nucleus sampling; ``min_p`` 0 disables
      min-p (keep tokens with prob >= min_p * max prob).
    * ``seed``: a per-request generator advanced only by this request's own steps, so a seeded
      request samples the same tokens whatever else is batched and at any tp.
    * ``max_tokens``: most generated tokens (>= 1); None: no limit of its own, generate until EOS
      (or a stop) or until the sequence reaches ``max_model_len`` (vLLM's chat default; the engine
      resolves it per request to ``max_model_len`` - prompt tokens); ``stop``: strings that end
      generation (not returned); ``stop_token_ids``: extra ids that end generation (returned in
      token_ids, not text); ``ignore_eos``: never stop on EOS ids.

    Raises:
        ValueError: a value out of range; the message names the field and the valid range.
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

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        for name in ("top_k", "max_tokens"):
            v = getattr(self, name)
            if v is None and name == "max_tokens":
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")

