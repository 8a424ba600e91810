"""float32 GEMM for a decode batch on a linear layer's plain ``[out, in]`` weight (``cpu_gemm.c``,
built by :mod:`tpengine.backends.cpu.cpu_library`).

MKL's sgemm packs the weight's panels on every call; at the 64 rows of a decode batch that pass
over the weight costs as much as the arithmetic. This kernel reads the weight once in its own
row-major layout, as broadcast operands of an outer-product micro-kernel (``cpu_gemm.c``), so no
packed copy of the weight exists. Used for a weight shape when
:mod:`tpengine.backends.cpu.linear_layout` measured it faster than ``F.linear`` and oneDNN's packed
layout at a decode batch's rows on this machine. Each output row is one FMA chain over ``in`` in
order, so a row's result does not depend on the other rows of the batch.
"""

from __future__ import annotations

import torch

from tpengine.backends.cpu import cpu_library

#: Below this many rows a call is bound by the weight loads the kernel broadcasts (one FMA each),
#: and the GEMV kernel or MKL takes them.
MIN_ROWS = 17
#: Rows of x per pass over the weight (the C code's TPE_GEMM_M); the panel holds ``in x PANEL_ROWS``.
PANEL_ROWS = 64


def available(weight: torch.Tensor) -> bool:
    """Whether :func:`gemm` takes this weight: a contiguous float32 CPU ``[n, k]`` tensor, and the
    library has the kernel (AVX-512F and AVX2 builds: :func:`cpu_library.has`)."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_contiguous() and cpu_library.has("tpe_gemm_f32"))


def gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for float32 ``x [..., k]`` and ``weight [n, k]`` (see :func:`available`)
    -> float32 ``[..., n]``.

    Raises:
        ValueError: a dtype or shape it does not take.
    """
    n, k = weight.shape
    if not available(weight) or x.dtype != torch.float32 or x.shape[-1] != k or x.device.type != "cpu":
        raise ValueError(f"gemm: float32 x [..., {k}] on the CPU and a contiguous float32 weight [n, k]; got x "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}, weight {weight.dtype} {tuple(weight.shape)}")
    return _run(weight, x.reshape(-1, k).contiguous()).reshape(*x.shape[:-1], n)


def _run(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The C call for checked arguments: ``x [rows, k]`` contiguous float32 -> ``[rows, n]``."""
    (n, k), y = weight.shape, torch.empty(x.shape[0], weight.shape[0])
    panel = torch.empty(k * PANEL_ROWS)  # torch's CPU allocations are 64-byte aligned
    cpu_library.load().tpe_gemm_f32(x.data_ptr(), x.shape[0], k, weight.data_ptr(), n, y.data_ptr(),
                                   panel.data_ptr(), torch.get_num_threads())
    return y


def bind(weight: torch.Tensor):
    """:func:`gemm` for this one weight with its checks done once: returns ``run(x [rows, k]
    contiguous float32) -> [rows, n]`` (the caller guarantees the argument: the decode program,
    :mod:`tpengine.backends.cpu.decode_program`).

    Raises:
        ValueError: a weight :func:`available` refuses.
    """
    if not available(weight):
        raise ValueError(f"gemm: cannot take a {weight.dtype} weight {tuple(weight.shape)}")
    return lambda x: _run(weight, x)
