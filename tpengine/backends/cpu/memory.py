"""Large zero-filled CPU tensors whose memory is only taken as it is used (the CPU platform's KV
cache, :meth:`tpengine.backends.cpu.platform.CPUPlatform.allocate_kv_cache`)."""

from __future__ import annotations

import math
import mmap

import torch


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
