"""The "blocked" weight layouts (``cpu_blocked.c``, built by :mod:`tpengine.backends.cpu.cpu_library`):

* bfloat16 ``[n / 16, k / 2, 16, 2]``, the operand order of AVX512-BF16's ``vdpbf16ps`` (AVX512-BF16 builds; AVX2
  builds widen each 32-byte load of pairs to float32 by a shift and a mask and FMA them, the same stream);
* float32 ``[n / 16, k, 16]``: each step of k one 64-byte line of 16 rows' weights, one FMA with ``x[k]``
  broadcast (AVX-512 and AVX2 builds; the same FMA chain on both, so the same bits).

A third layout beside the plain row-major weight and oneDNN's packed one
(:mod:`tpengine.backends.cpu.linear_layout` measures all three per weight shape and keeps one): a
one-row GEMV on it reads the weight as a single stream with no horizontal sums, and it is ours, so a
mixture-of-experts block can run its routed experts' GEMVs in one call (bfloat16,
:mod:`tpengine.backends.cpu.cpu_moe`). The layer keeps it in ``packed`` (a 4-dimensional bfloat16 or a
3-dimensional float32 tensor there is this layout, :func:`is_blocked`; oneDNN's is 2-dimensional): one copy
of the weight, never beside the plain one.
"""

from __future__ import annotations

import torch

from tpengine.backends.cpu import cpu_library

#: the bfloat16 layout's kernels (AVX512-BF16 and AVX2 builds)
KERNELS = ("tpe_blocked_pack_bf16", "tpe_blocked_gemm_bf16", "tpe_blocked_group_bf16", "tpe_blocked_moe_down_bf16")
#: the float32 layout's kernels (AVX-512 and AVX2 builds)
KERNELS_F32 = ("tpe_blocked_pack_f32", "tpe_blocked_gemm_f32")
#: dtype -> (pack, GEMM) C functions
_FNS = {torch.bfloat16: KERNELS[:2], torch.float32: KERNELS_F32}


def available(weight: torch.Tensor) -> bool:
    """Whether a plain ``weight [n, k]`` can take the layout: on the CPU, ``n % 16 == 0``, and either bfloat16
    with ``k % 2 == 0`` and the library's bfloat16 kernels, or float32 with its float32 kernels (both in
    AVX-512 (bfloat16: with AVX512-BF16) and AVX2 builds)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[0] % 16:
        return False
    if weight.dtype == torch.bfloat16:
        return weight.shape[1] % 2 == 0 and cpu_library.has(*KERNELS)
    return weight.dtype == torch.float32 and cpu_library.has(*KERNELS_F32)


def is_blocked(t: torch.Tensor | None) -> bool:
    """Whether a layer's ``packed`` tensor is this layout (``[n / 16, k / 2, 16, 2]`` bfloat16 or
    ``[n / 16, k, 16]`` float32)."""
    if t is None:
        return False
    if t.dtype == torch.bfloat16:
        return t.dim() == 4 and tuple(t.shape[2:]) == (16, 2)
    return t.dtype == torch.float32 and t.dim() == 3 and t.shape[2] == 16


def shape(blocked: torch.Tensor) -> tuple[int, int]:
    """The plain weight's ``(n, k)``."""
    return blocked.shape[0] * 16, blocked.shape[1] * (2 if blocked.dtype == torch.bfloat16 else 1)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [n, k]`` (see :func:`available`) in the blocked layout, a new ``[n / 16, k / 2, 16, 2]``
    (bfloat16) or ``[n / 16, k, 16]`` (float32) tensor.

    Raises:
        ValueError: a weight :func:`available` refuses.
    """
    if not available(weight):
        raise ValueError(f"blocked layout: a CPU [n, k] weight with n % 16 == 0, bfloat16 (k even) or float32, "
                         f"an AVX-512 or AVX2 build; got {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}, build {cpu_library.isa()}")
    w = weight.detach().contiguous()
    n, k = w.shape
    bf16 = w.dtype == torch.bfloat16
    out = torch.empty(*((n // 16, k // 2, 16, 2) if bf16 else (n // 16, k, 16)), dtype=w.dtype)
    getattr(cpu_library.load(), _FNS[w.dtype][0])(w.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def unpack(blocked: torch.Tensor) -> torch.Tensor:
    """The plain ``[n, k]`` weight back (tests, and reading a weight out)."""
    n, k = shape(blocked)
    order = (0, 2, 1, 3) if blocked.dim() == 4 else (0, 2, 1)
    return blocked.permute(*order).reshape(n, k)


def rows(blocked: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[...]``, each in ``[0, n)``) of the plain weight, ``[..., k]``, gathered from the
    blocked tensor (row ``r`` is ``blocked[r // 16, :, r % 16]``, its pairs joined in bfloat16): a tied
    embedding's lookup when its table is held in this layout only (the LM head's), bit-equal to
    ``F.embedding`` on the plain weight."""
    got = blocked[ids.div(16, rounding_mode="floor"), :, ids.remainder(16)]  # [..., k / 2, 2] or [..., k]
    return got.reshape(*ids.shape, shape(blocked)[1])


def linear(x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """``x [rows, k] @ weight.T -> [rows, n]`` in the weight's dtype (float32 sums; bfloat16 rounded once),
    any ``rows``.

    Raises:
        ValueError: ``x`` not ``[rows, k]`` of the weight's dtype, or ``blocked`` not this layout.
    """
    if (not is_blocked(blocked) or x.dtype != blocked.dtype or x.dim() != 2
            or x.shape[1] != shape(blocked)[1]):
        raise ValueError(f"blocked linear: x [rows, k] of the weight's dtype against a [n/16, k/2, 16, 2] bfloat16 "
                         f"or [n/16, k, 16] float32 weight; got x {x.dtype} {tuple(x.shape)}, weight {blocked.dtype} "
                         f"{tuple(blocked.shape)}")
    return bind(blocked)(x.contiguous())


def bind(blocked: torch.Tensor):
    """``run(x [rows, k] contiguous, the weight's dtype) -> [rows, n]`` for this blocked weight (checks done
    once); ``run.c_spec``: its call in a decode program (:mod:`tpengine.backends.cpu.cpu_program`)."""
    name, dtype = _FNS[blocked.dtype][1], blocked.dtype
    fn, (n, k), wp = getattr(cpu_library.load(), name), shape(blocked), blocked.data_ptr()

    def run(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], n, dtype=dtype)
        if x.shape[0]:
            fn(x.data_ptr(), x.shape[0], k, wp, n, y.data_ptr(), torch.get_num_threads())
        return y
    run.c_spec = ("lin", name, k, wp, n)  # its call in a decode program (cpu_program)
    return run
