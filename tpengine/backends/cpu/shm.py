"""Shared-memory all-reduce and gather-to-rank-0 for the ranks of one host (CPU).

By default the layers' activation collectives are :mod:`tpengine.distributed`'s (gloo on CPU,
NCCL on CUDA). On CPU, when every rank runs on this host, the model runner calls
:func:`init_shm` once at start-up, which installs a :class:`ShmComm` on the process-group state
(:func:`tpengine.distributed.install_activation_comm`): each rank copies its
tensor into its slot of one shared-memory file, publishes a generation counter, and reads the
other ranks' slots once their counters arrive. Gloo pays thread wake-ups around its TCP
transport on every all-reduce, however small the tensor, and a decode step runs 2 all-reduces per
layer; shared memory skips the transport (figures in docs/notes/kernels.md).

Protocol (call ``g`` = this rank's g-th collective; all ranks make the same calls in the same
order, as every rank runs the same step): wait until every rank has *started* call ``g - 1``
(so nobody still reads the buffer about to be reused), copy the tensor into this rank's slot of
buffer ``g % 2``, set ``flag[rank] = g``; an all-reduce then waits for every flag ``>= g`` and
sums the slots in rank order (so every rank gets bit-identical results); a gather waits on
rank 0 only. Stores become visible in program order on x86-64 (TSO), the only architecture this
is enabled on. A peer that dies or stalls past the timeout raises RuntimeError (bounded wait).
"""

from __future__ import annotations

import os
import platform
import random
import time

import torch

from tpengine import distributed as dist
from tpengine.backends.cpu import cpu_fused, cpu_library
from tpengine.utils import cdiv

HEADER = 4096  # flags and pids, one 64-byte line per rank (up to 64 ranks); cpu_shm.c has the same
#: The dtypes the C all-reduce takes; the longest it spins in one wait before this module waits instead.
FAST_DTYPES = (torch.float32, torch.bfloat16)
SPIN_NS = 10_000_000


