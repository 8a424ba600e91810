"""Process groups and the few collectives tpengine uses.

``init_distributed`` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT). The world is ``dp_size`` data-parallel replicas of ``pp_size`` pipeline stages of ``size``
ranks each (world size = dp_size x pp_size x size); replica ``d``'s stage ``s`` is the TP group of
the consecutive global ranks ``(d*pp_size + s)*size ..`` ``+ size - 1``, so a TP group stays on one
host where it can. With one stage a replica is its TP group. With several, the replica's control plane
spans all its stages (rank 0 of stage 0 is its driver), each stage has its own data group, and the
hidden states go point to point (:func:`pp_send`, :func:`pp_recv`) from each rank to the rank of the
same TP rank in the next stage, on a group of their own. Within a TP group, activations
travel on its data group (NCCL on CUDA, gloo on CPU), or through shared memory when
:func:`tpengine.backends.cpu.shm.init_shm` installed a :class:`tpengine.backends.cpu.shm.ShmComm` at
start-up (:func:`activation_comm`); its control plane (StepPlan broadcasts, block-count agreement)
always travels on a gloo group. The replicas' drivers (TP rank 0 of each) share one more gloo
group, the data-parallel group (:func:`dp_broadcast_object`, :func:`dp_gather_object`), and the
whole world one gloo group for what every rank takes part in (the end-of-run memory report, the
``LLM`` API's outputs, the shutdown barrier). Every group has the configured timeout, so no rank
waits forever in a collective. With world size 1 and no torchrun environment, no process group is
created and every collective is a no-op.

The process-wide state (this rank's :class:`TPInfo`, the groups, the installed activation comm) is
one :class:`_ProcessGroups` object, set by :func:`init_distributed` and cleared by
:func:`shutdown`; nothing changes it per step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tpengine import forensics


@dataclass(frozen=True)
class TPInfo:
    """This process's place in the launch: ``rank`` in ``0..size-1`` within its tensor-parallel
    group, which is pipeline stage ``pp_rank`` of ``pp_size`` of replica ``dp_rank`` of ``dp_size``;
    ``local_rank`` torchrun's (the CUDA device)."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def is_driver(self) -> bool:
        """TP rank 0 of the first stage: the replica's driver (its scheduler, sampler and detokenizer)."""
        return self.rank == 0 and self.pp_rank == 0

    @property
    def engine_size(self) -> int:
        """The ranks of one replica (its control plane): ``pp_size * size``."""
        return self.pp_size * self.size

    @property
    def engine_rank(self) -> int:
        """The rank within the replica: ``pp_rank * size + rank`` (0: the driver)."""
        return self.pp_rank * self.size + self.rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def global_rank(self) -> int:
        """The rank in the world (torchrun's RANK): ``dp_rank * engine_size + engine_rank``."""
        return self.dp_rank * self.engine_size + self.engine_rank

    def stage_peer(self, stage: int) -> int:
        """The global rank of this TP rank in stage ``stage`` of this replica."""
        return (self.dp_rank * self.pp_size + stage) * self.size + self.rank

    @property
    def driver_rank(self) -> int:
        """The global rank of this replica's driver."""
        return self.dp_rank * self.engine_size

    @property
    def world_size(self) -> int:
        """``dp_size * pp_size * size``."""
        return self.dp_size * self.engine_size

    @property
    def is_front(self) -> bool:
        """Global rank 0: the launch's front (the request file, the HTTP server, the ``LLM`` calls)."""
        return self.global_rank == 0


@dataclass
class _ProcessGroups:
    """What :func:`init_distributed` set up: ``tp``; ``data``, the TP group's activation group (None:
    the default group, the world, when there is one replica); ``control``, the TP group's gloo group
    of the control plane (None: ``data``, which is gloo already); ``world``, a gloo group of every rank
    (None: the default group, gloo already); ``dp``, the gloo group of the replicas' drivers (None
    with one replica, and on the other ranks); ``comm``, the activation collectives installed once at
    start-up (None: torch.distributed's)."""

    tp: TPInfo
    data: Any = None
    control: Any = None
    world: Any = None
    dp: Any = None
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


