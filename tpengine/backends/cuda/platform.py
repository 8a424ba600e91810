"""The CUDA platform (:class:`tpengine.backends.platform.Platform`): the plain torch layers (the
Triton attention backend does the device's own work), a KV budget taken after a warm-up prefill, and
decode steps replayed from CUDA graphs (:class:`tpengine.backends.cuda.graphs.CUDAGraphRunner`)."""

from __future__ import annotations

import torch

from tpengine.backends.platform import Platform
from tpengine.utils import cdiv


class CUDAPlatform(Platform):
    """CUDA: no process set-up or measurement; the KV budget after a warm-up prefill
    (:meth:`kv_budget_bytes`); :meth:`step_runner` captures the decode steps."""

    name = "cuda"

    def kv_budget_bytes(self, config, device: torch.device, warmup) -> float:
        """``config.gpu_memory_utilization`` of the memory free after ``warmup()`` (one eager prefill as
        large as the scheduler may build), less that prefill's activation peak above what stays allocated."""
        torch.cuda.reset_peak_memory_stats(device)
        warmup()
        torch.cuda.synchronize(device)
        stats = torch.cuda.memory_stats(device)
        peak, now = stats.get("allocated_bytes.all.peak", 0), stats.get("allocated_bytes.all.current", 0)
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        return free * config.gpu_memory_utilization - (peak - now)

    def step_runner(self, model: torch.nn.Module, backend, config, hidden_size: int, dtype: torch.dtype,
                    device: torch.device):
        """A :class:`~tpengine.backends.cuda.graphs.CUDAGraphRunner` with every batch-size bucket up to
        ``config.max_num_seqs`` captured, or None under ``config.enforce_eager`` or for an attention
        backend or a layer whose decode syncs with the host (``graph_safe`` False: the backend's, a MoE
        block's grouping of its tokens by expert)."""
        if config.enforce_eager or not backend.graph_safe or not all(
                getattr(m, "graph_safe", True) for m in model.modules()):
            return None
        from tpengine.backends.cuda.graphs import CUDAGraphRunner

        runner = CUDAGraphRunner(model, backend, config.max_num_seqs, cdiv(config.max_model_len, config.block_size),
                                 hidden_size, dtype, device)
        runner.capture()
        return runner


PLATFORM = CUDAPlatform
