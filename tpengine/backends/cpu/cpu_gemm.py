"""GEMM for a decode batch on a linear layer's plain ``[out, in]`` weight (``cpu_gemm.c``, built by
:mod:`tpengine.backends.cpu.cpu_library`): float32, and on AVX2 builds bfloat16 too.

MKL's sgemm packs the weight's panels on every call; at the 64 rows of a decode batch that pass
over the weight costs as much as the arithmetic. This kernel reads the weight once in its own
row-major layout, as broadcast operands of an outer-product micro-kernel (``cpu_gemm.c``), so no
packed copy of the weight exists. A bfloat16 weight (AVX2 builds: CPUs without a bfloat16 GEMM,
where torch's bfloat16 product is a slow generic loop) is widened to float32 a block of 6 rows at
a time in the thread's scratch, so the product is float32's, each output rounded once to bfloat16,
without the widened copy of the whole weight and MKL's packing of it that
:mod:`tpengine.backends.cpu.cpu_widen` pays per call. Used for a weight shape when
:mod:`tpengine.backends.cpu.linear_layout` measured it faster than the other paths at a decode
batch's rows on this machine. Each output row is one FMA chain over ``in`` in order, so a row's
result does not depend on the other rows of the batch.
"""

from __future__ import annotations

import torch

from tpengine.backends.cpu import cpu_library

#: Below this many rows a call is bound by the weight loads the kernel broadcasts (one FMA each),
#: and the GEMV kernel or MKL takes them.
MIN_ROWS = 17
#: Rows of x per pass over the weight (the C code's TPE_GEMM_M); the panel holds ``in x PANEL_ROWS``.
PANEL_ROWS = 64
#: Weight rows a thread widens at a time for a bfloat16 weight (the AVX2 code's TPE_GEMM_NR; and a
#: last, shorter block's rows in float32): the scratch holds ``in x WIDEN_ROWS`` float32 per thread
#: after the panel.
WIDEN_ROWS = 6
#: The C function for each weight dtype.
KERNELS = {torch.float32: "tpe_gemm_f32", torch.bfloat16: "tpe_gemm_bf16"}


def available(weight: torch.Tensor) -> bool:
    """Whether :func:`gemm` takes this weight: a contiguous CPU ``[n, k]`` tensor in float32 (AVX-512F
    and AVX2 builds) or bfloat16 (AVX2 builds), and the library has its kernel (:func:`cpu_library.has`)."""
    return (weight.dtype in KERNELS and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_contiguous() and cpu_library.has(KERNELS[weight.dtype]))


def gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x [..., k]`` and ``weight [n, k]`` of one dtype (see :func:`available`)
    -> ``[..., n]`` in that dtype.

    Raises:
        ValueError: a dtype or shape it does not take.
    """
    n, k = weight.shape
    if not available(weight) or x.dtype != weight.dtype or x.shape[-1] != k or x.device.type != "cpu":
        kinds = "/".join(str(d).removeprefix("torch.") for d in KERNELS if cpu_library.has(KERNELS[d])) or "no dtype"
        raise ValueError(f"gemm: x [..., {k}] on the CPU and a contiguous weight [n, k] of its dtype ({kinds} in "
                         f"this build); got x {x.dtype} {tuple(x.shape)} on {x.device}, weight {weight.dtype} "
                         f"{tuple(weight.shape)}")
    return _run(weight, x.reshape(-1, k).contiguous()).reshape(*x.shape[:-1], n)


def _run(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The C call for checked arguments: ``x [rows, k]`` contiguous, the weight's dtype -> ``[rows, n]``."""
    (n, k), threads = weight.shape, torch.get_num_threads()
    y = torch.empty(x.shape[0], n, dtype=weight.dtype)
    scratch = torch.empty(k * (PANEL_ROWS + WIDEN_ROWS * threads))  # torch's CPU allocations are 64-byte aligned
    getattr(cpu_library.load(), KERNELS[weight.dtype])(x.data_ptr(), x.shape[0], k, weight.data_ptr(), n,
                                                       y.data_ptr(), scratch.data_ptr(), threads)
    return y


def bind(weight: torch.Tensor):
    """:func:`gemm` for this one weight with its checks done once: returns ``run(x [rows, k]
    contiguous, the weight's dtype) -> [rows, n]`` (the caller guarantees the argument: the layer's forward,
    :func:`tpengine.backends.cpu.linear_layout.bind_linear`).

    Raises:
        ValueError: a weight :func:`available` refuses.
    """
    if not available(weight):
        raise ValueError(f"gemm: cannot take a {weight.dtype} weight {tuple(weight.shape)}")
    return lambda x: _run(weight, x)


#: The C function for a float32 weight in the blocked layout (:mod:`tpengine.backends.cpu.cpu_blocked`).
BLOCKED_KERNEL = "tpe_gemm_blocked_f32"


def blocked_available(blocked: torch.Tensor | None) -> bool:
    """Whether :func:`blocked_gemm` takes this weight: a float32 weight in the blocked layout
    (:func:`tpengine.backends.cpu.cpu_blocked.is_blocked`, ``[n/16, k, 16]``) and the library has the kernel."""
    from tpengine.backends.cpu import cpu_blocked

    return (cpu_blocked.is_blocked(blocked) and blocked.dtype == torch.float32
            and cpu_library.has(BLOCKED_KERNEL))


def blocked_gemm(x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """``x [rows, k] @ weight.T -> [rows, n]`` float32 for a float32 weight in the blocked layout, any rows: the
    same products as :func:`tpengine.backends.cpu.cpu_blocked.linear` (equal outputs, bit for bit), the tiles run
    in chunks of rows whose ``x`` fits the L2 (``cpu_gemm.c``), for a decode batch's and a prefill's rows.

    Raises:
        ValueError: ``x`` not ``[rows, k]`` float32, or a weight :func:`blocked_available` refuses.
    """
    if not blocked_available(blocked) or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != blocked.shape[1]:
        raise ValueError(f"blocked gemm: x [rows, k] float32 against a float32 blocked [n/16, k, 16] weight; got x "
                         f"{x.dtype} {tuple(x.shape)}, weight {None if blocked is None else blocked.dtype} "
                         f"{None if blocked is None else tuple(blocked.shape)}")
    return bind_blocked(blocked)(x.contiguous())


def bind_blocked(blocked: torch.Tensor):
    """:func:`blocked_gemm` for this one weight with its checks done once: ``run(x [rows, k] contiguous float32)
    -> [rows, n]``.

    Raises:
        ValueError: a weight :func:`blocked_available` refuses.
    """
    if not blocked_available(blocked):
        raise ValueError(f"blocked gemm: cannot take a {blocked.dtype} weight {tuple(blocked.shape)}")
    fn, wp = getattr(cpu_library.load(), BLOCKED_KERNEL), blocked.data_ptr()
    n, k = blocked.shape[0] * 16, blocked.shape[1]

    def run(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], n)
        if x.shape[0]:
            fn(x.data_ptr(), x.shape[0], k, wp, n, y.data_ptr(), torch.get_num_threads())
        return y
    run.blocked = blocked  # the weight lives as long as the call that reads it through wp (not only the layer's)
    return run
