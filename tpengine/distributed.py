"""Process groups and the few collectives tpengine uses.

``init_distributed`` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT). Activations travel on the default group (NCCL on CUDA, gloo on CPU), or through
shared memory when :func:`tpengine.backends.cpu.shm.init_shm` installed a :class:`tpengine.backends.cpu.shm.ShmComm` at
start-up (:func:`activation_comm`); the control plane (StepPlan broadcasts, block-count
agreement, the end-of-run memory report) always travels on a separate gloo group. Every group
has the configured timeout, so no rank waits forever in a collective. With world size 1 and no
torchrun environment, no process group is created and every collective is a no-op.

The process-wide state (this rank's :class:`TPInfo`, the control group, the installed
activation comm) is one :class:`_ProcessGroups` object, set by :func:`init_distributed` and
cleared by :func:`shutdown`; nothing changes it per step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tpengine import forensics


@dataclass(frozen=True)
class TPInfo:
    """This process's place in the tensor-parallel group: ``rank`` in ``0..size-1``."""

    rank: int
    size: int
    local_rank: int
    device: torch.device

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


@dataclass
class _ProcessGroups:
    """What :func:`init_distributed` set up: ``tp``; ``control``, the gloo group of the control
    plane (None: the default group is gloo already); ``comm``, the activation collectives
    installed once at start-up (None: torch.distributed's)."""

    tp: TPInfo
    control: Any = None
    comm: Any = None


_STATE: _ProcessGroups | None = None
# The rendezvous store of this process (torchrun's agent store, or the one rank 0 hosts), made by
# the first init_distributed and kept for the process's life, and how many times init_distributed
# made process groups on it: each time under a prefix of its own (see init_distributed).
_STORE: dict[str, Any] = {"store": None, "inits": 0}


def _pick_device(local_rank: int, device: str) -> torch.device:
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} requested but CUDA is not available; use device='cpu'")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(timeout_s: float = 60.0, device: str = "auto") -> TPInfo:
    """Initialise (once) from torchrun's environment and return this rank's :class:`TPInfo`.

    ``timeout_s`` bounds every collective on every group. ``device``: "auto" (CUDA if
    available), "cpu" or "cuda".

    Raises:
        RuntimeError: inconsistent environment (e.g. WORLD_SIZE > 1 without MASTER_ADDR).
    """
    global _STATE
    if _STATE is not None:
        return _STATE.tp
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    dev = _pick_device(local_rank, device)
    if size > 1:
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError(f"WORLD_SIZE={size} but MASTER_ADDR is unset; launch with torchrun")
        # torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when it
        # is first imported (transformers imports it while loading a model). Imported after
        # init_process_group, it would keep the default group alive past destroy_process_group;
        # gloo's worker threads would then outlive it and abort the process ("terminate called
        # without an active exception") when the interpreter finalizes. Import it first.
        import torch.distributed.nn.functional  # noqa: F401

        timeout = timedelta(seconds=timeout_s)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        # A second engine in one process (LLM opened after another was closed) rendezvouses on the
        # same store; the first one's keys (each rank's gloo address) are still there, so a rank
        # could read a peer's old address and time out connecting to it. Every init therefore
        # gets a fresh key prefix; every rank makes the same sequence of inits (SPMD), so the
        # prefixes agree.
        if _STORE["store"] is None:
            _STORE["store"], _, _ = next(dist.rendezvous("env://", rank=rank, world_size=size, timeout=timeout))
        _STORE["inits"] += 1
        store = dist.PrefixStore(f"tpengine/init{_STORE['inits']}", _STORE["store"])
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=size, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    else:
        control = None
    _STATE = _ProcessGroups(TPInfo(rank=rank, size=size, local_rank=local_rank, device=dev), control)
    return _STATE.tp


_SIZE1 = TPInfo(0, 1, 0, torch.device("cpu"))


def get_tp() -> TPInfo:
    """The :class:`TPInfo` set by :func:`init_distributed` (a size-1 CPU info if never called)."""
    return _STATE.tp if _STATE is not None else _SIZE1


