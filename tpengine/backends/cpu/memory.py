"""The CPU platform's memory: large zero-filled tensors whose memory is only taken as it is used (the
KV cache, :meth:`tpengine.backends.cpu.platform.CPUPlatform.allocate_kv_cache`), and a long job's
weights moved into transparent huge pages once loaded (:func:`collapse_huge_pages`)."""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import mmap
import sys
import time
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

#: A transparent huge page on x86-64 (and the alignment of the regions :func:`collapse_huge_pages` asks for).
HUGE_PAGE = 2 << 20

#: The least share of a 2 MiB region the weights must fill for :func:`collapse_huge_pages` to ask for it:
#: collapsing makes the whole region resident, so a region of mostly free heap (the holes a load's
#: staging buffers and replaced layouts leave, handed back by the trim) would cost more memory than its
#: few weight bytes gain. Not a timing: a memory bound (at most as much again as the weights).
MIN_FILL = 0.5

#: ``madvise``'s advice to collapse a range into transparent huge pages now, synchronously (Linux >= 6.1).
MADV_COLLAPSE = 25

#: Where the kernel says whether transparent huge pages may be used ("[never]": not at all).
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"

_warned = False  # one log line a process when collapsing fails (:func:`collapse_huge_pages`)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled contiguous CPU tensor of ``shape`` backed by an anonymous memory map: the
    kernel hands out zeroed pages on first touch, so a large KV cache costs neither time nor
    resident memory until its blocks are written (``torch.zeros`` writes every page up front).
    The tensor keeps the mapping alive.

    Raises:
        MemoryError: the mapping cannot be made (``n`` bytes more than the system allows).
    """
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    try:
        buf = mmap.mmap(-1, n)
    except OSError as e:
        raise MemoryError(f"cannot map {n / 2**30:.2f} GiB: {e.strerror or e}") from None
    return torch.frombuffer(buf, dtype=torch.uint8, count=n).view(dtype).view(shape)


def thp_enabled(path: str = THP_ENABLED) -> bool:
    """Whether the kernel may back memory with transparent huge pages: Linux, and ``path`` (the THP
    setting) readable and not set to "never"."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open(path) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def anonymous_ranges(maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """The ``[start, end)`` byte addresses of this process's private anonymous mappings (the heap,
    malloc's and torch's own mappings), read from ``maps``, adjacent ones merged; [] where unreadable.
    A file mapping (a short job's weights mapped from the checkpoint, the libraries) and a shared one
    (the KV cache, :func:`lazy_zeros`) are left out: a transparent huge page cannot hold them."""
    ranges: list[tuple[int, int]] = []
    try:
        with open(maps) as f:
            lines = f.readlines()
    except OSError:
        return ranges
    for line in lines:
        parts = line.split()
        if len(parts) < 5 or parts[1][3] != "p" or parts[4] != "0":  # private, no inode
            continue
        if len(parts) > 5 and parts[5] != "[heap]" and not parts[5].startswith("[anon"):
            continue  # [stack], [vdso], [vvar] and the like
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if ranges and ranges[-1][1] == lo:
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))
    return ranges


def huge_regions(spans: Iterable[tuple[int, int]], ranges: list[tuple[int, int]],
                 min_fill: float = MIN_FILL) -> list[int]:
    """The start addresses, ascending and each once, of the :data:`HUGE_PAGE`-aligned regions that
    cover the byte ``spans`` (``(address, nbytes)``, not overlapping; rounded outward), lie wholly
    inside one of ``ranges`` (:func:`anonymous_ranges`; a region past a range's edge is left out) and
    hold at least ``min_fill`` of a region's bytes of them (:data:`MIN_FILL`)."""
    filled: dict[int, int] = {}
    for addr, n in spans:
        for s in range(addr // HUGE_PAGE * HUGE_PAGE, addr + max(n, 0), HUGE_PAGE):
            filled[s] = filled.get(s, 0) + min(addr + n, s + HUGE_PAGE) - max(addr, s)
    out, i = [], 0
    for s in sorted(s for s, b in filled.items() if b >= min_fill * HUGE_PAGE):
        while i < len(ranges) and ranges[i][1] < s + HUGE_PAGE:
            i += 1
        if i < len(ranges) and ranges[i][0] <= s:
            out.append(s)
    return out


def _madvise():
    """libc's ``madvise`` as a ctypes function setting ``errno``, or None without one."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """``(address, nbytes)`` of the CPU memory holding ``t`` (its whole storage; oneDNN's packed layout
    through ``torch.ops.mkldnn.data_ptr`` / ``_nbytes``), or None (meta, another device, no such op)."""
    if t.device.type != "cpu" or t.is_meta:
        return None
    if t.is_mkldnn:
        ops = torch.ops.mkldnn
        if not (hasattr(ops, "data_ptr") and hasattr(ops, "_nbytes")):
            return None
        return int(ops.data_ptr(t)), int(ops._nbytes(t))
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def collapse_huge_pages(tensors: Iterable[torch.Tensor], madvise=None, enabled: bool | None = None,
                        ranges: list[tuple[int, int]] | None = None, budget_s: float = math.inf,
                        clock=time.perf_counter, min_fill: float = MIN_FILL) -> tuple[int, int]:
    """Move the memory of CPU ``tensors`` (a long job's weights, in their final layouts) into
    transparent huge pages now: each 2 MiB region (:data:`HUGE_PAGE`) covering a tensor's storage and
    lying in a private anonymous mapping, at least ``min_fill`` of it weights (:func:`huge_regions`),
    is collapsed in place
    (``madvise(MADV_COLLAPSE)``, Linux >= 6.1): every address and byte is kept, so C programs bound
    to the weights' pointers stay valid, while one TLB entry then covers 2 MiB of weight instead of
    4 KiB (docs/notes/kernels.md has what it saves a step and costs a load). A region the kernel
    refuses (EINVAL: no ``MADV_COLLAPSE``; ENOMEM / EAGAIN: no huge page free now) keeps its 4 KiB
    pages, logged once a process; nothing raises. Once ``budget_s`` seconds (of ``clock``) are spent,
    the regions left keep their pages (each region costs a 2 MiB copy and, on a host that backs a
    guest's memory lazily, a slow first touch: a job that will not repay it all asks fewer).
    ``madvise`` (``(address, nbytes, advice) -> (rc, errno)``), ``enabled`` (:func:`thp_enabled`) and
    ``ranges`` (:func:`anonymous_ranges`) are for tests. Returns ``(collapsed, regions)``: the regions
    now in huge pages, of those the tensors cover; ``(0, 0)`` where THP is off ("never"), not Linux,
    or no tensor lies in such a mapping."""
    global _warned
    if not (thp_enabled() if enabled is None else enabled):
        return 0, 0
    spans: dict[int, int] = {}
    for t in tensors:
        span = _span(t)
        if span is not None:
            spans[span[0]] = max(spans.get(span[0], 0), span[1])
    regions = huge_regions(spans.items(), anonymous_ranges() if ranges is None else ranges, min_fill)
    if madvise is None:
        fn = _madvise()
        if fn is None:
            return 0, len(regions)

        def madvise(addr: int, n: int, advice: int) -> tuple[int, int]:
            rc = fn(addr, n, advice)
            return rc, ctypes.get_errno() if rc else 0

    done, failed, start = 0, {}, clock()
    for s in regions:
        if clock() - start >= budget_s:
            failed["budget"] = len(regions) - done - sum(failed.values())
            break
        rc, err = madvise(s, HUGE_PAGE, MADV_COLLAPSE)
        if rc == 0:
            done += 1
        else:
            failed[err] = failed.get(err, 0) + 1
            if err == errno.EINVAL and not done:  # no MADV_COLLAPSE in this kernel: ask no further region
                break
    if failed and not _warned:
        _warned = True
        logger.info("CPU weights: %d of %d 2 MiB regions in huge pages, the others keep 4 KiB pages (%s)",
                    done, len(regions), ", ".join(f"{errno.errorcode.get(e, e)} x{c}" for e, c in failed.items()))
    return done, len(regions)
