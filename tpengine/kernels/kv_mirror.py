"""A contiguous copy of the running decode batch's KV cache, kept across decode steps (CPU).

Decode attention on CPU is memory-bound: gathering every sequence's cached keys and values out of
the paged cache into a contiguous ``[B, Hkv, L, D]`` tensor each step reads and writes the whole
context once more than the attention matmuls themselves (at 64 sequences x 200 tokens x 30 layers
the gathers were ~10-15 ms of a ~60 ms step). When consecutive decode steps run the same
sequences, each layer's gathered tensors stay valid but for one new token per sequence, so this
module keeps them (the *mirror*) and appends that token instead of gathering again.

The paged cache stays the only source of truth; a mirror is rebuilt from it (one gather, the
previous per-step cost) whenever continuity is not proven: a prefill ran since the last decode
step, the batch differs (size, block-table rows, or a context length that did not grow by
exactly one). When only the mirror's capacity is exceeded, it *grows*: a larger tensor takes
the old one's contents with one contiguous copy (~8x cheaper than gathering the context again
from the scattered blocks) and the new token is appended. Capacity is the longest context
rounded up to :data:`CHUNK` tokens, so the extra memory is at most the running sequences' KV plus
``CHUNK`` tokens each, and a step uses mirrors only while all of them together fit in the size of the KV
cache (:func:`usable`; else it gathers as before); attention runs over the whole capacity with
the tail masked. Entries are keyed weakly by the layer's cache tensor and vanish with it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tpengine.kernels import cpu_fused

CHUNK = 32  # mirror capacity granularity (tokens)
ENABLED = True  # set from EngineConfig.kv_mirror by the model runner at every step


@dataclass
class _Step:
    serial: int = 0
    continues: bool = False  # this step's batch is the previous decode step's, one token longer
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    prefill_since: bool = True
    append_index: dict = field(default_factory=dict)  # (bs, hkv, capacity) -> _append_index()


@dataclass
class _Mirror:
    k: torch.Tensor  # [B, Hkv, capacity, D]
    v: torch.Tensor
    serial: int  # the decode step it is up to date for


_STEP = _Step()
STATS = {"rebuilds": 0, "growths": 0, "appends": 0}  # per layer and step, since import (for tests and profiling)
_MIRRORS: dict[int, tuple[weakref.ref, _Mirror]] = {}  # id(k_cache) -> (its weak reference, mirror)


def note_prefill() -> None:
    """Record that a prefill step ran (it may have reused freed blocks): the next decode step
    rebuilds every mirror."""
    _STEP.prefill_since = True


def begin_decode_step(block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    """Start a decode step (once per step, before its first layer): decide whether it continues
    the previous one. Shapes: ``block_tables [B, max_blocks]``, ``context_lens [B]`` int64."""
    prev_bt, prev_ctx = _STEP.block_tables, _STEP.context_lens
    width = 0 if prev_bt is None else prev_bt.shape[1]
    _STEP.continues = bool(
        not _STEP.prefill_since and prev_bt is not None and prev_ctx.shape == context_lens.shape
        and block_tables.shape[1] >= width and torch.equal(context_lens, prev_ctx + 1)
        and torch.equal(block_tables[:, :width], prev_bt)
    )
    _STEP.serial += 1
    _STEP.block_tables, _STEP.context_lens = block_tables.clone(), context_lens.clone()
    _STEP.prefill_since = False
    _STEP.append_index = {}


def _append_index(block_tables, context_lens, bs: int, hkv: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the newest token of every (sequence, KV head): in the ``[slots * Hkv, D]`` cache
    view and in the ``[B * Hkv * cap, D]`` mirror view, each ``[B * Hkv]``; computed once a step."""
    key = (bs, hkv, cap)
    if key not in _STEP.append_index:
        dev = context_lens.device
        pos = (context_lens - 1).clamp_min(0)  # a batch-padding row (length 0) rewrites position 0
        slots = block_tables.gather(1, (pos // bs)[:, None])[:, 0].clamp_min(0) * bs + pos % bs
        heads = torch.arange(hkv, device=dev)[None, :]
        rows = torch.arange(context_lens.shape[0], device=dev)[:, None]
        _STEP.append_index[key] = ((slots[:, None] * hkv + heads).flatten(),
                                   ((rows * hkv + heads) * cap + pos[:, None]).flatten())
    return _STEP.append_index[key]


def capacity(max_ctx: int) -> int:
    """Mirror capacity (tokens per sequence) for a step whose longest context is ``max_ctx``."""
    return -(-max_ctx // CHUNK) * CHUNK


def usable(num_seqs: int, max_ctx: int, k_cache: torch.Tensor) -> bool:
    """Whether this step may use mirrors: :data:`ENABLED` and ``num_seqs * capacity(max_ctx)``
    tokens fit in the layer's paged cache (``[num_blocks, block_size, ...]``), so all mirrors
    together never take more memory than the KV cache itself (a batch of very uneven lengths
    falls back to a per-step gather)."""
    return ENABLED and num_seqs * capacity(max_ctx) <= k_cache.shape[0] * k_cache.shape[1]


def gather(k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, num_seqs: int, max_ctx: int,
           out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's first ``max_ctx`` cached keys/values into ``[B, Hkv, capacity(max_ctx), D]``
    tensors (``out`` if given, else new zero-filled ones; positions past ``max_ctx`` keep their
    finite contents). The mirror and the per-step path both attend over these shapes, so turning
    mirrors on or off never changes a result. ``index``: see :func:`decode_kv`."""
    _, _, hkv, d = k_cache.shape
    if out is None:
        out = tuple(_empty(num_seqs, hkv, capacity(max_ctx), d, k_cache, max_ctx) for _ in "kv")
    for buf, cache in zip(out, (k_cache, v_cache)):  # F.embedding: index_select's row gather, faster on CPU
        buf[:, :, :max_ctx] = F.embedding(index, cache.view(-1, d)).view(num_seqs, hkv, max_ctx, d)
    return out


def _empty(nb: int, hkv: int, cap: int, d: int, like: torch.Tensor, filled: int) -> torch.Tensor:
    """A new ``[nb, hkv, cap, d]`` mirror whose positions ``>= filled`` are zero (finite: masked
    positions must not turn the attention's zero weights into NaN); the caller fills the rest."""
    t = torch.empty(nb, hkv, cap, d, dtype=like.dtype, device=like.device)
    t[:, :, filled:].zero_()
    return t


def decode_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, block_tables: torch.Tensor,
              context_lens: torch.Tensor, max_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This layer's keys and values for the current decode step: the mirror's contiguous
    ``[B, Hkv, capacity(max_ctx), D]`` tensors, the same shapes :func:`gather` makes (positions at
    or past ``context_lens[b]`` hold stale finite values: mask them; a contiguous tensor keeps the
    matmuls copy-free, a sliced view did not).

    ``index`` is the ``[B * Hkv * max_ctx]`` row index into the ``[slots * Hkv, D]`` cache view
    (see :func:`tpengine.kernels.reference._decode_indices`), used when the mirror is rebuilt.
    Caches are ``[num_blocks, block_size, Hkv, D]`` and contiguous.
    """
    _, bs, hkv, d = k_cache.shape
    nb = context_lens.shape[0]
    ref, m = _MIRRORS.get(id(k_cache), (None, None))
    if ref is not None and ref() is not k_cache:
        m = None
    fresh = m is None or not _STEP.continues or m.serial != _STEP.serial - 1 or m.k.shape[0] != nb
    if not fresh and m.k.shape[2] < max_ctx:  # grow: copy the old contents, then append as usual
        STATS["growths"] += 1
        old = m.k.shape[2]
        grown = [_empty(nb, hkv, capacity(max_ctx), d, k_cache, old) for _ in "kv"]
        for new, cur in zip(grown, (m.k, m.v)):
            new[:, :, :old] = cur
        m.k, m.v = grown
    if fresh:
        cap = capacity(max_ctx)
        reuse = m is not None and m.k.shape[0] == nb and m.k.shape[2] == cap and m.k.dtype == k_cache.dtype
        k, v = gather(k_cache, v_cache, index, nb, max_ctx, (m.k, m.v) if reuse else None)
        if not reuse:
            m = _Mirror(k, v, 0)
            if ref is None or ref() is not k_cache:
                weakref.finalize(k_cache, _MIRRORS.pop, id(k_cache), None)
            _MIRRORS[id(k_cache)] = (weakref.ref(k_cache), m)
        STATS["rebuilds"] += 1
    else:  # append each sequence's newest token (already stored in the paged cache)
        STATS["appends"] += 1
        slots, rows = _append_index(block_tables, context_lens, bs, hkv, m.k.shape[2])
        if not cpu_fused.copy_rows((k_cache.view(-1, d), v_cache.view(-1, d)), (m.k.view(-1, d), m.v.view(-1, d)),
                                   rows, slots):  # bfloat16 on CPU: one C call for the four ops below
            m.k.view(-1, d).index_copy_(0, rows, k_cache.view(-1, d).index_select(0, slots))
            m.v.view(-1, d).index_copy_(0, rows, v_cache.view(-1, d).index_select(0, slots))
    m.serial = _STEP.serial
    return m.k, m.v
