"""ModelRunner: this rank's model, its paged KV cache, and the execution of one StepPlan.

Every rank runs :meth:`ModelRunner.execute` on the same plan in lockstep; the LM head runs only
on the positions to sample and its logits are gathered to rank 0.
"""

from __future__ import annotations

import os

import torch

from tpengine.config import EngineConfig
from tpengine.distributed import TPInfo, all_reduce_min
from tpengine.engine.context import Context, set_context
from tpengine.engine.step import StepKind, StepPlan
from tpengine.kernels import get_backend
from tpengine.loader import load_model
from tpengine.surgery import fuse_projections

GIB = 1 << 30


class ModelRunner:
    """Loads this rank's shard of ``config.model`` and allocates its KV cache.

    KV cache: one ``[2, num_layers, num_blocks, block_size, kv_heads_local, head_dim]`` tensor;
    layer ``i``'s attention module gets views ``k_cache``/``v_cache`` of
    ``[num_blocks, block_size, kv_heads_local, head_dim]``. ``num_blocks`` comes from
    ``config.num_kv_blocks`` or ``config.kv_cache_gb`` (GiB per rank) and is agreed by all ranks
    with all_reduce(MIN).

    Raises:
        ValueError: the KV budget holds less than one block per sequence of max_model_len.
    """

    def __init__(self, config: EngineConfig, tp: TPInfo):
        self.config, self.tp = config, tp
        if tp.device.type == "cpu":
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            torch.set_num_threads(config.threads or max(1, (cores or 1) // tp.size))
        self.dtype = getattr(torch, config.dtype)
        self.model, self.plan, self.hf_config = load_model(config.model, tp, self.dtype)
        fuse_projections(self.model)  # one q/k/v and one gate/up GEMM per layer
        self.backend = get_backend(config.attention_backend, tp.device)
        self.attn_modules = [m for m in self.model.modules() if hasattr(m, "tp_q_to_kv")]
        self.num_blocks = all_reduce_min(self._blocks_from_budget())
        rp = self.plan.ranks[tp.rank]
        self.kv_cache = torch.zeros(2, len(self.attn_modules), self.num_blocks, config.block_size,
                                    rp.num_kv_heads, self.plan.head_dim, dtype=self.dtype, device=tp.device)
        for i, m in enumerate(self.attn_modules):
            m.k_cache, m.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def _blocks_from_budget(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        rp, c = self.plan.ranks[self.tp.rank], self.config
        per_block = (2 * len(self.attn_modules) * c.block_size * rp.num_kv_heads * self.plan.head_dim
                     * torch.empty(0, dtype=self.dtype).element_size())
        if self.tp.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.tp.device)
            budget = free * c.gpu_memory_utilization
        else:
            budget = c.kv_cache_gb * GIB
        blocks = int(budget // per_block)
        need = -(-c.max_model_len // c.block_size)
        if blocks < need:
            raise ValueError(f"KV cache budget gives {blocks} blocks of {c.block_size} tokens, fewer than the "
                             f"{need} one max_model_len={c.max_model_len} sequence needs; raise kv_cache_gb "
                             f"(now {c.kv_cache_gb}) or lower max_model_len")
        return blocks

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run one PREFILL or DECODE step. Returns float32 logits ``[B, vocab_size]`` on rank 0
        (one row per sequence, at ``plan.sample_idx``), None on other ranks."""
        dev = self.tp.device
        to = lambda t: None if t is None else t.to(dev, non_blocking=True)  # noqa: E731
        prefill = plan.kind == StepKind.PREFILL
        set_context(Context(is_prefill=prefill, slot_mapping=to(plan.slot_mapping),
                            block_tables=to(plan.block_tables), backend=self.backend,
                            cu_seqlens_q=to(plan.cu_seqlens_q), cu_seqlens_k=to(plan.cu_seqlens_k),
                            context_lens=to(plan.context_lens)))
        try:
            hidden = self.model.model(input_ids=to(plan.input_ids)[None], position_ids=to(plan.positions)[None],
                                      use_cache=False).last_hidden_state[0]
        finally:
            set_context(None)
        logits = self.model.lm_head(hidden.index_select(0, to(plan.sample_idx)))
        return None if logits is None else logits.float()
