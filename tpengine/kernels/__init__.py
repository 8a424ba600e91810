"""Paged-attention kernels: a torch reference (CPU path, oracle) and Triton kernels (CUDA path).

Both backends are modules exposing the same three functions -- ``store_kvcache``,
``prefill_attention``, ``decode_attention`` -- documented in :mod:`tpengine.kernels.reference`.
Triton is imported lazily, so CPU-only installs without it work.
"""

from __future__ import annotations

from types import ModuleType

import torch

BACKENDS = ("auto", "torch", "triton")


def get_backend(name: str, device: torch.device | str) -> ModuleType:
    """Return the kernels module for ``name`` on ``device``.

    ``"auto"``: Triton on CUDA devices, the torch reference otherwise; ``"torch"``:
    :mod:`tpengine.kernels.reference`; ``"triton"``: :mod:`tpengine.kernels.paged_attention`
    (on CPU tensors that works only with ``TRITON_INTERPRET=1`` set before triton is imported).
    Raises ValueError for any other name, naming the value and the allowed ones; ImportError if
    Triton is requested but not installed.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        from tpengine.kernels import reference

        return reference
    from tpengine.kernels import paged_attention

    return paged_attention
