"""The "blocked" bfloat16 weight layout: ``[n / 16, k / 2, 16, 2]``, the operand order of AVX512-BF16's
``vdpbf16ps`` (``cpu_blocked.c``, built by :mod:`tpengine.backends.cpu.cpu_library`).

A third layout beside the plain row-major weight and oneDNN's packed one
(:mod:`tpengine.backends.cpu.linear_layout` measures all three per weight shape and keeps one): a
one-row GEMV on it reads the weight as a single stream with no horizontal sums, and it is ours, so a
mixture-of-experts block can run its routed experts' GEMVs in one call
(:mod:`tpengine.backends.cpu.cpu_moe`). The layer keeps it in ``packed`` (a 4-dimensional bfloat16
tensor there is this layout, :func:`is_blocked`; oneDNN's is 2-dimensional): one copy of the weight,
never beside the plain one.
"""

from __future__ import annotations

import torch

from tpengine.backends.cpu import cpu_library

KERNELS = ("tpe_blocked_pack_bf16", "tpe_blocked_gemm_bf16", "tpe_blocked_group_bf16", "tpe_blocked_moe_down_bf16")


def available(weight: torch.Tensor) -> bool:
    """Whether a plain ``weight [n, k]`` can take the layout: bfloat16 on the CPU, ``n % 16 == 0``,
    ``k % 2 == 0``, and the library has the kernels (AVX512-BF16 builds only)."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0 and cpu_library.has(*KERNELS))


def is_blocked(t: torch.Tensor | None) -> bool:
    """Whether a layer's ``packed`` tensor is this layout (``[n / 16, k / 2, 16, 2]`` bfloat16)."""
    return t is not None and t.dim() == 4 and t.dtype == torch.bfloat16 and tuple(t.shape[2:]) == (16, 2)


def shape(blocked: torch.Tensor) -> tuple[int, int]:
    """The plain weight's ``(n, k)``."""
    return blocked.shape[0] * 16, blocked.shape[1] * 2


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [n, k]`` (see :func:`available`) in the blocked layout, a new ``[n / 16, k / 2, 16, 2]`` tensor.

    Raises:
        ValueError: a weight :func:`available` refuses.
    """
    if not available(weight):
        raise ValueError(f"blocked layout: a contiguous CPU bfloat16 [n, k] weight with n % 16 == 0 and k even, "
                         f"and an AVX512-BF16 build; got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    w = weight.detach().contiguous()
    n, k = w.shape
    out = torch.empty(n // 16, k // 2, 16, 2, dtype=torch.bfloat16)
    cpu_library.load().tpe_blocked_pack_bf16(w.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def unpack(blocked: torch.Tensor) -> torch.Tensor:
    """The plain ``[n, k]`` weight back (tests, and reading a weight out)."""
    n, k = shape(blocked)
    return blocked.permute(0, 2, 1, 3).reshape(n, k)


def rows(blocked: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[...]``, each in ``[0, n)``) of the plain weight, ``[..., k]``, gathered from the
    blocked tensor (row ``r`` is ``blocked[r // 16, :, r % 16, :]``): a tied embedding's lookup when its
    table is held in this layout only (the LM head's), bit-equal to ``F.embedding`` on the plain weight."""
    got = blocked[ids.div(16, rounding_mode="floor"), :, ids.remainder(16), :]  # [..., k / 2, 2]
    return got.reshape(*ids.shape, blocked.shape[1] * 2)


def linear(x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """``x [rows, k] @ weight.T -> [rows, n]`` in bfloat16 (float32 sums, rounded once), any ``rows``.

    Raises:
        ValueError: ``x`` not bfloat16 ``[rows, k]``, or ``blocked`` not this layout.
    """
    if not is_blocked(blocked) or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != shape(blocked)[1]:
        raise ValueError(f"blocked linear: x bfloat16 [rows, k] against a [n/16, k/2, 16, 2] weight; got x {x.dtype} "
                         f"{tuple(x.shape)}, weight {blocked.dtype} {tuple(blocked.shape)}")
    return bind(blocked)(x.contiguous())


def bind(blocked: torch.Tensor):
    """``run(x [rows, k] contiguous bfloat16) -> [rows, n]`` for this blocked weight (checks done once)."""
    fn, (n, k), wp = cpu_library.load().tpe_blocked_gemm_bf16, shape(blocked), blocked.data_ptr()

    def run(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        if x.shape[0]:
            fn(x.data_ptr(), x.shape[0], k, wp, n, y.data_ptr(), torch.get_num_threads())
        return y
    run.c_spec = ("lin", "tpe_blocked_gemm_bf16", k, wp, n)  # its call in a decode program (cpu_program)
    return run