def init_distributed(timeout_s: float = 60.0, device: str = "auto", tp_size: int | None = None,
                     dp_size: int = 1, pp_size: int = 1) -> TPInfo:
    """Initialise (once) from torchrun's environment and return this rank's :class:`TPInfo`.

    ``timeout_s`` bounds every collective on every group. ``device``: "auto" (CUDA if
    available), "cpu" or "cuda". ``dp_size`` replicas of ``pp_size`` stages of ``tp_size`` ranks
    (default: the world size / (``dp_size`` x ``pp_size``)).

    Raises:
        RuntimeError: inconsistent environment (e.g. WORLD_SIZE > 1 without MASTER_ADDR).
        tpengine.errors.UserError: a world size that is not ``dp_size x pp_size x tp_size``.
    """
    global _STATE
    if _STATE is not None:
        return _STATE.tp
    from tpengine.config import parallel_sizes

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    dp_size, tp_size = parallel_sizes(world, dp_size, tp_size, pp_size)
    dev = _pick_device(local_rank, device)
    groups = _ProcessGroups(TPInfo(rank=rank % tp_size, size=tp_size, local_rank=local_rank, device=dev,
                                   dp_rank=rank // (tp_size * pp_size), dp_size=dp_size,
                                   pp_rank=rank // tp_size % pp_size, pp_size=pp_size))
    if world > 1:
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError(f"WORLD_SIZE={world} but MASTER_ADDR is unset; launch with torchrun")
        _make_groups(groups, rank, world, timedelta(seconds=timeout_s), "nccl" if dev.type == "cuda" else "gloo")
    _STATE = groups
    return _STATE.tp


def _make_groups(groups: _ProcessGroups, rank: int, world: int, timeout: timedelta, backend: str) -> None:
    """The process groups of :func:`init_distributed` (the default one on a fresh store prefix, then
    one data group per TP group, one gloo control group per replica, the drivers' data-parallel group
    and the pipeline's point-to-point group), set on ``groups``."""
    # torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when it
    # is first imported (transformers imports it while loading a model). Imported after
    # init_process_group, it would keep the default group alive past destroy_process_group;
    # gloo's worker threads would then outlive it and abort the process ("terminate called
    # without an active exception") when the interpreter finalizes. Import it first.
    import torch.distributed.nn.functional  # noqa: F401

    tp_size, pp_size, dp_size = groups.tp.size, groups.tp.pp_size, groups.tp.dp_size
    # A second engine in one process (LLM opened after another was closed) rendezvouses on the
    # same store; the first one's keys (each rank's gloo address) are still there, so a rank
    # could read a peer's old address and time out connecting to it. Every init therefore
    # gets a fresh key prefix; every rank makes the same sequence of inits (SPMD), so the
    # prefixes agree.
    if _STORE["store"] is None:
        _STORE["store"], _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    _STORE["inits"] += 1
    store = dist.PrefixStore(f"tpengine/init{_STORE['inits']}", _STORE["store"])
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
    if backend != "gloo":
        groups.world = dist.new_group(backend="gloo", timeout=timeout)
    engine = tp_size * pp_size
    if dp_size > 1 or pp_size > 1:
        # every rank creates every group, in the same order (torch.distributed's rule)
        for g0 in range(0, world, tp_size):  # each TP group: its activations
            ranks = list(range(g0, g0 + tp_size))
            g = dist.new_group(ranks, timeout=timeout, backend=backend)
            if rank in ranks:
                groups.data = g
        for e0 in range(0, world, engine):  # each replica: its control plane (all its stages)
            ranks = list(range(e0, e0 + engine))
            if pp_size == 1 and backend == "gloo":  # the TP group's data group is gloo already
                continue
            g = dist.new_group(ranks, timeout=timeout, backend="gloo")
            if rank in ranks:
                groups.control = g
        if dp_size > 1:
            g = dist.new_group(list(range(0, world, engine)), timeout=timeout, backend="gloo")
            groups.dp = g if rank % engine == 0 else None
        if pp_size > 1:  # the stages' transfers, apart from every collective
            groups.p2p = dist.new_group(timeout=timeout, backend=backend)
    elif backend != "gloo":
        groups.control = groups.world


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
    no rank tears down a connection a peer still uses; and, at this process's exit, end a rank
    of this host that was stopped after this barrier
    (:func:`tpengine.forensics.end_stopped_ranks_at_exit`). Safe to call twice or at size 1."""
    global _STATE
    if dist.is_available() and dist.is_initialized():
        prev = forensics.enter("the shutdown barrier (world)")
        dist.barrier(group=_world_group())
        forensics.leave(prev)
        dist.destroy_process_group()
        forensics.end_stopped_ranks_at_exit()
    _STATE = None


def _data_group():
    return _STATE.data if _STATE is not None else None


def _control_group():
    if _STATE is None:
        return None
    return _STATE.control if _STATE.control is not None else _STATE.data


def _world_group():
    return _STATE.world if _STATE is not None else None


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` in place over the TP group's ranks on its data group (torch.distributed, whatever
    comm is installed); no-op at size 1. Returns ``t``."""
    if get_tp().size > 1:
        prev = forensics.enter("all_reduce of the activations (TP data group)")
        dist.all_reduce(t, group=_data_group())
        forensics.leave(prev)  # not on an exception: the report names this collective
    return t


def gather_to_driver(t: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every TP rank's ``t`` (same shape on all ranks) along ``dim`` on TP rank 0 (of
    this stage), on the TP data group (torch.distributed, whatever comm is installed).

    Returns the concatenation on rank 0 and None elsewhere; ``t`` itself at size 1.
    """
    tp = get_tp()
    if tp.size == 1:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(tp.size)] if tp.rank == 0 else None
    prev = forensics.enter("gather of the logits to rank 0 (TP data group)")
    dist.gather(t, parts, group=_data_group(), group_dst=0)
    forensics.leave(prev)
    return torch.cat(parts, dim=dim) if tp.rank == 0 else None


def broadcast_control(t: torch.Tensor, what: str = "a broadcast from rank 0") -> torch.Tensor:
    """Broadcast CPU tensor ``t`` from the driver in place over the replica's gloo control group (every
    rank of its TP group, or of all its pipeline stages); ``what`` names it in a forensics report
    (:mod:`tpengine.forensics`)."""
    if get_tp().engine_size > 1:
        prev = forensics.enter(f"{what} (control group)")
        dist.broadcast(t, group=_control_group(), group_src=0)
        forensics.leave(prev)
    return t


def all_reduce_min(value: int) -> int:
    """The minimum of ``value`` over the replica's ranks (control group); ``value`` at size 1."""
    if get_tp().engine_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    prev = forensics.enter("all_reduce_min (control group)")
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_control_group())
    forensics.leave(prev)
    return int(t.item())


