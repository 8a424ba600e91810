"""The device backends: each device's platform (:func:`get_platform`, the interface
:class:`tpengine.backends.platform.Platform`: process set-up, the layers' ops, measuring and binding,
the step runner) and the paged-attention backends: the CPU one (torch + C kernels) and the Triton one
(CUDA), both checked against the torch oracle :mod:`tpengine.backends.reference`.

:func:`get_backend` makes one backend object per engine (interface:
:class:`tpengine.backends.base.AttentionBackend`). Triton is imported lazily, so CPU-only installs
without it work.
"""

from __future__ import annotations

from tpengine.config import BACKENDS


def get_backend(name: str, device, *, cpu_kernels: bool, kv_mirror: bool):
    """A new attention backend for ``name`` on ``device`` (a ``torch.device`` or a string).

    ``"auto"``: Triton on CUDA devices, the CPU backend otherwise; ``"cpu"`` (or its old name ``"torch"``):
    :class:`tpengine.backends.cpu.attention.CPUAttentionBackend` (``cpu_kernels``: use the C kernels,
    ``EngineConfig.cpu_kernels``; ``kv_mirror``: keep decode contexts across steps,
    ``EngineConfig.kv_mirror``; with ``cpu_kernels``, decode steps take the paged C kernel where the
    model's layers take it, which keeps no mirror); ``"triton"``:
    :class:`tpengine.backends.cuda.attention.TritonAttentionBackend` (on CPU tensors that works
    only with ``TRITON_INTERPRET=1`` set before triton is imported; the two flags do not apply).
    Raises ValueError for any other name, naming the value and the allowed ones; ImportError if
    Triton is requested but not installed.
    """
    import torch

    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "cpu"
    if name in ("cpu", "torch"):
        from tpengine.backends.cpu.attention import CPUAttentionBackend

        return CPUAttentionBackend(cpu_kernels=cpu_kernels, kv_mirror=kv_mirror, paged=cpu_kernels)
    from tpengine.backends.cuda.attention import TritonAttentionBackend

    return TritonAttentionBackend()


def get_platform(device):
    """The device backend of ``device`` (a ``torch.device`` or a string): the ``Platform`` subclass
    ``tpengine/backends/<device type>/platform.py`` defines as ``PLATFORM``, or the plain torch
    :class:`tpengine.backends.platform.Platform` for a device without such a module. A new device adds
    its package under ``backends/`` and nothing else."""
    import importlib

    import torch

    from tpengine.backends.platform import Platform

    kind = torch.device(device).type
    try:
        module = importlib.import_module(f"tpengine.backends.{kind}.platform")
    except ModuleNotFoundError as e:
        if e.name not in (f"tpengine.backends.{kind}", f"tpengine.backends.{kind}.platform"):
            raise
        return Platform()
    return module.PLATFORM()
