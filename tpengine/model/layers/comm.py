"""The activation collectives of the parallel layers: all-reduce and gather-to-rank-0.

They go through the comm installed at start-up (:func:`tpengine.distributed.activation_comm`:
shared memory, see :mod:`tpengine.backends.cpu.shm`) when there is one, else torch.distributed's (gloo on
CPU, NCCL on CUDA).
"""

from __future__ import annotations

import torch

from tpengine import distributed as dist
from tpengine.backends.cpu import cpu_fused


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` in place over all ranks; no-op at size 1. Returns ``t``."""
    comm = dist.activation_comm()
    return comm.all_reduce(t) if comm is not None else dist.all_reduce(t)


def all_reduce_add_rms_norm(t: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                            native: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + all_reduce(t), weight * rms_norm(h + all_reduce(t)))``: a row-parallel layer's partial
    output ``t`` summed over the ranks, then the residual add and RMSNorm of
    :func:`tpengine.backends.cpu.cpu_fused.add_rms_norm` (``native``: its C kernel). Through the
    shared-memory comm in one C call where it takes the tensors (``ShmComm.all_reduce_add_rms_norm``:
    one pass over the ranks' slots instead of a sum written and read again), else the two steps;
    the results are the same. Shapes: ``t``, ``h [rows, n]``, ``weight [n]``. ``t`` may be written."""
    comm = dist.activation_comm()
    if native and comm is not None and hasattr(comm, "all_reduce_add_rms_norm"):
        out = comm.all_reduce_add_rms_norm(t, h, weight, eps)
        if out is not None:
            return out
    return cpu_fused.add_rms_norm(h, all_reduce(t), weight, eps, native)


def gather_to_driver(t: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's ``t`` along ``dim`` on rank 0 (None elsewhere); ``t`` at size 1."""
    comm = dist.activation_comm()
    return comm.gather_to_driver(t, dim) if comm is not None else dist.gather_to_driver(t, dim)
