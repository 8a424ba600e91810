"""The activation collectives of the parallel layers: all-reduce and gather-to-rank-0.

They go through the comm installed at start-up (:func:`tpengine.distributed.activation_comm`:
shared memory, see :mod:`tpengine.backends.cpu.shm`) when there is one, else torch.distributed's (gloo on
CPU, NCCL on CUDA).
"""

from __future__ import annotations

import torch

from tpengine import distributed as dist
from tpengine import forensics


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` in place over all ranks; no-op at size 1. Returns ``t``."""
    comm = dist.activation_comm()
    if comm is None:
        return dist.all_reduce(t)
    prev = forensics.enter("all_reduce of the activations (shared memory)")
    out = comm.all_reduce(t)
    forensics.leave(prev)  # not on an exception: the report names this collective
    return out


def gather_to_driver(t: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's ``t`` along ``dim`` on rank 0 (None elsewhere); ``t`` at size 1."""
    comm = dist.activation_comm()
    if comm is None:
        return dist.gather_to_driver(t, dim)
    prev = forensics.enter("gather of the logits to rank 0 (shared memory)")
    out = comm.gather_to_driver(t, dim)
    forensics.leave(prev)
    return out
