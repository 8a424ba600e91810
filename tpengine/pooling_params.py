"""Per-request parameters of a pooling request (vLLM's ``PoolingParams``): what a pooling engine
(``runner`` "pooling") does with one prompt's pooled hidden state."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """One embedding request's options.

    * ``normalize``: L2-normalize the embedding; None: the engine's ``pooler_config.normalize``
      (default True).
    * ``dimensions``: the embedding's length, cut from the front (matryoshka representations) and
      normalized again; only a model whose config sets ``is_matryoshka`` (or
      ``matryoshka_dimensions``) takes it, as in vLLM. None: the model's hidden size.

    ``n`` (1) and ``max_tokens`` (0) read as a :class:`tpengine.sampling_params.SamplingParams`'s
    for what weighs requests (the data-parallel router): one sample, no generated tokens.

    Raises:
        ValueError: ``normalize`` not a bool or None; ``dimensions`` not an integer >= 1 or None.
    """

    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or unset, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be an integer >= 1 or unset, got {d!r}")

    @property
    def n(self) -> int:
        """Samples per request: always 1."""
        return 1

    @property
    def max_tokens(self) -> int:
        """Generated tokens: always 0 (a pooling request is prefill only)."""
        return 0