def install_activation_comm(comm: Any) -> None:
    """At start-up (after :func:`init_distributed`): route the layers' all-reduce and gather
    through ``comm`` (an object with ``all_reduce(t)`` and ``gather_to_driver(t, dim)``, e.g. a
    :class:`tpengine.backends.cpu.shm.ShmComm`), or back to torch.distributed with None.

    Raises:
        RuntimeError: a comm given before :func:`init_distributed` was called.
    """
    if _STATE is None:
        if comm is None:
            return
        raise RuntimeError("install_activation_comm() before init_distributed()")
    _STATE.comm = comm


def activation_comm() -> Any:
    """The comm installed by :func:`install_activation_comm`, or None (torch.distributed)."""
    return _STATE.comm if _STATE is not None else None


def shutdown() -> None:
    """Wait for every rank (bounded by the group timeout), then destroy the process groups, so
    no rank tears down a connection a peer still uses. Safe to call twice or at size 1."""
    global _STATE
    if dist.is_available() and dist.is_initialized():
        prev = forensics.enter("the shutdown barrier (control group)")
        dist.barrier(group=_control_group())
        forensics.leave(prev)
        dist.destroy_process_group()
    _STATE = None


def _control_group():
    return _STATE.control if _STATE is not None else None


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` in place over all ranks on the default group (torch.distributed, whatever
    comm is installed); no-op at size 1. Returns ``t``."""
    if get_tp().size > 1:
        prev = forensics.enter("all_reduce of the activations (default group)")
        dist.all_reduce(t)
        forensics.leave(prev)  # not on an exception: the report names this collective
    return t


def gather_to_driver(t: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's ``t`` (same shape on all ranks) along ``dim`` on rank 0, on the
    default group (torch.distributed, whatever comm is installed).

    Returns the concatenation on rank 0 and None elsewhere; ``t`` itself at size 1.
    """
    tp = get_tp()
    if tp.size == 1:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(tp.size)] if tp.is_driver else None
    prev = forensics.enter("gather of the logits to rank 0 (default group)")
    dist.gather(t, parts, dst=0)
    forensics.leave(prev)
    return torch.cat(parts, dim=dim) if tp.is_driver else None


def broadcast_control(t: torch.Tensor, what: str = "a broadcast from rank 0") -> torch.Tensor:
    """Broadcast CPU tensor ``t`` from rank 0 in place over the gloo control group; ``what`` names
    it in a forensics report (:mod:`tpengine.forensics`)."""
    if get_tp().size > 1:
        prev = forensics.enter(f"{what} (control group)")
        dist.broadcast(t, src=0, group=_control_group())
        forensics.leave(prev)
    return t


def all_reduce_min(value: int) -> int:
    """The minimum of ``value`` over all ranks (control group); ``value`` at size 1."""
    if get_tp().size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    prev = forensics.enter("all_reduce_min (control group)")
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_control_group())
    forensics.leave(prev)
    return int(t.item())


def gather_control(value: int) -> list[int] | None:
    """Every rank's integer ``value``, in rank order, on rank 0 (None on the others): one gather
    on the gloo control group, bounded by the group timeout. ``[value]`` at size 1."""
    tp = get_tp()
    if tp.size == 1:
        return [value]
    t = torch.tensor([value], dtype=torch.int64)
    parts = [torch.empty_like(t) for _ in range(tp.size)] if tp.is_driver else None
    prev = forensics.enter("gather_control (control group)")
    dist.gather(t, parts, dst=0, group=_control_group())
    forensics.leave(prev)
    return [int(p.item()) for p in parts] if tp.is_driver else None


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` (any picklable object) on every rank: one ``broadcast_object_list`` on the
    gloo control group, bounded by the group timeout (other ranks pass anything, e.g. None, and get
    rank 0's copy). ``obj`` itself at size 1.

    Raises:
        RuntimeError: (torch.distributed's) a rank did not join within the group timeout.
    """
    if get_tp().size == 1:
        return obj
    box = [obj if get_tp().is_driver else None]
    prev = forensics.enter("broadcast_object (control group)")
    dist.broadcast_object_list(box, src=0, group=_control_group())
    forensics.leave(prev)
    return box[0]
