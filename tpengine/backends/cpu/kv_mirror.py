"""A contiguous copy of the running decode batch's KV cache, kept across decode steps (CPU).

Decode attention on CPU is memory-bound: gathering every sequence's cached keys and values out of
the paged cache into a contiguous ``[B, Hkv, L, D]`` tensor each step reads and writes the whole
context once more than the attention matmuls themselves (a large part of a decode step:
docs/notes/kernels.md). When consecutive decode steps run the same
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
the tail masked.

State is explicit and the backend's: the CPU backend keeps one :class:`KVMirror` per attention
layer (made by its ``bind_layer``, keyed by the layer index), and one :class:`Continuity`
that decides, in its per-step ``prepare``, whether a decode step continues the previous one; the
answer travels with the step's metadata as a :class:`MirrorStep`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tpengine.backends.cpu import cpu_fused
from tpengine.utils import cdiv

CHUNK = 32  # mirror capacity granularity (tokens)


@dataclass
class MirrorStep:
    """One decode step, as the mirrors see it: its number (``serial``, counted per backend), whether it
    continues the previous decode step (the same sequences, each one token longer, no prefill between),
    and the append indices its layers share (filled by the first layer, keyed by cache geometry)."""

    serial: int
    continues: bool
    append_index: dict = field(default_factory=dict)  # (bs, hkv, capacity) -> _append_index()


class Continuity:
    """The previous decode step of one backend, to decide whether the next one continues it."""

    def __init__(self):
        self.serial = 0
        self.block_tables: torch.Tensor | None = None
        self.context_lens: torch.Tensor | None = None
        self.prefill_since = True

    def prefill(self) -> None:
        """A prefill step runs (it may reuse freed blocks): the next decode step rebuilds every mirror."""
        self.prefill_since = True

    def decode(self, block_tables: torch.Tensor, context_lens: torch.Tensor) -> MirrorStep:
        """Start a decode step: ``block_tables [B, max_blocks]``, ``context_lens [B]`` int64. It
        continues the previous one iff no prefill ran since, the batch has the same size, its
        block-table rows extend the previous ones and every length grew by exactly one."""
        prev_bt, prev_ctx = self.block_tables, self.context_lens
        width = 0 if prev_bt is None else prev_bt.shape[1]
        continues = bool(
            not self.prefill_since and prev_bt is not None and prev_ctx.shape == context_lens.shape
            and block_tables.shape[1] >= width and torch.equal(context_lens, prev_ctx + 1)
            and torch.equal(block_tables[:, :width], prev_bt)
        )
        self.serial += 1
        self.block_tables, self.context_lens = block_tables.clone(), context_lens.clone()
        self.prefill_since = False
        return MirrorStep(self.serial, continues)


def _append_index(step: MirrorStep, block_tables, context_lens, bs: int, hkv: int,
                  cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the newest token of every (sequence, KV head): in the ``[slots * Hkv, D]`` cache
    view and in the ``[B * Hkv * cap, D]`` mirror view, each ``[B * Hkv]``; computed once a step."""
    key = (bs, hkv, cap)
    if key not in step.append_index:
        dev = context_lens.device
        pos = (context_lens - 1).clamp_min(0)  # a batch-padding row (length 0) rewrites position 0
        slots = block_tables.gather(1, (pos // bs)[:, None])[:, 0].clamp_min(0) * bs + pos % bs
        heads = torch.arange(hkv, device=dev)[None, :]
        rows = torch.arange(context_lens.shape[0], device=dev)[:, None]
        step.append_index[key] = ((slots[:, None] * hkv + heads).flatten(),
                                  ((rows * hkv + heads) * cap + pos[:, None]).flatten())
    return step.append_index[key]


def capacity(max_ctx: int) -> int:
    """Mirror capacity (tokens per sequence) for a step whose longest context is ``max_ctx``."""
    return cdiv(max_ctx, CHUNK) * CHUNK


def usable(num_seqs: int, max_ctx: int, k_cache: torch.Tensor) -> bool:
    """Whether this step may use mirrors: ``num_seqs * capacity(max_ctx)`` tokens fit in the layer's
    paged cache (``[num_blocks, block_size, ...]``), so all mirrors together never take more memory
    than the KV cache itself (a batch of very uneven lengths falls back to a per-step gather)."""
    return num_seqs * capacity(max_ctx) <= k_cache.shape[0] * k_cache.shape[1]


def gather(k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, num_seqs: int, max_ctx: int,
           out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's first ``max_ctx`` cached keys/values into ``[B, Hkv, capacity(max_ctx), D]``
    tensors (``out`` if given, else new zero-filled ones; positions past ``max_ctx`` keep their
    finite contents). The mirror and the per-step path both attend over these shapes, so turning
    mirrors on or off never changes a result. ``index``: see :meth:`KVMirror.decode_kv`."""
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


class KVMirror:
    """One attention layer's mirror: ``k``/``v [B, Hkv, capacity, D]``, the decode step it is up to
    date for, the cache it mirrors (weakly), and counters ``stats`` (``rebuilds``, ``growths``,
    ``appends``: one per decode step, for tests and profiling)."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.serial = -1
        self._source = None  # weakref to the k_cache mirrored
        self.stats = {"rebuilds": 0, "growths": 0, "appends": 0}

    def decode_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, max_ctx: int, step: MirrorStep,
                  cpu_kernels: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values for decode step ``step``: contiguous
        ``[B, Hkv, capacity(max_ctx), D]`` tensors, the same shapes :func:`gather` makes (positions at
        or past ``context_lens[b]`` hold stale finite values: mask them; a contiguous tensor keeps the
        matmuls copy-free, a sliced view did not).

        ``index`` is the ``[B * Hkv * max_ctx]`` row index into the ``[slots * Hkv, D]`` cache view
        (see :mod:`tpengine.backends.cpu.attention`), used when the mirror is rebuilt. Caches are
        ``[num_blocks, block_size, Hkv, D]`` and contiguous; ``cpu_kernels``: appends through the C
        row copy (:func:`tpengine.backends.cpu.cpu_fused.copy_rows`).
        """
        _, bs, hkv, d = k_cache.shape
        nb = context_lens.shape[0]
        same_cache = self._source is not None and self._source() is k_cache
        fresh = (self.k is None or not same_cache or not step.continues or self.serial != step.serial - 1
                 or self.k.shape[0] != nb)
        if not fresh and self.k.shape[2] < max_ctx:  # grow: copy the old contents, then append as usual
            self.stats["growths"] += 1
            old = self.k.shape[2]
            grown = [_empty(nb, hkv, capacity(max_ctx), d, k_cache, old) for _ in "kv"]
            for new, cur in zip(grown, (self.k, self.v)):
                new[:, :, :old] = cur
            self.k, self.v = grown
        if fresh:
            cap = capacity(max_ctx)
            reuse = (same_cache and self.k is not None and self.k.shape[0] == nb and self.k.shape[2] == cap
                     and self.k.dtype == k_cache.dtype)
            self.k, self.v = gather(k_cache, v_cache, index, nb, max_ctx, (self.k, self.v) if reuse else None)
            self._source = weakref.ref(k_cache)
            self.stats["rebuilds"] += 1
        else:  # append each sequence's newest token (already stored in the paged cache)
            self.stats["appends"] += 1
            slots, rows = _append_index(step, block_tables, context_lens, bs, hkv, self.k.shape[2])
            cpu_fused.copy_rows((k_cache.view(-1, d), v_cache.view(-1, d)), (self.k.view(-1, d), self.v.view(-1, d)),
                                rows, slots, cpu_kernels=cpu_kernels)  # bfloat16 on CPU: one C call, else 4 torch ops
        self.serial = step.serial
        return self.k, self.v
