"""The token bitmask as torch ops (no grammar library): int32 ``[rows, ceil(V / 32)]``, bit ``t % 32``
of word ``t // 32`` set when token ``t`` is allowed (xgrammar's and llguidance's layout)."""

from __future__ import annotations

import torch

# byte value -> its 8 bits, True where the bit is 0 (the token is banned); little-endian words keep the
# tokens of a word's byte k in byte k
_BANNED_BY_BYTE = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0


def banned(mask: torch.Tensor, start: int = 0, width: int | None = None) -> torch.Tensor:
    """Bool ``[rows, width]``: True where token ``start + j`` is not allowed, for ``mask`` int32
    ``[rows, words]`` (``width`` default: every token the mask covers from ``start``)."""
    bits = _BANNED_BY_BYTE.to(mask.device)[mask.contiguous().view(torch.uint8).long()].flatten(1)
    return bits[:, start:] if width is None else bits[:, start:start + width]


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Set ``logits[i, j]`` to -inf in place where token ``start + j`` is not allowed by ``mask[i]``:
    ``logits`` float ``[rows, width]`` (the whole vocabulary, or one rank's shard of it from
    ``start``), ``mask`` int32 ``[rows, words]``. Returns ``logits``."""
    return logits.masked_fill_(banned(mask, start, logits.shape[1]), float("-inf"))
