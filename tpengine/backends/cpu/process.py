"""The CPU platform's process set-up (:meth:`tpengine.backends.cpu.platform.CPUPlatform.setup_process`):
intra-op threads, malloc behaviour, oneDNN's caches, the C kernels' build and the shared-memory
collectives. Process-wide settings, made once before a rank builds its model, never per step."""

from __future__ import annotations

import ctypes
import os

import torch

from tpengine.utils import GIB


def keep_freed_memory() -> bool:
    """CPU: make glibc malloc keep freed memory for reuse instead of handing it back to the OS.

    Every step allocates activations of the same few sizes (tens of MB in a prefill); by default
    glibc serves large blocks (its mmap threshold moves between 128 KiB and 32 MiB) with a fresh
    ``mmap`` and unmaps them when freed, so every step page-faults all its activation memory again
    (docs/notes/kernels.md has the measurement). ``M_MMAP_MAX=0`` serves everything from the
    heap and a 1 GiB ``M_TRIM_THRESHOLD`` keeps it there. Process-wide; a no-op (False) without
    glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-4, 0)) and bool(libc.mallopt(-1, GIB))  # M_MMAP_MAX, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


#: entries each of oneDNN's primitive cache and ideep's (torch's oneDNN wrapper) may hold: :func:`bound_onednn_caches`
ONEDNN_CACHE_CAPACITY = 256


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """CPU: bound the caches oneDNN and ideep keep of the packed linears' matmul primitives
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``; each 1024 by default), unless the
    user set them. Both are keyed by the input's row count, so a server whose steps run ever new
    token counts (prefills, mixed steps, every decode batch size) fills them, each entry with its
    JIT code and scratch memory, so at the defaults a long-running server's memory grows by
    gigabytes (the figures: docs/notes/benchmarks.md, "Soak"). 256 covers the 64 decode batch sizes
    of ``max_num_seqs`` x 4 weight shapes; a primitive evicted past that is only made again (a
    one-off cost, far below a step's). Read by oneDNN and ideep at their first use: set before the
    model loads (a process that already ran a oneDNN matmul keeps its capacity)."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))


def release_free_memory() -> None:
    """Give the pages of freed heap memory back to the OS (glibc ``malloc_trim``), e.g. after
    loading, whose staging buffers and replaced weight layouts leave holes. No-op without glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def setup_process(config, tp, plan) -> None:
    """Collective (every rank calls it, after :func:`tpengine.distributed.init_distributed`): intra-op
    threads (``config.threads``, default cores // the ranks on this host), malloc that keeps freed
    memory, oneDNN's primitive caches bounded (:func:`bound_onednn_caches`), the C kernels built now
    for a bfloat16 model with ``config.cpu_kernels`` (so the build is not timed inside the first step),
    and the all-reduce/gather switched to shared memory when every rank is on this host
    (:func:`tpengine.backends.cpu.shm.init_shm`, sized for the largest activation a step sends:
    ``max_num_batched_tokens x hidden`` or the LM head's ``max_num_seqs x local vocab``, at most 64 MiB).
    ``config``: :class:`~tpengine.config.EngineConfig`; ``tp``: :class:`~tpengine.distributed.TPInfo`;
    ``plan``: :class:`~tpengine.model.plan.ShardPlan`."""
    from tpengine.backends.cpu import cpu_library
    from tpengine.backends.cpu.shm import init_shm

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # the ranks on this host share its cores (a data-parallel launch runs several TP groups on one host)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", tp.size))
    torch.set_num_threads(config.threads or max(1, (cores or 1) // local))
    keep_freed_memory()
    bound_onednn_caches()
    dtype = config.torch_dtype(tp.device)
    if dtype == torch.bfloat16 and config.cpu_kernels:
        cpu_library.load()
    elem = torch.empty(0, dtype=dtype).element_size()
    rp = plan.ranks[tp.rank]
    largest = max(config.max_num_batched_tokens * plan.hidden_size, config.max_num_seqs * rp.vocab_size)
    init_shm(tp, min(largest * elem, 64 << 20), config.dist_timeout_s)
