"""Per-position RoPE tables taken from HF's own rotary module, for the rope types whose tables do not
change with the sequence's length.

HF's rotary embedding recomputes ``cos``/``sin`` for a step's positions on every call (about ten tensor
ops: a float product with ``inv_freq``, a concatenation, ``cos``, ``sin``, the attention scaling, the
casts). Each entry depends on its position alone, so for a static rope type (``default``, ``linear``,
``llama3``, ``yarn``, ``proportional``, ...) the module's result for positions ``0..L-1``, computed once,
holds every step's rows: a step then takes them with one ``index_select``. A batch-1 decode step runs
its Python cold after the decode program streamed the weights, where each op counts
(docs/notes/kernels.md, "The batch-1 step outside the products").

``dynamic`` rope types (``inv_freq`` changes once a sequence grows past the model's length) and LongRoPE
(short or long factors by the sequence's length) keep the module per step.
"""

from __future__ import annotations

import torch
from torch import nn

#: positions a call of the module computes while building a table: small enough that torch runs each
#: elementwise op on one thread, in one piece, as it does for a step's few positions
CHUNK_ELEMENTS = 16384


def is_static(rotary: nn.Module, kind: str | None) -> bool:
    """Whether ``rotary``'s tables for layer type ``kind`` (None: its one table) depend on the position
    alone: not a ``dynamic`` type, not LongRoPE, and a plain ``rope_type`` the module reports."""
    rope_type = getattr(rotary, "rope_type", None)
    if kind is not None:
        rope_type = rope_type.get(kind) if isinstance(rope_type, dict) else None
    return isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope"


def build(rotary: nn.Module, length: int, like: torch.Tensor, kind: str | None = None) -> torch.Tensor | None:
    """The module's ``(cos, sin)`` for positions ``0..length-1`` as one tensor ``[2, length, D]`` in
    ``like``'s dtype and device (``table.index_select(1, positions)`` gives a step's ``[2, N, D]``), or
    None where a table would not be the module's result bit for bit: a rope type that is not static
    (:func:`is_static`), or a table whose first and last rows differ from the module's call for that
    position alone (checked once here).

    ``like``: any tensor of the activations' dtype and device (the module reads only those);
    ``kind``: the layer type for a module with one table per type (Gemma 3), else None.

    Raises:
        ValueError: ``length < 1``.
    """
    if length < 1:
        raise ValueError(f"a RoPE table needs at least one position; got {length}")
    if not is_static(rotary, kind):
        return None
    extra = () if kind is None else (kind,)
    x = like[:1]
    positions = torch.arange(length, dtype=torch.int64, device=like.device)
    with torch.no_grad():
        first = rotary(x, positions[:1][None], *extra)
        step = max(1, CHUNK_ELEMENTS // first[0].shape[-1])
        parts = [rotary(x, positions[i:i + step][None], *extra) for i in range(0, length, step)]
        table = torch.stack([torch.cat([p[j][0] for p in parts]) for j in (0, 1)])
        for p in (0, length - 1):  # the module for one position alone, as a decode step calls it
            one = rotary(x, positions[p:p + 1][None], *extra)
            if not all(torch.equal(table[j, p], one[j][0, 0]) for j in (0, 1)):
                return None
    return table