def gather_control(value: int, world: bool = False) -> list[int] | None:
    """Every rank's integer ``value``, in rank order, on rank 0 (None on the others): one gather on
    the replica's gloo control group (its ranks in :attr:`TPInfo.engine_rank` order), or with ``world``
    on the world's gloo group (global ranks), bounded by the group timeout. ``[value]`` at size 1."""
    tp = get_tp()
    n, me, group = ((tp.world_size, tp.global_rank, _world_group()) if world
                    else (tp.engine_size, tp.engine_rank, _control_group()))
    if n == 1:
        return [value]
    t = torch.tensor([value], dtype=torch.int64)
    parts = [torch.empty_like(t) for _ in range(n)] if me == 0 else None
    prev = forensics.enter(f"gather_control ({'world' if world else 'control group'})")
    dist.gather(t, parts, group=group, group_dst=0)
    forensics.leave(prev)
    return [int(p.item()) for p in parts] if me == 0 else None


def broadcast_object(obj: Any, world: bool = False) -> Any:
    """The driver's ``obj`` (any picklable object) on every rank of the replica, or with ``world``
    global rank 0's on every rank: one ``broadcast_object_list`` on that gloo group, bounded by the
    group timeout (other ranks pass anything, e.g. None, and get rank 0's copy). ``obj`` itself at
    size 1.

    Raises:
        RuntimeError: (torch.distributed's) a rank did not join within the group timeout.
    """
    tp = get_tp()
    n, me, group = ((tp.world_size, tp.global_rank, _world_group()) if world
                    else (tp.engine_size, tp.engine_rank, _control_group()))
    if n == 1:
        return obj
    box = [obj if me == 0 else None]
    prev = forensics.enter(f"broadcast_object ({'world' if world else 'control group'})")
    dist.broadcast_object_list(box, group=group, group_src=0)
    forensics.leave(prev)
    return box[0]


