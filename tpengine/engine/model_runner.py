"""ModelRunner: this rank's model, its paged KV cache, and the execution of one StepPlan.

Every rank runs :meth:`ModelRunner.execute` on the same plan in lockstep; the LM head runs only
on the positions to sample and its logits are gathered to rank 0. With pipeline stages each rank runs
its stage's layers: it receives the hidden states from the rank of its TP rank in the stage before,
sends its own to the one in the stage after, and the last stage's TP rank 0 sends the step's result
(token ids or logits rows) to the driver.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from tpengine.backends import get_backend, get_platform, kv_quant
from tpengine.config import EngineConfig
from tpengine.context import Context
from tpengine.distributed import TPInfo, all_reduce_min, broadcast_control, pp_irecv, pp_isend, pp_wait
from tpengine.engine.pooling import pool_rows
from tpengine.engine.step import StepKind, StepPlan, split_plan
from tpengine.errors import UserError
from tpengine.model.loader import ExecutionProfile, load_model
from tpengine.model.spec import ModelSpec
from tpengine.utils import GIB, cdiv


class ModelRunner:
    """Loads this rank's shard of ``config.model`` and allocates its KV cache.

    KV cache: one ``[2, num_layers, num_blocks, block_size, kv_heads_local, head_dim]`` tensor;
    layer ``i``'s attention module gets views ``k_cache``/``v_cache`` of
    ``[num_blocks, block_size, kv_heads_local, head_dim]``, in the model's dtype or, with
    ``config.kv_cache_dtype`` "int8", int8 codes beside ``kv_scales`` (``[2, num_layers, num_blocks,
    block_size, kv_heads_local]`` float32; each layer's ``kv_scales`` views; :mod:`tpengine.backends.kv_quant`),
    copied with their blocks. ``num_blocks`` comes from
    ``config.num_kv_blocks`` or ``config.kv_cache_gb`` (GiB per rank; on CUDA
    ``gpu_memory_utilization`` x free memory after a warm-up prefill, less its activation peak)
    and is agreed by all ranks with all_reduce(MIN). The device's platform
    (:func:`tpengine.backends.get_platform`) loads and binds the model with it, measures the attention
    backend's choices into the same profile, and may give a step runner that replays decode steps
    (:meth:`tpengine.backends.platform.Platform.step_runner`: on CUDA with the Triton backend and not
    ``enforce_eager``, CUDA graphs).

    Raises:
        tpengine.errors.UserError: the KV budget holds fewer blocks than one sequence of
            max_model_len needs.
    """

    def __init__(self, config: EngineConfig, tp: TPInfo, spec: ModelSpec | None = None):
        self.config, self.tp = config, tp
        self.dtype = config.torch_dtype(tp.device)
        self.kv_dtype = kv_quant.cache_dtype(config.kv_cache_dtype, self.dtype)  # the KV cache's storage
        self.platform = get_platform(tp.device)
        loaded = load_model(spec or config.model, tp, self.dtype, cpu_kernels=config.cpu_kernels,
                            quantization=config.quantization, cpu_linear=config.cpu_linear)
        self.platform.release_free_memory()  # loading's staging buffers and replaced weight layouts
        if config.cpu_huge_pages:  # after the trim: a trim inside a huge page would split it
            self.platform.weights_to_huge_pages(loaded.module)
        self.model, self.shard_plan, self.hf_config = loaded.module, loaded.shard_plan, loaded.hf_config
        self.weight_bytes: int = loaded.weight_bytes
        self.profile: ExecutionProfile = loaded.profile
        self.backend = get_backend(config.attention_backend, tp.device, cpu_kernels=config.cpu_kernels,
                                   kv_mirror=config.kv_mirror)
        stack = self.model.model
        if config.max_model_len is not None:  # no position reaches max_model_len (+ a pooling step's one, + k drafts)
            spec = config.speculative_config
            stack.rope_table_len = config.max_model_len + 1 + (spec.num_speculative_tokens if spec else 0)
            stack.build_rope_tables(self.dtype, tp.device)
        self.attn_modules = [layer.self_attn for layer in stack.layers[: stack.config.num_hidden_layers]]
        self._kv_window = self._model_window()  # (every stage's layers)
        if tp.rank == 0 and tp.is_last_stage:  # (the stage that holds the LM head)
            head = self.model.lm_head  # a head held in another layout has no plain weight: its shape from its rows
            line = self.profile.describe(self.dtype, tuple(head.weight.shape) if head.weight is not None
                                         else (head.vocab_end - head.vocab_start, self.shard_plan.hidden_size))
            if line is not None:
                print(line, file=sys.stderr, flush=True)
        self.graphs = None  # the platform's step runner (CUDA graphs), once the cache is bound
        self.num_blocks = all_reduce_min(self._blocks_from_budget())
        rp = self.shard_plan.ranks[tp.rank]
        shape = (2, len(self.attn_modules), self.num_blocks, config.block_size, rp.num_kv_heads,
                 self.shard_plan.head_dim)
        try:
            self.kv_cache = self.platform.allocate_kv_cache(shape, self.kv_dtype, tp.device)
            # int8: a float32 scale per cached head row, [2, layers, blocks, block_size, kv_heads] (kv_quant)
            self.kv_scales = (None if self.kv_dtype == self.dtype else
                              self.platform.allocate_kv_cache(shape[:-1], kv_quant.SCALE_DTYPE, tp.device))
        except (MemoryError, torch.OutOfMemoryError) as e:  # the budget is the user's setting
            raise UserError(f"cannot allocate the KV cache ({self.num_blocks} blocks of {config.block_size} "
                            f"tokens) on rank {tp.rank}: {e}; lower --kv-cache-gb (now {config.kv_cache_gb}) or "
                            "--num-kv-blocks") from None
        for i, m in enumerate(self.attn_modules):
            m.k_cache, m.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            m.kv_scales = None if self.kv_scales is None else (self.kv_scales[0, i], self.kv_scales[1, i])
            m.kv_scales_dtype = self.dtype
        # the platform's measured choices for the backend (CPU: the paged kernel's path), kept in the one
        # profile, then the backend's per-layer state and the kernel calls it binds into the layers
        self.profile = self.platform.bind_attention(self.backend, stack, self.profile)
        self.backend.bind_model(stack, tp.size)
        if not config.pooling and getattr(self.model, "lm_head", None) is not None:
            self.backend.bind_head(self.model.lm_head, tp.size)  # (a greedy step's head in the bound step)
        line = self.backend.describe()
        if tp.is_driver and line is not None:
            print("tpengine: " + line, file=sys.stderr, flush=True)
        if tp.pp_size == 1:  # (a pipeline stage's step is not one replayable forward)
            self.graphs = self.platform.step_runner(self.model, self.backend, config, self.shard_plan.hidden_size,
                                                    self.dtype, tp.device)

    @property
    def kv_window(self) -> int | None:
        """The sliding window (tokens) the KV blocks of a sequence must cover: the largest
        ``sliding_window`` among the attention layers when every one of them slides (Mistral with a
        window, Phi-3, Qwen2 with ``use_sliding_window`` on every layer), else None (a full-attention
        layer: Gemma 2 and 3, OLMo 3 keep every block). The one place the engine reads it from."""
        return self._kv_window

    def _model_window(self) -> int | None:
        """:attr:`kv_window` over every layer of the model: with pipeline stages each holds some layers, so
        the stages agree on it (two minimums on the control group: whether any layer keeps every block,
        and the largest window)."""
        windows = [m.sliding_window for m in self.attn_modules]
        mine = None if not windows or None in windows else max(windows)
        if self.tp.pp_size == 1:
            return mine
        if all_reduce_min(0 if mine is None else 1) == 0:
            return None
        return -all_reduce_min(-mine)

    def ready_line(self, seconds: float) -> str:
        """The one line rank 0 prints when the engine is ready: model, dtype, tp, this rank's weight
        and KV-cache GiB, KV blocks, and ``seconds`` since the engine started."""
        kv_gib = self.kv_cache_bytes / GIB
        kv_kind = "" if self.config.kv_cache_dtype == "auto" else f"{self.config.kv_cache_dtype} "
        return (f"tpengine: model ready: {self.config.model} {str(self.dtype).removeprefix('torch.')} "
                f"{f'pp={self.tp.pp_size} ' if self.tp.pp_size > 1 else ''}tp={self.tp.size}, weights "
                f"{self.weight_bytes / GIB:.2f} GiB/rank, {kv_kind}KV cache {self.num_blocks} "
                f"blocks ({kv_gib:.2f} GiB/rank, {self.kv_bytes_per_token} B/token), {seconds:.1f} s")

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's KV cache: the cache and, for an int8 cache, its scales."""
        return sum(t.numel() * t.element_size() for t in (self.kv_cache, self.kv_scales) if t is not None)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token takes on this rank (every layer's keys and values, scales included)."""
        return self.kv_cache_bytes // (self.num_blocks * self.config.block_size)

    def _warmup(self) -> None:
        """One eager prefill as large as the scheduler may build (max_num_batched_tokens tokens
        in sequences of max_model_len, at most max_num_seqs), storing nothing (slot -1) into a
        one-block stand-in cache, so the KV budget can leave room for its activation peak (run by the
        platform's :meth:`~tpengine.backends.platform.Platform.kv_budget_bytes` where the device needs it)."""
        c, rp, dev = self.config, self.shard_plan.ranks[self.tp.rank], self.tp.device
        stand_in = torch.zeros(1, c.block_size, rp.num_kv_heads, self.shard_plan.head_dim, dtype=self.kv_dtype,
                               device=dev)
        scales = torch.zeros(stand_in.shape[:-1], dtype=kv_quant.SCALE_DTYPE, device=dev)
        for m in self.attn_modules:
            m.k_cache = m.v_cache = stand_in
            m.kv_scales = None if self.kv_dtype == self.dtype else (scales, scales)
        total = min(c.max_num_batched_tokens, c.max_num_seqs * c.max_model_len)
        lens = [min(c.max_model_len, total - s) for s in range(0, total, c.max_model_len)]
        cu = torch.tensor([0, *lens]).cumsum(0)
        n = int(cu[-1])
        self.execute(StepPlan(StepKind.PREFILL, input_ids=torch.zeros(n, dtype=torch.int64),
                              positions=torch.cat([torch.arange(x) for x in lens]),
                              slot_mapping=torch.full((n,), -1), block_tables=torch.full((len(lens), 1), -1),
                              cu_seqlens_q=cu, cu_seqlens_k=cu, context_lens=torch.tensor(lens),
                              sample_idx=cu[1:] - 1))

    def _blocks_from_budget(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        rp, c = self.shard_plan.ranks[self.tp.rank], self.config
        per_block = c.block_size * kv_quant.bytes_per_token(len(self.attn_modules), rp.num_kv_heads,
                                                            self.shard_plan.head_dim, self.dtype.itemsize,
                                                            c.kv_cache_dtype)
        budget = self.platform.kv_budget_bytes(c, self.tp.device, self._warmup)
        blocks = int(budget // per_block)
        need = cdiv(c.max_model_len, c.block_size)
        drafts = c.speculative_config is not None and c.speculative_config.method == "draft_model"
        if (w := self.kv_window) is not None and c.enable_chunked_prefill and not drafts:
            # vLLM's SlidingWindowSpec: the window before a step's first token and the step's tokens (a
            # draft model reads the same tables from behind: then nothing is freed, LLMEngine._driver_init)
            need = min(need, cdiv(min(w - 1 + c.max_num_batched_tokens, c.max_model_len), c.block_size) + 1)
        if blocks < need:
            raise UserError(f"KV cache budget gives {blocks} blocks of {c.block_size} tokens, fewer than the "
                             f"{need} one max_model_len={c.max_model_len} sequence needs; raise kv_cache_gb "
                             f"(now {c.kv_cache_gb}) or lower max_model_len")
        return blocks

    def copy_blocks(self, copies: torch.Tensor) -> None:
        """Copy the K/V of every layer from physical block ``copies[i, 0]`` to ``copies[i, 1]``
        (``[C, 2]`` int64; copy-on-write of a shared partial block), and tell the backend that the
        cache changed outside a step (CPU: the KV mirrors are rebuilt)."""
        src, dst = copies[:, 0].to(self.tp.device), copies[:, 1].to(self.tp.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        if self.kv_scales is not None:  # an int8 cache's scales live and die with their blocks
            self.kv_scales[:, :, dst] = self.kv_scales[:, :, src]
        self.backend.cache_changed()

    @torch.inference_mode()
    def execute(self, plan: StepPlan, grammar_mask: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Run one PREFILL or DECODE step, after the plan's block copies. A pooling engine
        (``config.pooling``) skips the LM head: rank 0 gets each sequence's pooled row, float32
        ``[B, hidden]`` (:meth:`_pool`). Otherwise returns float32 logits
        ``[B + P + S, vocab_size]`` on rank 0 (one row per sequence, at ``plan.sample_idx``, then one
        per ``plan.prompt_idx`` entry, then one per ``plan.spec_idx`` entry) or, for a ``plan.greedy``
        step, the argmax token ids ``[B + S]`` (int64, without gathering the logits); None on other ranks.
        ``grammar_mask`` (rank 0, for a ``plan.grammar_mask`` step): returns the step's token bitmask
        (int32 ``[B, ceil(V / 32)]``), called once the forward reaches the LM head."""
        if plan.block_copies is not None and plan.block_copies.numel():
            self.copy_blocks(plan.block_copies)
        if self.tp.pp_size > 1:
            return self._execute_stage(plan, grammar_mask)
        if (self.graphs is not None and plan.kind == StepKind.DECODE
                and self.graphs.can_run(plan.num_seqs, plan.block_tables.shape[1])):  # CUDA decode: replay a graph
            hidden = self.graphs.run(plan.input_ids, plan.positions, plan.slot_mapping, plan.context_lens,
                                     plan.block_tables)  # [B, hidden]: one token per sequence
            return self._pool(hidden, plan) if self.config.pooling else self._head(hidden, plan, grammar_mask)
        dev = self.tp.device
        # the plan's tensors are host tensors: on a CPU rank they are used as they are (a batch-1 decode step's
        # Python runs cold after the decode program, where each call costs several times its warm figure)
        to = (lambda t: t) if dev.type == "cpu" else lambda t: None if t is None else t.to(dev, non_blocking=True)  # noqa: E731
        ctx = Context.build(self.backend, plan.kind == StepKind.PREFILL, to(plan.slot_mapping), to(plan.block_tables),
                            to(plan.cu_seqlens_q), to(plan.cu_seqlens_k), to(plan.context_lens))
        # a greedy decode step at one rank: the backend's bound step may pick the tokens with the head (ctx.ids)
        ctx.greedy = plan.greedy and not plan.grammar_mask and plan.kind == StepKind.DECODE and self.tp.size == 1
        hidden = self.model.model(to(plan.input_ids), to(plan.positions), ctx)  # [N, hidden]
        if ctx.ids is not None:
            return ctx.ids
        if self.config.pooling:
            return self._pool(hidden, plan)
        extra = [t for t in (plan.prompt_idx, plan.spec_idx) if t is not None and t.numel()]
        if not extra and hidden.shape[0] == plan.sample_idx.numel():  # one token a sequence: every row, in order
            return self._head(hidden, plan, grammar_mask)
        rows = torch.cat([plan.sample_idx, *extra]) if extra else plan.sample_idx
        return self._head(hidden.index_select(0, to(rows)), plan, grammar_mask)

    def _execute_stage(self, plan: StepPlan, grammar_mask: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
        """One step of this pipeline stage (:meth:`execute`'s result on the driver, None elsewhere), over up
        to ``pp_size`` micro-batches of the plan's sequences (:func:`tpengine.engine.step.split_plan`), so the
        stages overlap (stage s runs micro-batch m while stage s + 1 runs m - 1): a masked greedy step's
        bitmask broadcast first (every rank of the replica takes part); per micro-batch the hidden states
        ``(h, delta)`` ``[N_m, hidden]`` each received from the stage before (not on the first), this stage's
        layers, and sent to the stage after, or on the last stage the LM head, whose result its TP rank 0
        sends to the driver (int64 ids ``[R_m]`` for a greedy plan, else float32 logits ``[R_m, vocab_size]``);
        the driver posts its receives first and puts the rows in the plan's order. Sends do not wait for the
        receiver (no stage blocks the one before); every transfer is waited for, bounded by
        ``dist_timeout_s`` and named (step, micro-batch, stages, ranks) in a forensics report."""
        tp, dev = self.tp, self.tp.device
        mask = self._bitmask(plan, grammar_mask, dev) if plan.greedy and plan.grammar_mask else None
        parts = split_plan(plan, tp.pp_size)
        results = self._post_result_receives(plan, parts) if tp.is_driver else []
        sends, s = [], tp.pp_rank
        for m, (sub, rows) in enumerate(parts):
            what = f"pipeline step {plan.step} micro-batch {m}"
            to = lambda t: None if t is None else t.to(dev, non_blocking=True)  # noqa: E731
            ctx = Context.build(self.backend, sub.kind == StepKind.PREFILL, to(sub.slot_mapping),
                                to(sub.block_tables), to(sub.cu_seqlens_q), to(sub.cu_seqlens_k), to(sub.context_lens))
            inter = None
            if not tp.is_first_stage:
                n, src = sub.input_ids.shape[0], tp.stage_peer(s - 1)
                inter = tuple(torch.empty(n, self.shard_plan.hidden_size, dtype=self.dtype, device=dev) for _ in "hd")
                for i, t in enumerate(inter):
                    pp_wait(pp_irecv(t, src, 2 * m + i), f"{what}: hidden states, stage {s - 1} -> {s}: receive from "
                            f"rank {src}", receiving=True)
            out = self.model.model(to(sub.input_ids), to(sub.positions), ctx, inter)
            if not tp.is_last_stage:
                dst = tp.stage_peer(s + 1)
                sends += [(pp_isend(t, dst, 2 * m + i), f"{what}: hidden states, stage {s} -> {s + 1}: send to "
                           f"rank {dst}") for i, t in enumerate(out)]
                continue
            sub_rows = torch.cat([sub.sample_idx, sub.prompt_idx, sub.spec_idx])
            result = self._head(out.index_select(0, to(sub_rows)), sub,
                                mask=None if mask is None else mask[rows[: sub.num_seqs]])
            if tp.rank == 0:
                sends.append((pp_isend(result, tp.driver_rank, 2 * len(parts) + m),
                              f"{what}: the result, stage {s} -> the driver (rank {tp.driver_rank})"))
        for (work, _), what in sends:
            pp_wait(work, what)
        if not tp.is_driver:
            return None
        whole = None
        for m, (work, t, rows) in enumerate(results):
            pp_wait(work, f"pipeline step {plan.step} micro-batch {m}: the result, stage {tp.pp_size - 1} -> the "
                    "driver", receiving=True)
            if whole is None:
                rows_total = sum(r.numel() for _, _, r in results)
                whole = t.new_empty((rows_total, *t.shape[1:]))
            whole[rows.to(dev)] = t
        return whole

    def _post_result_receives(self, plan: StepPlan, parts: list) -> list[tuple]:
        """The driver, before its stage runs: one receive per micro-batch of ``parts`` for the last stage's
        result (ids ``[R_m]`` or logits ``[R_m, vocab_size]``), ``(work, tensor, its rows in the plan's
        result)`` each."""
        src = self.tp.stage_peer(self.tp.pp_size - 1) - self.tp.rank
        out = []
        for m, (_, rows) in enumerate(parts):
            shape = (rows.numel(),) if plan.greedy else (rows.numel(), self.shard_plan.vocab_size)
            t = torch.empty(shape, dtype=torch.int64 if plan.greedy else torch.float32, device=self.tp.device)
            out.append((pp_irecv(t, src, 2 * len(parts) + m), t, rows))
        return out

    def _bitmask(self, plan: StepPlan, grammar_mask: Callable[[], torch.Tensor] | None, device) -> torch.Tensor:
        """A masked greedy step's token bitmask (int32 ``[B, ceil(V / 32)]``), the driver's broadcast on the
        control group to every rank."""
        words = (self.shard_plan.vocab_size + 31) // 32
        mask = grammar_mask() if self.tp.is_driver else torch.empty(plan.num_seqs, words, dtype=torch.int32)
        return broadcast_control(mask, "the token bitmask broadcast").to(device)

    def _pool(self, hidden: torch.Tensor, plan: StepPlan) -> torch.Tensor | None:
        """A pooling engine's step (no LM head): rank 0's pooled rows ``[B, hidden]`` float32
        (:func:`tpengine.engine.pooling.pool_rows` of the final norm's output, which every rank holds
        whole); None on other ranks, which have nothing more to do."""
        if not self.tp.is_driver:
            return None
        return pool_rows(hidden, plan, self.config.pooler.pooling_type)

    def _head(self, hidden: torch.Tensor, plan: StepPlan, grammar_mask: Callable[[], torch.Tensor] | None = None,
              mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """The LM head on ``[B, hidden]``: TP rank 0 gets float32 logits, or the argmax ids for a greedy
        plan (a masked one's bitmask broadcast from the driver first, on the control group, unless
        ``mask`` is that bitmask already)."""
        if plan.greedy:
            if plan.grammar_mask:
                if mask is None:
                    mask = self._bitmask(plan, grammar_mask, hidden.device)
                words = mask.shape[1]
                if hidden.shape[0] > mask.shape[0]:  # speculative rows: never constrained (all bits set)
                    mask = torch.cat([mask, mask.new_full((hidden.shape[0] - mask.shape[0], words), -1)])
            return self.model.lm_head.greedy(hidden, mask)
        logits = self.model.lm_head(hidden)
        return None if logits is None else logits.float()
