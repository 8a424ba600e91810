"""Continuous-batching scheduler with recompute preemption (rank 0 only).

Design as in nano-vllm / vLLM v0: each step is either one prefill batch (waiting sequences,
FIFO) or one decode batch (all running sequences). When a decode step runs out of KV blocks the
most recently admitted running sequence is preempted: its blocks are freed and it goes back to
the front of the waiting queue, to be re-prefilled later with ALL its tokens (prompt + generated
so far). Generated tokens are kept, so nothing is lost or repeated (case C13).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from tpengine.config import EngineConfig
from tpengine.engine.block_manager import BlockManager
from tpengine.engine.sequence import Sequence, SequenceStatus

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the queues and the KV pool (counts)."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int


class Scheduler:
    """Decides which sequences run each step and finishes them.

    Uses ``config.max_num_seqs`` (most running sequences at once), ``config.max_num_batched_tokens``
    (most tokens computed in one prefill step), ``config.max_model_len`` (prompt + output tokens)
    and ``config.block_size``.

    Args:
        config: the engine configuration.
        num_kv_blocks: physical KV blocks in the cache (discovered at run time).
        eos_token_ids: every id that ends generation unless ``ignore_eos`` (union of tokenizer,
            generation_config and config.json EOS ids, case C12).

    Context limit: a sequence also finishes with "length" when it would no longer fit in the whole
    cache (``num_tokens > num_kv_blocks * block_size``), so a lone sequence can always proceed.
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int, eos_token_ids: set[int]) -> None:
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_size = config.block_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.block_manager = BlockManager(num_kv_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    # ---- queues -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new request at the back of ``waiting``.

        Raises:
            ValueError: empty prompt; prompt length >= max_model_len (no room for one output
                token); or the prompt needs more KV blocks than the whole cache has. The
                message names both numbers; the engine turns it into a per-request error.
        """
        n = seq.num_tokens
        if n == 0:
            raise ValueError(f"request {seq.request_id!r}: empty prompt (0 tokens)")
        if n >= self.max_model_len:
            raise ValueError(
                f"request {seq.request_id!r}: prompt has {n} tokens, but max_model_len is "
                f"{self.max_model_len} (prompt must be at most {self.max_model_len - 1} tokens "
                "to leave room for one output token)"
            )
        need = self.block_manager.blocks_needed(n)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"request {seq.request_id!r}: prompt has {n} tokens and needs {need} KV blocks "
                f"of {self.block_size}, but the cache has only {self.block_manager.num_blocks} "
                "blocks"
            )
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"seq {seq.seq_id} is {seq.status.name}, not a new request")
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        """True while some sequence is waiting or running (a property, not a method)."""
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            len(self.waiting), len(self.running), bm.num_free_blocks, bm.num_blocks,
            self.num_preemptions,
        )

    # ---- scheduling -----------------------------------------------------------------------
    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick the next step's batch.

        Returns:
            ``(seqs, is_prefill)``. Prefill: waiting sequences in FIFO order while the running
            count stays <= max_num_seqs, the new tokens (``num_tokens - num_cached_tokens``, all
            tokens for a preempted one) stay <= max_num_batched_tokens and blocks can be
            allocated; stops at the first that does not fit. Otherwise decode: every running
            sequence that can get a block for its newest token, preempting the most recent
            ones when blocks run out. ``([], False)`` when nothing is queued.

        Raises:
            RuntimeError: sequences are queued but none can be scheduled (a bookkeeping bug).
        """
        batch = self._schedule_prefill()
        if batch:
            return batch, True
        batch = self._schedule_decode()
        if not batch and self.waiting:
            # Only if every running sequence was preempted this step: their blocks are free now.
            batch = self._schedule_prefill()
            if batch:
                return batch, True
            bm = self.block_manager
            raise RuntimeError(
                f"scheduler stalled: {len(self.waiting)} waiting, head needs "
                f"{bm.blocks_needed(self.waiting[0].num_tokens)} blocks, "
                f"{bm.num_free_blocks}/{bm.num_blocks} free"
            )
        return batch, False

    def _schedule_prefill(self) -> list[Sequence]:
        batch: list[Sequence] = []
        num_batched = 0
        bm = self.block_manager
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            new_tokens = seq.num_tokens - seq.num_cached_tokens
            if num_batched + new_tokens > self.max_num_batched_tokens or not bm.can_allocate(seq):
                break
            self.waiting.popleft()
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            num_batched += new_tokens
            batch.append(seq)
        self.running.extend(batch)
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        batch: list[Sequence] = []
        bm = self.block_manager
        while self.running and len(batch) < self.max_num_seqs:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())  # the most recently admitted
                else:
                    self._preempt(seq)
                    break
            else:
                bm.may_append(seq)
                batch.append(seq)
        self.running.extendleft(reversed(batch))
        return batch

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- results ----------------------------------------------------------------------------
    def is_stop_token(self, seq: Sequence, token_id: int) -> bool:
        """True if ``token_id`` ends ``seq`` with "stop": an EOS id (unless ``params.ignore_eos``)
        or one of ``params.stop_token_ids``. Such a token is kept in ``token_ids`` but never
        detokenized into the text."""
        p = seq.params
        return (token_id in self.eos_token_ids and not p.ignore_eos) or token_id in p.stop_token_ids

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], stopped: list[bool]) -> list[Sequence]:
        """Append one sampled token per sequence (same order as ``schedule`` returned) and
        finish those that stop: the one place a step ends sequences. Sequences finished
        meanwhile (``finish``) are skipped.

        Args:
            seqs: the step's batch.
            token_ids: the sampled token per sequence.
            stopped: per sequence, whether its text (the detokenizer, after this token) matched
                one of ``params.stop``.

        Finish rules, first that applies: "stop" if :meth:`is_stop_token`; "stop" if
        ``stopped``; "length" if ``max_tokens`` tokens were generated, the sequence reached
        ``max_model_len`` or outgrew the whole KV cache.

        Returns:
            the sequences finished by this call (blocks already returned).

        Raises:
            ValueError: ``seqs``, ``token_ids`` and ``stopped`` differ in length.
        """
        if not len(seqs) == len(token_ids) == len(stopped):
            raise ValueError(f"{len(seqs)} sequences but {len(token_ids)} sampled tokens and "
                             f"{len(stopped)} stop-string results")
        now = time.monotonic()
        finished: list[Sequence] = []
        cache_tokens = self.block_manager.capacity_tokens
        for seq, tok, stop_string in zip(seqs, token_ids, stopped):
            if seq.is_finished:
                continue
            tok = int(tok)
            seq.append_token(tok)
            seq.num_cached_tokens = seq.num_tokens - 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            p = seq.params
            reason = None
            if self.is_stop_token(seq, tok) or stop_string:
                reason = "stop"
            elif (
                seq.num_completion_tokens >= p.max_tokens
                or seq.num_tokens >= self.max_model_len
                or seq.num_tokens > cache_tokens
            ):
                reason = "length"
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` now (called by :meth:`postprocess`, or from outside to abort): remove it
        from its queue, free its blocks, set ``finish_reason``. On an already finished sequence
        only the reason changes.

        Raises:
            ValueError: ``reason`` is not "stop", "length" or "abort".
        """
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        seq.finish_reason = reason
        if seq.is_finished:
            return
        for q in (self.running, self.waiting):
            if seq in q:
                q.remove(seq)
                break
        if seq.block_table:
            self.block_manager.deallocate(seq)
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_time = time.monotonic()
