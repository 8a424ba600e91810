"""Continuous-batching scheduler with prefix caching, chunked prefill and recompute preemption
(rank 0 only).

Design as in nano-vllm / vLLM: a step is a prefill batch (waiting sequences, FIFO, prefill
first), a decode batch (every running sequence, one token each), or - while a long prompt is
prefilled in chunks - a mixed batch: every running sequence's next token plus the next chunk (as
vLLM V1 schedules it), so running sequences keep decoding between chunks. A prompt's blocks all
come at admission, its cached prefix shared from the :class:`BlockManager`'s prefix cache; the step
computes tokens ``[num_cached_tokens, num_cached_tokens + num_new_tokens)`` of each sequence and
samples only those whose prefill is then complete. When a step runs out of KV blocks the most
recently admitted running sequence is preempted: its blocks are freed (their computed prefix stays
cached) and it goes back to the front of the waiting queue, to be re-prefilled later with ALL its
tokens (prompt + generated so far). Generated tokens are kept, so nothing is lost or repeated (case C13).

A model whose every attention layer slides (``sliding_window``, the largest window ``w``) frees the
blocks that left a sequence's window before each step (:meth:`BlockManager.free_outside_window`) and
gets its blocks step by step: a prompt's first chunk's at admission, each later chunk's when it is
scheduled (cut to the free blocks, with chunked prefill). A sequence then holds at most ``ceil(w /
block_size) + 1`` blocks while it decodes, its length is not bounded by the cache (with chunked
prefill; a preempted one is prefilled again in chunks), and as many more sequences fit.
"""

from __future__ import annotations

import time
from collections import deque

from tpengine.config import EngineConfig
from tpengine.engine.block_manager import BlockManager
from tpengine.engine.sequence import Sequence, SequenceStatus
from tpengine.engine.stats import SchedulerStats

FINISH_REASONS = ("stop", "length", "abort")


