"""Paged KV-cache bookkeeping: which physical blocks each sequence owns (rank 0 only).

Physical block ``b`` holds the K/V of ``block_size`` consecutive token positions; the flat slot
of token position ``p`` of a sequence is ``block_table[p // block_size] * block_size +
p % block_size`` (the layout of vLLM's paged attention). No prefix caching: a block has exactly
one owner.
"""

from __future__ import annotations

from collections import deque

from tpengine.engine.sequence import Sequence
from tpengine.utils import cdiv


class BlockManager:
    """Free list of ``num_blocks`` physical KV blocks of ``block_size`` tokens each.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` < 1.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Token slots in the whole cache: num_blocks * block_size."""
        return self.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def _take(self, n: int, seq: Sequence) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(
                f"out of KV blocks: seq {seq.seq_id} needs {n} more block(s), "
                f"{len(self._free)} of {self.num_blocks} free"
            )
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def can_allocate(self, seq: Sequence) -> bool:
        """True if enough blocks are free to hold all ``seq.num_tokens`` tokens."""
        return self.blocks_needed(seq.num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Fill ``seq.block_table`` with blocks for all its tokens (before a prefill).

        Raises:
            RuntimeError: ``seq`` already holds blocks, or not enough blocks are free.
        """
        if seq.block_table:
            raise RuntimeError(f"seq {seq.seq_id} already holds blocks {seq.block_table}")
        seq.block_table = self._take(self.blocks_needed(seq.num_tokens), seq)

    def _append_need(self, seq: Sequence) -> int:
        return max(0, self.blocks_needed(seq.num_tokens) - len(seq.block_table))

    def can_append(self, seq: Sequence) -> bool:
        """True if ``may_append(seq)`` will succeed: no new block needed, or one is free."""
        return self._append_need(seq) <= len(self._free)

    def may_append(self, seq: Sequence) -> None:
        """Before a decode step that writes the K/V of position ``num_tokens - 1``: grow
        ``seq.block_table`` so it covers ``num_tokens`` tokens (adds at most one block).

        Raises:
            RuntimeError: ``seq`` holds no blocks (never allocated), or no block is free.
        """
        if not seq.block_table:
            raise RuntimeError(f"seq {seq.seq_id} holds no blocks; allocate() it first")
        need = self._append_need(seq)
        if need:
            seq.block_table.extend(self._take(need, seq))

    def deallocate(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the free list; clear its table and cached count.

        Raises:
            RuntimeError: a block in the table is not allocated (double free / foreign block).
        """
        bad = [b for b in seq.block_table if b not in self._used]
        if bad:
            raise RuntimeError(f"seq {seq.seq_id} frees blocks {bad} that are not allocated")
        for b in reversed(seq.block_table):
            self._used.discard(b)
            self._free.append(b)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def slot(self, seq: Sequence, pos: int) -> int:
        """Flat cache slot of token position ``pos`` (0-based) of ``seq``.

        Raises:
            IndexError: ``pos`` < 0 or not covered by ``seq.block_table``.
        """
        if not 0 <= pos < len(seq.block_table) * self.block_size:
            raise IndexError(
                f"position {pos} of seq {seq.seq_id} not covered by its "
                f"{len(seq.block_table)} block(s) of {self.block_size}"
            )
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Slots of positions ``start .. end-1`` (e.g. the tokens a step writes)."""
        return [self.slot(seq, p) for p in range(start, end)]
