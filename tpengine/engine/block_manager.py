"""Paged KV-cache bookkeeping with automatic prefix caching (rank 0 only).

Physical block ``b`` holds the K/V of ``block_size`` consecutive token positions; the flat slot
of token position ``p`` of a sequence is ``block_table[p // block_size] * block_size +
p % block_size`` (the layout of vLLM's paged attention).

Prefix caching (vLLM's automatic prefix caching, nano-vllm's hash-chained blocks): a *full*
block whose K/V has been computed is identified by a hash chained over its parent block's hash
and its own token ids (:func:`block_hash`), so equal hashes mean equal token prefixes. Blocks are
reference-counted and shared read-only by every sequence whose prefix matches; a partly filled
block is never shared. A block whose count drops to 0 goes to the free queue *with* its hash: it
stays a cache hit until it is evicted, least recently freed first, when a new block is needed.
Workers never see any of this: they get block tables and slot mappings in the StepPlan.

Sliding windows (vLLM's sliding-window manager): when every attention layer of the model slides, with
``w`` the largest window, a query at position ``i`` reads no key before ``i - w + 1``, so a sequence
whose first query of a step is at ``i`` no longer needs block ``j`` once ``(j + 1) * block_size <=
i - w + 1``. :meth:`BlockManager.free_outside_window` drops its reference to such blocks (a block
another sequence shares, or that holds a cached prefix, stays as the reference counts and the cache
say) and puts -1 in their table entries; the attention kernels never read a -1 entry's block
(``tpengine.backends.checks.window_start``). Its blocks are then allocated as the steps reach them
(:meth:`BlockManager.allocate` / :meth:`BlockManager.grow` for ``num_new_tokens``), not all at
admission, so a sequence holds at most ``ceil(w / block_size) + 1`` blocks while it decodes (more by
the lookahead of speculative tokens, or by a prefill chunk's blocks).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from tpengine.engine.sequence import Sequence
from tpengine.utils import cdiv

#: The hash of the empty prefix: the parent of every sequence's first block.
ROOT_HASH = b""


def block_hash(parent: bytes, token_ids) -> bytes:
    """The chained hash of one full block: BLAKE2b-128 over the parent block's hash and the block's
    token ids (as int64). Equal hashes mean the same tokens at the same positions from position 0
    (up to a 2^-128 collision chance)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    """``num_blocks`` physical KV blocks of ``block_size`` tokens each, reference-counted, with an
    LRU queue of free blocks and (``enable_prefix_caching``) a hash -> block map of cached ones.

    Counts: ``num_free_blocks`` blocks are unreferenced (each can be handed out, evicting its
    cached content if it has any); ``num_cached_blocks`` of those still hold a cached prefix.

    ``sliding_window``: ``w`` (tokens) when every attention layer of the model slides, the largest
    window among them; None (a full-attention layer, or a mixed model) frees nothing before a
    sequence ends. ``num_window_freed`` counts the table entries dropped for leaving the window.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` < 1, ``sliding_window`` < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.num_window_freed = 0
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks  # set once the block's K/V is computed
        self.cached: dict[bytes, int] = {}  # hash -> block holding that prefix
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Unreferenced blocks (cached-and-evictable ones included)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks that still hold a cached prefix."""
        return sum(1 for b in self._free if self.hash_of[b] is not None)

    @property
    def capacity_tokens(self) -> int:
        """Token slots in the whole cache: num_blocks * block_size."""
        return self.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    # ---- sliding window -------------------------------------------------------------------------
    def first_needed_block(self, pos: int) -> int:
        """The first block index a query at position ``pos`` (or any later one) reads: ``max(0, (pos -
        w + 1) // block_size)`` with a sliding window ``w``, else 0."""
        if self.sliding_window is None:
            return 0
        return max(0, (pos - self.sliding_window + 1) // self.block_size)

    @property
    def window_blocks(self) -> int | None:
        """The most blocks a decoding sequence holds with a sliding window ``w`` (one new token a
        step): ``ceil(w / block_size) + 1``; None without one."""
        return None if self.sliding_window is None else cdiv(self.sliding_window, self.block_size) + 1

    @staticmethod
    def num_held_blocks(seq: Sequence) -> int:
        """Blocks ``seq``'s table references (its -1 entries, freed, not counted)."""
        return sum(1 for b in seq.block_table if b >= 0)

    def free_outside_window(self, seq: Sequence, pos: int | None = None) -> int:
        """With a sliding window: drop ``seq``'s reference to every block before
        :meth:`first_needed_block` of ``pos`` (default ``seq.num_cached_tokens``: the first position the
        next step computes) and put -1 in its table entry. A block no one else references joins the free
        queue with its cached prefix, as :meth:`deallocate` does. Call it only between steps, after
        :meth:`cache_computed`, so a block is registered before it is freed. Returns the number of
        blocks dropped (0 without a window)."""
        table = seq.block_table
        j = min(self.first_needed_block(seq.num_cached_tokens if pos is None else pos), len(table)) - 1
        freed = []
        while j >= 0 and table[j] >= 0:  # the freed entries are a prefix of the table
            freed.append(table[j])
            table[j] = -1
            j -= 1
        for b in freed:  # the later blocks first: the earliest, a prefix likelier shared, evicted last
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self._free[b] = None
        self.num_window_freed += len(freed)
        return len(freed)

    def _table_end(self, seq: Sequence, num_new_tokens: int | None) -> int:
        """Tokens the table must cover for a step computing ``num_new_tokens`` from
        ``num_cached_tokens``: all of ``seq``'s tokens without a window or with ``num_new_tokens`` None."""
        if self.sliding_window is None or num_new_tokens is None:
            return seq.num_tokens
        return min(seq.num_tokens, seq.num_cached_tokens + num_new_tokens)

    # ---- hashes -------------------------------------------------------------------------------
    def hashes(self, seq: Sequence) -> list[bytes]:
        """The chained hashes of ``seq``'s full blocks (``num_tokens // block_size`` of them),
        extending ``seq.block_hashes`` as tokens are appended."""
        bs, have = self.block_size, seq.block_hashes
        for i in range(len(have), seq.num_tokens // bs):
            have.append(block_hash(have[-1] if have else ROOT_HASH, seq.token_ids[i * bs:(i + 1) * bs]))
        return have

    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks of ``seq``'s longest cached prefix, in order: whole blocks only, and
        at most ``num_tokens - 1`` tokens, so at least the last token is computed and yields logits.
        Empty without prefix caching."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:  # vLLM v1: computes every position
            return []
        hits = []
        for h in self.hashes(seq)[: (seq.num_tokens - 1) // self.block_size]:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    # ---- allocation ---------------------------------------------------------------------------
    def _take(self, n: int, seq: Sequence) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(
                f"out of KV blocks: seq {seq.seq_id} needs {n} more block(s), "
                f"{len(self._free)} of {self.num_blocks} free"
            )
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)  # the least recently freed
            h = self.hash_of[b]
            if h is not None:  # evict its cached prefix
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.hash_of[b] = None
                self.num_evictions += 1
            self.ref_count[b] = 1
            blocks.append(b)
        return blocks

    def _new_blocks_needed(self, seq: Sequence, hits: list[int], end: int) -> tuple[int, int, int]:
        """(first hit kept, new blocks, free blocks usable for them) for a table covering ``end``
        tokens: with a sliding window the hits before the first computed position's window are not
        taken; kept hits that are free are taken off the queue."""
        lo = self.first_needed_block(len(hits) * self.block_size)
        idle_hits = sum(1 for b in hits[lo:] if self.ref_count[b] == 0)
        return lo, max(0, self.blocks_needed(end) - len(hits)), len(self._free) - idle_hits

    def can_allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> bool:
        """True if ``allocate(seq, num_new_tokens)`` will succeed: its cache hits plus free blocks
        cover the tokens its table must hold."""
        hits = self.match(seq)
        _, need, free = self._new_blocks_needed(seq, hits, self._end_after(seq, hits, num_new_tokens))
        return need <= free

    def fitting_tokens(self, seq: Sequence) -> int:
        """How many tokens from its first uncached one a waiting ``seq`` could compute in its first step
        with the blocks free now (its cached prefix's hits shared, those before the window skipped)."""
        _, _, free = self._new_blocks_needed(seq, self.match(seq), 0)
        return free * self.block_size

    def _end_after(self, seq: Sequence, hits: list[int], num_new_tokens: int | None) -> int:
        if self.sliding_window is None or num_new_tokens is None:
            return seq.num_tokens
        return min(seq.num_tokens, len(hits) * self.block_size + num_new_tokens)

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> int:
        """Fill ``seq.block_table`` before its prefill: the blocks of its cached prefix (shared,
        reference count + 1), then new blocks, for all ``seq.num_tokens`` tokens; with a sliding window
        and ``num_new_tokens`` (the first step's tokens after the cached prefix), only up to them, and
        the prefix's blocks before the first computed position's window are -1 (not referenced). Sets
        ``seq.num_cached_tokens`` to the cached prefix's length and returns it.

        Raises:
            RuntimeError: ``seq`` already holds blocks, or not enough blocks are free.
        """
        if seq.block_table:
            raise RuntimeError(f"seq {seq.seq_id} already holds blocks {seq.block_table}")
        hits = self.match(seq)
        lo, need, free = self._new_blocks_needed(seq, hits, self._end_after(seq, hits, num_new_tokens))
        if need > free:
            raise RuntimeError(f"out of KV blocks: seq {seq.seq_id} needs {need} more block(s), "
                               f"{free} of {self.num_blocks} free")
        for b in hits[lo:]:
            if self.ref_count[b] == 0:
                del self._free[b]
            self.ref_count[b] += 1
        seq.block_table = [-1] * lo + hits[lo:] + self._take(need, seq)
        seq.num_cached_tokens = len(hits) * self.block_size
        return seq.num_cached_tokens

    def grow_need(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks :meth:`grow` takes for a step computing ``num_new_tokens`` of ``seq`` (a prefill
        chunk); 0 without a sliding window (all of a prompt's blocks come at admission)."""
        return max(0, self.blocks_needed(self._table_end(seq, num_new_tokens)) - len(seq.block_table))

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend ``seq.block_table`` (part-way through its prefill) to cover the next ``num_new_tokens``
        tokens from ``num_cached_tokens`` (a no-op when it does already).

        Raises:
            RuntimeError: not enough blocks are free.
        """
        need = self.grow_need(seq, num_new_tokens)
        if need:
            seq.block_table.extend(self._take(need, seq))

    def free_tokens(self, seq: Sequence) -> int:
        """How many tokens from ``num_cached_tokens`` the allocated ``seq``'s table and the free blocks
        can hold."""
        return (len(seq.block_table) + len(self._free)) * self.block_size - seq.num_cached_tokens

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """The index in ``seq.block_table`` of the block that position ``num_tokens - 1`` is written
        to, when another sequence shares that block (a fork's partial block); else None."""
        i = (seq.num_tokens - 1) // self.block_size
        return i if i < len(seq.block_table) and seq.block_table[i] >= 0 and self.ref_count[seq.block_table[i]] > 1 \
            else None

    def _append_need(self, seq: Sequence, extra: int = 0) -> int:
        need = max(0, self.blocks_needed(seq.num_tokens + extra) - len(seq.block_table))
        return need + (self._shared_write_block(seq) is not None)

    def can_append(self, seq: Sequence, extra: int = 0) -> bool:
        """True if ``may_append(seq, extra)`` will succeed: no new block needed, or enough are free."""
        return self._append_need(seq, extra) <= len(self._free)

    def may_append(self, seq: Sequence, extra: int = 0) -> list[tuple[int, int]]:
        """Before a decode step that writes the K/V of positions ``num_tokens - 1`` to
        ``num_tokens - 1 + extra`` (``extra``: the speculative tokens it verifies): grow
        ``seq.block_table`` so it covers ``num_tokens + extra`` tokens. If the block written to first
        is shared with a forked sample, ``seq`` gets its own copy first (copy-on-write, as vLLM's v0
        block manager): a new block replaces it in the table (the later positions' blocks are its own:
        a fork shares only blocks up to ``num_tokens``).

        Returns:
            the (source, destination) block copies the step must run before writing (0 or 1).

        Raises:
            RuntimeError: ``seq`` holds no blocks (never allocated), or no block is free.
        """
        if not seq.block_table:
            raise RuntimeError(f"seq {seq.seq_id} holds no blocks; allocate() it first")
        copies = []
        if (i := self._shared_write_block(seq)) is not None:
            src = seq.block_table[i]
            (dst,) = self._take(1, seq)
            self.ref_count[src] -= 1  # still >= 1: the other sharers keep it
            seq.block_table[i] = dst
            copies.append((src, dst))
        need = max(0, self.blocks_needed(seq.num_tokens + extra) - len(seq.block_table))
        if need:
            seq.block_table.extend(self._take(need, seq))
        return copies

    def trim(self, seq: Sequence) -> int:
        """After a speculative step: give back the blocks past the ones ``seq.num_tokens`` tokens
        need (they held only rejected tokens' K/V, never registered in the prefix cache). Returns the
        number of blocks freed."""
        keep = self.blocks_needed(seq.num_tokens)
        tail = seq.block_table[keep:]
        for b in reversed(tail):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self._free[b] = None
        del seq.block_table[keep:]
        return len(tail)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` (a new sample of ``parent``'s prompt) ``parent``'s blocks, shared: each
        block's reference count + 1 (the -1 entries of blocks ``parent`` freed for leaving its window
        stay -1), the prefix-cache bookkeeping copied. A block either of them later writes to while
        shared is copied first (:meth:`may_append`).

        Raises:
            RuntimeError: ``child`` already holds blocks.
        """
        if child.block_table:
            raise RuntimeError(f"seq {child.seq_id} already holds blocks {child.block_table}")
        for b in parent.block_table:
            if b >= 0:
                self.ref_count[b] += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks

    def cache_computed(self, seq: Sequence) -> None:
        """After a step: register every full block of ``seq`` whose K/V is now computed (the
        first ``num_cached_tokens // block_size``) under its chained hash, so later sequences can
        share it. A block whose prefix another block already caches stays unregistered, and so does a
        -1 entry (a block freed for leaving the window: it was registered, if at all, before)."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_cached_tokens // self.block_size, len(seq.block_table))
        hashes = self.hashes(seq)
        for i in range(seq.num_registered_blocks, full):
            b, h = seq.block_table[i], hashes[i]
            if b >= 0 and self.hash_of[b] is None and h not in self.cached:
                self.hash_of[b] = h
                self.cached[h] = b
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``): later sequences share
        nothing computed before. Blocks in use keep their contents and owners. Returns the number of
        cache entries dropped."""
        n = len(self.cached)
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks
        return n

    def deallocate(self, seq: Sequence) -> None:
        """Drop ``seq``'s reference to each of its blocks; a block no one references joins the free
        queue (tail blocks first, so they are evicted before the prefix blocks other requests are
        likelier to share) and keeps its cached prefix until evicted. Its -1 entries (freed for leaving
        the window) hold nothing. Clears the table and ``num_cached_tokens``.

        Raises:
            RuntimeError: a block in the table is not allocated (double free / foreign block).
        """
        held = [b for b in seq.block_table if b >= 0]
        bad = [b for b in held if self.ref_count[b] <= 0]
        if bad:
            raise RuntimeError(f"seq {seq.seq_id} frees blocks {bad} that are not allocated")
        for b in reversed(held):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self._free[b] = None
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_registered_blocks = 0

    def slot(self, seq: Sequence, pos: int) -> int:
        """Flat cache slot of token position ``pos`` (0-based) of ``seq``.

        Raises:
            IndexError: ``pos`` < 0, not covered by ``seq.block_table``, or in a block freed for
                leaving the window.
        """
        if not 0 <= pos < len(seq.block_table) * self.block_size:
            raise IndexError(
                f"position {pos} of seq {seq.seq_id} not covered by its "
                f"{len(seq.block_table)} block(s) of {self.block_size}"
            )
        if seq.block_table[pos // self.block_size] < 0:
            raise IndexError(f"position {pos} of seq {seq.seq_id} is in a block freed for leaving the window")
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Slots of positions ``start .. end-1`` (e.g. the tokens a step writes)."""
        return [self.slot(seq, p) for p in range(start, end)]