class Scheduler:
    """Decides which sequences run each step and finishes them.

    Uses ``config.max_num_seqs`` (most running sequences at once), ``config.max_num_batched_tokens``
    (most tokens computed in one prefill or mixed step), ``config.max_model_len`` (prompt + output
    tokens), ``config.block_size``, ``config.enable_prefix_caching`` and
    ``config.enable_chunked_prefill`` (a prompt longer than the step's room is cut into chunks).

    Args:
        config: the engine configuration.
        num_kv_blocks: physical KV blocks in the cache (discovered at run time).
        eos_token_ids: every id that ends generation unless ``ignore_eos`` (union of tokenizer,
            generation_config and config.json EOS ids, case C12).
        sliding_window: ``w`` when every attention layer the block tables serve slides (the largest
            window among them), else None (:attr:`ModelRunner.kv_window`).

    Context limit: a sequence also finishes with "length" when it would no longer fit in the whole
    cache (``num_tokens > num_kv_blocks * block_size``), so a lone sequence can always proceed; with a
    sliding window and chunked prefill it needs only its window's blocks, and there is no such limit.
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int, eos_token_ids: set[int],
                 sliding_window: int | None = None) -> None:
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_size = config.block_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.chunked_prefill = config.enable_chunked_prefill
        self.block_manager = BlockManager(num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                          sliding_window)
        # a sliding model's sequence, prefilled in chunks, needs only its window's blocks at any step
        self.sliding = sliding_window is not None and self.chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_prompt_tokens = self.num_cached_prompt_tokens = 0
        self.block_copies: list[tuple[int, int]] = []  # copy-on-write copies the next step runs first

    # ---- queues -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new request at the back of ``waiting``.

        Raises:
            ValueError: empty prompt; prompt length >= max_model_len (no room for one output
                token); or the prompt needs more KV blocks than the whole cache has (with a sliding
                window and chunked prefill: its window's, ``ceil(w / block_size) + 1``). The
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
        if self.sliding:
            need = min(need, self.block_manager.window_blocks)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"request {seq.request_id!r}: prompt has {n} tokens and needs {need} KV blocks "
                f"of {self.block_size}, but the cache has only {self.block_manager.num_blocks} "
                "blocks"
            )
        if seq.params.n > self.max_num_seqs:
            raise ValueError(f"request {seq.request_id!r}: n={seq.params.n} samples run as {seq.params.n} "
                             f"sequences at once, but max_num_seqs is {self.max_num_seqs}")
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"seq {seq.seq_id} is {seq.status.name}, not a new request")
        self.waiting.append(seq)

    @staticmethod
    def room(seq: Sequence) -> int:
        """Running sequences ``seq`` becomes: ``params.n`` for a request that has not forked its
        samples yet (it forks at its first token), else 1."""
        return seq.params.n if seq.index == 0 and seq.num_completion_tokens == 0 else 1

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Start ``children`` (samples 1..n-1 of running ``parent``, new sequences with its prompt)
        in the step that samples ``parent``'s first token: they share its KV blocks (a shared
        partial block is copied when first written, :meth:`BlockManager.may_append`), count as
        computed what it computed, and join ``running`` right after it; their prompt counts once in
        the stats. Then :meth:`postprocess` appends each one's sampled token like ``parent``'s."""
        at = self.running.index(parent) + 1
        for k, child in enumerate(children):
            self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            child.num_cached_tokens, child.num_new_tokens = parent.num_cached_tokens, parent.num_new_tokens
            child.num_prefix_cached_tokens = parent.num_prefix_cached_tokens
            self.running.insert(at + k, child)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies the step just scheduled must run first (then
        forgotten)."""
        copies, self.block_copies = self.block_copies, []
        return copies

    @property
    def has_unfinished(self) -> bool:
        """True while some sequence is waiting or running (a property, not a method)."""
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            len(self.waiting), len(self.running), bm.num_free_blocks, bm.num_blocks,
            self.num_preemptions, bm.num_cached_blocks, self.num_prompt_tokens, self.num_cached_prompt_tokens,
        )

    # ---- scheduling -----------------------------------------------------------------------
    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick the next step's batch and set each sequence's ``num_new_tokens``.

        Returns:
            ``(seqs, is_prefill)``. While no prompt is part-way through its prefill: a prefill of
            waiting sequences in FIFO order while the running count stays <= max_num_seqs, their
            new tokens (``num_tokens - num_cached_tokens`` after the prefix-cache hit) stay <=
            max_num_batched_tokens (with chunked prefill the last one admitted may get only a
            chunk) and blocks can be allocated; otherwise a decode of every running sequence that
            can get a block for its newest token, preempting the most recent ones when blocks run
            out. While a prompt is part-way, or when sequences are decoding and the next waiting
            prompt needs more than one step: a mixed step (``is_prefill`` True), the decodes
            first, then the next chunks and admissions in the room they leave. ``([], False)`` when nothing is queued.
            With a sliding window, every running sequence first gives back the blocks that left its
            window; a chunk is cut to the free blocks, and when no running sequence can take a step the
            most recently admitted ones are preempted until one can.

        Raises:
            RuntimeError: sequences are queued but none can be scheduled (a bookkeeping bug).
        """
        bm = self.block_manager
        if bm.sliding_window is not None:
            for s in self.running:  # their blocks computed so far are registered (postprocess) already
                bm.free_outside_window(s)
        if any(s.is_prefilling for s in self.running) or self._head_needs_chunks():
            decodes = self._schedule_decode()
            chunks = self._schedule_chunks(self.max_num_batched_tokens - len(decodes))
            batch, is_prefill = decodes + chunks, bool(chunks)
        else:
            batch, is_prefill = self._admit(self.max_num_batched_tokens), True
            if not batch:
                batch, is_prefill = self._schedule_decode(), False
        while not batch and self.running and self.sliding:
            # every running sequence is part-way through its prefill and none found a free block
            self._preempt(self.running.pop())
            batch, is_prefill = self._schedule_chunks(self.max_num_batched_tokens), True
        if not batch and self.waiting:
            # Only if every running sequence was preempted this step: their blocks are free now.
            batch, is_prefill = self._schedule_chunks(self.max_num_batched_tokens), True
            if not batch:
                raise RuntimeError(
                    f"scheduler stalled: {len(self.waiting)} waiting, head needs "
                    f"{bm.blocks_needed(self.waiting[0].num_tokens)} blocks, "
                    f"{bm.num_free_blocks}/{bm.num_blocks} free"
                )
        return batch, is_prefill and bool(batch)

    def _head_needs_chunks(self) -> bool:
        """True if sequences are decoding and the next waiting prompt is too long for one step: it
        starts in a mixed step, so the running sequences do not wait for its first chunk."""
        if not (self.chunked_prefill and self.waiting and self.running):
            return False
        head = self.waiting[0]
        return head.num_tokens - len(self.block_manager.match(head)) * self.block_size > self.max_num_batched_tokens

    def _pending_hashes(self) -> set[bytes]:
        """Hashes of the full prompt blocks that running sequences have not computed yet."""
        bm, pending = self.block_manager, set()
        if bm.enable_prefix_caching:
            for s in self.running:
                pending.update(bm.hashes(s)[s.num_cached_tokens // bm.block_size:])
        return pending

    def _schedule_chunks(self, budget: int) -> list[Sequence]:
        """The next chunk of every part-way prefill (in admission order), then new admissions,
        within ``budget`` tokens. With a sliding window a chunk's blocks are taken now, and a chunk is
        cut to the tokens the free blocks hold (none: the sequence waits a step, admissions stop)."""
        batch: list[Sequence] = []
        bm = self.block_manager
        for seq in self.running:
            if budget <= 0:
                break
            if seq.is_prefilling:
                n = min(seq.num_tokens - seq.num_cached_tokens, budget)
                if self.sliding:
                    n = min(n, bm.free_tokens(seq))
                    if n < 1:
                        budget = 0  # the blocks freed later go to the running sequences first
                        break
                bm.grow(seq, n)
                seq.num_new_tokens = n
                budget -= n
                batch.append(seq)
        return batch + self._admit(budget)

    def _admit(self, budget: int) -> list[Sequence]:
        """Admit waiting sequences (FIFO) into ``running`` within ``budget`` new tokens: allocate
        their blocks (sharing their cached prefix; with a sliding window only those of the first
        chunk, cut to the free blocks) and set ``num_new_tokens``. Stops at the first
        that does not fit, and at one whose next uncached block a running sequence is computing
        (it waits a step and then shares that block instead of computing it again)."""
        batch: list[Sequence] = []
        if not self.waiting:
            return batch
        bm = self.block_manager
        pending = self._pending_hashes()
        while self.waiting and len(self.running) + self.room(self.waiting[0]) <= self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            hits = bm.match(seq)
            hashes = bm.hashes(seq) if bm.enable_prefix_caching else []
            if hashes and len(hits) < (seq.num_tokens - 1) // self.block_size and hashes[len(hits)] in pending:
                break  # its next block could be a hit one step later
            new_tokens = seq.num_tokens - len(hits) * self.block_size
            if new_tokens > budget and not self.chunked_prefill:
                break
            n = min(new_tokens, budget)
            if self.sliding:  # its first chunk's blocks only, as many as are free
                n = min(n, bm.fitting_tokens(seq))
                if n < 1:
                    break
            if not bm.can_allocate(seq, n):
                break
            self.waiting.popleft()
            bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            seq.num_new_tokens = n
            budget -= n
            if seq.num_prefix_cached_tokens is None:  # first scheduling: the request's usage
                seq.num_prefix_cached_tokens = min(seq.num_cached_tokens, seq.num_prompt_tokens)
                seq.scheduled_time = time.monotonic()
                self.num_prompt_tokens += seq.num_prompt_tokens
                self.num_cached_prompt_tokens += seq.num_prefix_cached_tokens
            pending.update(hashes[len(hits):])
            self.running.append(seq)
            batch.append(seq)
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        """One new token for every running sequence not part-way through its prefill, in order."""
        batch: list[Sequence] = []
        kept: deque[Sequence] = deque()
        bm = self.block_manager
        while self.running:
            seq = self.running.popleft()
            kept.append(seq)
            if seq.is_prefilling:
                continue
            while not bm.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())  # the most recently admitted
                else:
                    kept.pop()
                    self._preempt(seq)
                    break
            else:
                self.block_copies += bm.may_append(seq)
                seq.num_new_tokens = 1
                batch.append(seq)
        self.running = kept
        return batch

    def reserve(self, seq: Sequence, extra: int) -> bool:
        """Grow the block table of ``seq``, scheduled for a decode, to cover ``extra`` positions more
        (speculative tokens, or the draft model's writes). False (nothing changed) when the blocks are
        not free: speculation never preempts."""
        bm = self.block_manager
        if extra < 1 or seq.num_new_tokens != 1 or not bm.can_append(seq, extra):
            return False
        self.block_copies += bm.may_append(seq, extra)
        return True

    def reserve_proposal(self, seq: Sequence, proposal: list[int]) -> bool:
        """Let ``seq``, scheduled for a decode, verify ``proposal`` (speculative tokens) in the same
        step: its table grows to cover them (:meth:`reserve`) and they join ``num_new_tokens`` and
        ``seq.proposal``. False (nothing changed) when the blocks for them are not free."""
        if not proposal or not self.reserve(seq, len(proposal)):
            return False
        seq.proposal = list(proposal)
        seq.num_new_tokens = 1 + len(proposal)
        return True

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        if seq.spec is not None:  # its blocks are gone: the draft model computes it again
            seq.spec.num_draft_cached_tokens = 0
        seq.num_new_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- results ----------------------------------------------------------------------------
    def is_stop_token(self, seq: Sequence, token_id: int) -> bool:
        """True if ``token_id`` ends ``seq`` with "stop": an EOS id (unless ``params.ignore_eos``)
        or one of ``params.stop_token_ids``. Such a token is kept in ``token_ids``; its text joins the
        output only with ``params.include_stop_str_in_output`` (vLLM's rule)."""
        p = seq.params
        return (token_id in self.eos_token_ids and not p.ignore_eos) or token_id in p.stop_token_ids

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], stopped: list[bool]) -> list[Sequence]:
        """Record the step: a sequence whose prefill is not yet complete (a chunk) advances
        ``num_cached_tokens`` and gets no token; every other one appends its sampled token; the
        blocks the step completed join the prefix cache; those that stop finish: the one place a
        step ends sequences. Sequences finished meanwhile (``finish``) are skipped.

        Args:
            seqs: the step's batch.
            token_ids: the sampled token per sequence (ignored for a chunk).
            stopped: per sequence, whether its text (the detokenizer, after this token) matched
                one of ``params.stop``.

        Finish rules, first that applies: "stop" if :meth:`is_stop_token`; "stop" if
        ``stopped``; "length" if ``max_tokens`` tokens were generated, the sequence reached
        ``max_model_len`` or outgrew the whole KV cache (not with a sliding window and chunked prefill:
        a sequence then needs only its window's blocks).

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
            if not seq.samples:  # a prefill chunk: nothing sampled yet
                seq.num_cached_tokens += seq.num_new_tokens
                self.block_manager.cache_computed(seq)
                continue
            tok = int(tok)
            seq.append_token(tok)
            seq.num_cached_tokens = seq.num_tokens - 1
            self.block_manager.cache_computed(seq)
            if seq.first_token_time is None:
                seq.first_token_time = now
            else:
                seq.itl.append(now - seq.last_token_time)
            seq.last_token_time = now
            p = seq.params
            reason = None
            if self.is_stop_token(seq, tok) or stop_string:
                reason = "stop"
            elif (
                p.max_tokens is not None and seq.num_completion_tokens >= p.max_tokens
                or seq.num_tokens >= self.max_model_len
                or seq.num_tokens > cache_tokens and not self.sliding
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
