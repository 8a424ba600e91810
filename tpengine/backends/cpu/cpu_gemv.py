"""bfloat16 and float32 matrix-vector products for the few rows of a decode step, on a linear
layer's plain ``[out, in]`` weight (``cpu_gemv.c``, built by :mod:`tpengine.backends.cpu.cpu_library`).
Used for a weight shape when :mod:`tpengine.backends.cpu.linear_layout` measured it faster than
``F.linear`` and oneDNN's packed layout at those rows on this machine; the weight is the plain one
either way, so no second copy exists."""

from __future__ import annotations

import torch

from tpengine.backends.cpu import cpu_library

#: The most rows one call takes (the C code keeps 4 rows x 4 weight rows of accumulators).
MAX_ROWS = 8
#: dtype -> (the C function, the input width the kernel steps by)
_KERNELS = {torch.bfloat16: ("tpe_gemv_bf16", 32), torch.float32: ("tpe_gemv_f32", 16)}


def available(weight: torch.Tensor) -> bool:
    """Whether :func:`gemv` takes this weight: a contiguous bfloat16 (``k % 32 == 0``) or float32
    (``k % 16 == 0``) CPU ``[n, k]`` tensor, and the library has the kernel (:func:`cpu_library.has`)."""
    kernel = _KERNELS.get(weight.dtype)
    return (kernel is not None and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % kernel[1] == 0 and weight.is_contiguous() and cpu_library.has(kernel[0]))


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x [..., k]`` with at most :data:`MAX_ROWS` rows, ``weight [n, k]``
    (see :func:`available`), both bfloat16 or both float32 -> ``[..., n]`` in that dtype, float32
    accumulation.

    Raises:
        ValueError: a dtype, shape or row count it does not take.
    """
    lib = cpu_library.load()
    n, k = weight.shape
    rows = x.numel() // k if x.shape[-1] == k else -1
    if lib is None or not available(weight) or x.dtype != weight.dtype or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv: x [..., {k}] with 1..{MAX_ROWS} rows and a contiguous weight [n, k] of its dtype "
                         f"(bfloat16 with k % 32 == 0 or float32 with k % 16 == 0); got x {x.dtype} "
                         f"{tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    x2 = x.reshape(rows, k).contiguous()
    y = torch.empty(rows, n, dtype=x.dtype)
    getattr(lib, _KERNELS[x.dtype][0])(x2.data_ptr(), rows, k, weight.data_ptr(), n, y.data_ptr(),
                                       torch.get_num_threads())
    return y.reshape(*x.shape[:-1], n)


def bind(weight: torch.Tensor):
    """:func:`gemv` for this one weight with its checks done once: returns ``run(x [rows, k]
    contiguous, weight's dtype, 1 <= rows <= MAX_ROWS) -> [rows, n]`` (the caller guarantees
    the arguments: the layer's forward, :func:`tpengine.backends.cpu.linear_layout.bind_linear`).

    Raises:
        ValueError: a weight :func:`available` refuses.
    """
    if not available(weight):
        raise ValueError(f"gemv: cannot take a {weight.dtype} weight {tuple(weight.shape)}")
    fn, (n, k), wp, dtype = getattr(cpu_library.load(), _KERNELS[weight.dtype][0]), weight.shape, weight.data_ptr(), \
        weight.dtype

    def run(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], n, dtype=dtype)
        fn(x.data_ptr(), x.shape[0], k, wp, n, y.data_ptr(), torch.get_num_threads())
        return y
    run.c_spec = ("lin", _KERNELS[dtype][0], k, wp, n)  # its call in a decode program (cpu_program)
    return run
