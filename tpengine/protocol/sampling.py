"""The sampling fields every request shape shares (vLLM's SamplingParams names)."""

from __future__ import annotations

from typing import Any

from tpengine.protocol.base import ProtocolModel
from tpengine.protocol.fields import Flag, MaxTokens, MinP, Seed, Stop, Temperature, TopK, TopP


class SamplingFields(ProtocolModel):
    """``max_tokens`` (>= 1), ``temperature`` (>= 0; 0 greedy), ``top_p`` in (0, 1], ``top_k`` >= -1
    (0 or -1 disabled), ``min_p`` in [0, 1], ``seed`` in [0, 2**64), ``stop`` (a string or a list),
    ``ignore_eos``. ``null`` (or leaving a field out) means "not given"."""

    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    ignore_eos: Flag | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        """:class:`tpengine.engine.sampling_params.SamplingParams` kwargs for the fields given:
        ``top_k`` -1 becomes 0 (disabled), ``stop`` a tuple of strings."""
        kw: dict[str, Any] = {}
        for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        if kw.get("top_k") == -1:
            kw["top_k"] = 0
        if self.stop is not None:
            kw["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return kw