class ShmComm:
    """Collectives over one shared-memory file for ``size`` ranks of this host.

    Args:
        rank, size: this rank and the group size.
        path: the file (``/dev/shm/...``), created by rank 0 before the others open it.
        slot_bytes: the largest tensor it carries; larger ones go through gloo (the same
            decision on every rank, as it depends only on the shape).
        timeout_s: longest wait for the other ranks.
    """

    def __init__(self, rank: int, size: int, path: str, slot_bytes: int, timeout_s: float):
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.slot_bytes = cdiv(slot_bytes, 64) * 64
        total = HEADER + 2 * size * self.slot_bytes
        self.buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        header = self.buf[:HEADER].view(torch.int64)[: size * 8].view(size, 8)  # one 64-byte line per rank
        self.flags = header[:, 0].numpy()  # generation counters (numpy: cheap polling)
        self.pids = header[:, 1].numpy()
        self.pids[rank] = os.getpid()
        self.gen = 0
        lib = cpu_library.load() if cpu_library.has("tpe_shm_all_reduce", "tpe_shm_all_reduce_add_rms_norm") else None
        self._fast = lib.tpe_shm_all_reduce if lib is not None else None
        self._fused = lib.tpe_shm_all_reduce_add_rms_norm if lib is not None else None
        self._base = self.buf.data_ptr()

    def _slot(self, gen: int, rank: int, t: torch.Tensor) -> torch.Tensor:
        start = HEADER + ((gen % 2) * self.size + rank) * self.slot_bytes
        return self.buf[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)

    def _wait(self, gen: int, ranks) -> None:
        flags = self.flags
        if all(flags[r] >= gen for r in ranks):
            return
        start, spins = time.monotonic(), 0
        while not all(flags[r] >= gen for r in ranks):
            spins += 1
            if spins % 64 == 0:
                os.sched_yield()  # give the core back if the machine is oversubscribed
            if spins % 4096 == 0:
                self._check_peers(start)

    def _check_peers(self, start: float) -> None:
        for r in range(self.size):
            pid = int(self.pids[r])
            if r != self.rank and pid:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    raise RuntimeError(f"rank {r} (pid {pid}) exited during a collective") from None
                except PermissionError:
                    pass
        if time.monotonic() - start > self.timeout_s:
            raise RuntimeError(f"rank {self.rank}: no peer progress in a shared-memory collective for "
                               f"{self.timeout_s:.0f} s")

    def _fits(self, t: torch.Tensor) -> bool:
        return t.is_contiguous() and t.numel() * t.element_size() <= self.slot_bytes

    def _publish(self, t: torch.Tensor) -> int:
        self.gen += 1
        g = self.gen
        self._wait(g - 1, range(self.size))  # nobody still reads buffer g % 2 from call g - 2
        self._slot(g, self.rank, t).copy_(t)
        self.flags[self.rank] = g
        return g

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (same contract as :func:`tpengine.distributed.all_reduce`).
        A float32 or bfloat16 tensor takes the C fast path (``cpu_shm.c``: the same protocol and
        sums in one call, each wait spinning at most :data:`SPIN_NS`); where it stops waiting, this
        method waits (checking the peers and the timeout) and finishes the call."""
        if not self._fits(t):
            return dist.all_reduce(t)
        if self._fast is not None and t.dtype in FAST_DTYPES:
            self.gen += 1
            g = self.gen
            done = self._fast(self._base, self.slot_bytes, self.size, self.rank, g, t.data_ptr(), t.numel(),
                              int(t.dtype == torch.bfloat16), SPIN_NS)
            return t if done == 0 else self._finish(t, g, published=done == 2)
        return self._finish(t, self._publish(t), published=True)

    def all_reduce_add_rms_norm(self, t: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``h2 = h + all_reduce(t)`` and ``weight * rms_norm(h2)`` in one C call
        (``cpu_shm.c``: the all-reduce's sums, then :func:`tpengine.backends.cpu.cpu_fused.add_rms_norm`'s
        arithmetic; ``t`` is not written). Shapes: ``t``, ``h [rows, n]`` contiguous, ``weight [n]``,
        float32 or bfloat16 alike, ``n % 16 == 0``. Returns ``(h2, normed)``, or None (nothing done)
        where the fast path does not take these tensors; the caller then reduces and normalizes
        separately, with the same result."""
        n = h.shape[-1] if h.dim() else 0
        if (self._fused is None or t.dtype not in FAST_DTYPES or not self._fits(t) or h.dim() != 2 or not n
                or n % 16 or h.shape != t.shape or not h.is_contiguous() or h.dtype != t.dtype
                or weight.shape != (n,) or weight.dtype != t.dtype or not weight.is_contiguous()):
            return None
        self.gen += 1
        g = self.gen
        h2, y = torch.empty_like(h), torch.empty_like(h)
        done = self._fused(self._base, self.slot_bytes, self.size, self.rank, g, t.data_ptr(), h.shape[0], n,
                           int(t.dtype == torch.bfloat16), SPIN_NS, h.data_ptr(), weight.data_ptr(), h2.data_ptr(),
                           y.data_ptr(), eps, torch.get_num_threads())
        if done == 0:
            return h2, y
        self._finish(t, g, published=done == 2)
        return cpu_fused.add_rms_norm(h, t, weight, eps, True)

    def _finish(self, t: torch.Tensor, g: int, published: bool) -> torch.Tensor:
        """Call ``g`` of an all-reduce of ``t`` from where the C path stopped waiting: publish
        (unless ``published``), wait, sum the slots into ``t``."""
        if not published:
            self._wait(g - 1, range(self.size))
            self._slot(g, self.rank, t).copy_(t)
            self.flags[self.rank] = g
        self._wait(g, range(self.size))
        torch.add(self._slot(g, 0, t), self._slot(g, 1, t), out=t)
        for r in range(2, self.size):
            t.add_(self._slot(g, r, t))
        return t

    def gather_to_driver(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``t`` concatenated along ``dim`` on rank 0, None elsewhere."""
        if not self._fits(t):
            return dist.gather_to_driver(t, dim)
        g = self._publish(t)
        if self.rank != 0:
            return None
        self._wait(g, range(self.size))
        return torch.cat([self._slot(g, r, t) for r in range(self.size)], dim=dim)


def shm_supported(tp: dist.TPInfo) -> bool:
    """CPU, more than one rank, the whole TP group on this host, x86-64: torchrun's LOCAL_WORLD_SIZE
    ranks on this host are whole TP groups of consecutive ranks (one, or several replicas' of a
    data-parallel launch)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    return (tp.device.type == "cpu" and 1 < tp.size <= HEADER // 64 and local >= tp.size and local % tp.size == 0
            and platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm"))


def init_shm(tp: dist.TPInfo, slot_bytes: int, timeout_s: float) -> bool:
    """Collective (every rank calls it, once, at start-up): when :func:`shm_supported`, route the
    layers' all-reduce and gather through a :class:`ShmComm` of ``slot_bytes`` per rank
    (installed with :func:`tpengine.distributed.install_activation_comm`); otherwise leave
    torch.distributed's. The driver broadcasts the file's name (one per pipeline stage) and each TP
    group's rank 0 creates it; it is unlinked once every rank has mapped it. Returns whether shared memory is in use.

    Raises:
        RuntimeError: a peer died or stalled past ``timeout_s`` (from the control-group calls).
    """
    dist.install_activation_comm(None)
    if not shm_supported(tp):
        return False
    token = torch.tensor([random.getrandbits(62) if tp.is_driver else 0], dtype=torch.int64)
    path = f"/dev/shm/tpengine-{int(dist.broadcast_control(token)):x}"
    if tp.pp_size > 1:  # one file per pipeline stage's TP group (the control group spans the stages)
        path += f"-stage{tp.pp_rank}"
    if tp.rank == 0:
        try:
            comm = ShmComm(tp.rank, tp.size, path, slot_bytes, timeout_s)
            dist.all_reduce_min(0)  # created ...
            dist.all_reduce_min(0)  # ... and mapped by everyone
        finally:  # the mappings outlive the name; never leave the file behind, even on failure
            if os.path.exists(path):
                os.unlink(path)
    else:
        dist.all_reduce_min(0)
        comm = ShmComm(tp.rank, tp.size, path, slot_bytes, timeout_s)
        dist.all_reduce_min(0)
    dist.install_activation_comm(comm)
    return True