def dp_broadcast_object(obj: Any) -> Any:
    """Replica 0's driver's ``obj`` on every replica's driver (the data-parallel gloo group; call it
    on the drivers only, :attr:`TPInfo.is_driver`), bounded by the group timeout. ``obj`` itself with
    one replica.

    Raises:
        RuntimeError: (torch.distributed's) a driver did not join within the group timeout.
    """
    tp = get_tp()
    if tp.dp_size == 1:
        return obj
    box = [obj if tp.dp_rank == 0 else None]
    prev = forensics.enter("broadcast_object (data-parallel group)")
    dist.broadcast_object_list(box, group=_STATE.dp, group_src=0)
    forensics.leave(prev)
    return box[0]


def dp_gather_object(obj: Any) -> list[Any] | None:
    """Every replica driver's ``obj``, in replica order, on replica 0's driver (None on the others):
    one ``gather_object`` on the data-parallel gloo group (drivers only), bounded by the group
    timeout. ``[obj]`` with one replica."""
    tp = get_tp()
    if tp.dp_size == 1:
        return [obj]
    out = [None] * tp.dp_size if tp.dp_rank == 0 else None
    prev = forensics.enter("gather_object (data-parallel group)")
    dist.gather_object(obj, out, group=_STATE.dp, group_dst=0)
    forensics.leave(prev)
    return out


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elementwise maximum over the TP group's ranks (of this stage), in place, on its data
    group (loading: int8's row absmax); ``t`` itself at size 1."""
    if get_tp().size > 1:
        prev = forensics.enter("all_reduce_max while loading (TP data group)")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_data_group())
        forensics.leave(prev)
    return t


#: this process's pipeline transfers so far: bytes sent, and seconds spent waiting to receive (what
#: ``make bench-pp`` reads: bytes moved between stages, each stage's idle time)
P2P_COUNTERS = {"sent_bytes": 0, "recv_wait_s": 0.0}


def _p2p_wait(work, what: str) -> None:
    """Wait for a point-to-point transfer, bounded by the group timeout (gloo's wait raises past it)."""
    prev = forensics.enter(what)
    work.wait()
    forensics.leave(prev)


def pp_isend(t: torch.Tensor, dst: int, tag: int = 0) -> tuple[Any, torch.Tensor]:
    """Start sending ``t`` to global rank ``dst`` (message ``tag``) on the pipeline's point-to-point group;
    returns ``(work, the tensor sent)`` (keep it alive until :func:`pp_wait` returned)."""
    t = t.contiguous()
    P2P_COUNTERS["sent_bytes"] += t.numel() * t.element_size()
    return dist.isend(t, dst, group=_STATE.p2p, tag=tag), t


def pp_irecv(t: torch.Tensor, src: int, tag: int = 0) -> Any:
    """Start receiving ``t`` (its shape and dtype known to both sides) from global rank ``src``
    (message ``tag``) on the pipeline's point-to-point group; returns the work for :func:`pp_wait`."""
    return dist.irecv(t, src, group=_STATE.p2p, tag=tag)


def pp_wait(work: Any, what: str, receiving: bool = False) -> None:
    """Wait for a transfer :func:`pp_isend` or :func:`pp_irecv` started, bounded by the group timeout
    (gloo's wait raises past it); ``what`` names it (the step, the stages, the peer rank) in a forensics
    report; ``receiving``: the wait counts as this rank's wait for its input."""
    started = time.perf_counter()
    _p2p_wait(work, what)
    if receiving:
        P2P_COUNTERS["recv_wait_s"] += time.perf_counter() - started


def pp_send(t: torch.Tensor, dst: int, what: str) -> None:
    """Send ``t`` to global rank ``dst`` on the pipeline's point-to-point group, waiting until it is
    out (bounded by the group timeout); ``what`` names it in a forensics report (the stages and the
    peer)."""
    work, _ = pp_isend(t, dst)
    pp_wait(work, f"{what}: send to rank {dst} (pipeline p2p group)")


def pp_recv(t: torch.Tensor, src: int, what: str) -> torch.Tensor:
    """Receive ``t`` (its shape and dtype known to both sides) from global rank ``src`` on the
    pipeline's point-to-point group, bounded by the group timeout; returns ``t``."""
    pp_wait(pp_irecv(t, src), f"{what}: receive from rank {src} (pipeline p2p group)", receiving=True)
    return t
