"""Half-precision weights multiplied in float32, for CPUs whose torch has no fast half-precision GEMM.

On a CPU without AVX512-BF16 (AVX2 + FMA machines: AMD Zen 2/3, most laptops and desktops) neither
oneDNN nor MKL has a bfloat16 GEMM, and torch's ``F.linear`` on bfloat16 tensors falls to its generic
loop, several times slower than its float32 GEMM on the same shape. This path keeps the weight stored
in bfloat16 (half the bytes: memory and bandwidth) and, per call, widens it into a float32 scratch
slab by slab, multiplies there with torch's float32 GEMM and rounds the result back to the
activations' dtype. The bfloat16 products are exact in float32 and the sums are float32 either way,
so the result is the half-precision GEMM's up to the order of the float32 sums.

At a few rows the widening pass costs more than the product and tpengine's GEMV kernel (widening in
registers, :mod:`tpengine.backends.cpu.cpu_gemv`) takes them; whether this path runs at a shape and
row count is measured on the machine (:mod:`tpengine.backends.cpu.linear_layout`), never assumed
from the CPU's flags. The dequantize-then-GEMM path of quantized weights and the prefill attention's
matmuls follow the same measured fact (:func:`gemm_choice`, measured when the CPU platform binds the
model and kept in its profile, never on first use inside a step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpengine.backends.cpu.measured import Choice, fastest

#: The float32 scratch one call holds at most (bytes): a weight larger than this is widened and
#: multiplied in slabs of output rows (a memory bound, not a speed setting: each slab is a full GEMM).
SCRATCH_BYTES = 16 << 20
_HALF = (torch.bfloat16, torch.float16)


def available(weight: torch.Tensor) -> bool:
    """Whether :func:`linear` takes this weight: a 2-D bfloat16 or float16 CPU tensor."""
    return weight.dtype in _HALF and weight.device.type == "cpu" and weight.dim() == 2


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x [..., in]`` and a half-precision ``weight [out, in]`` (see
    :func:`available`) -> ``[..., out]`` in ``x.dtype``, computed in float32 (float32 sums).

    Raises:
        ValueError: a weight :func:`available` refuses, or ``x`` of another width or off the CPU.
    """
    out, k = weight.shape
    if not available(weight) or x.shape[-1] != k or x.device.type != "cpu":
        raise ValueError(f"widened linear: x [..., {k}] on the CPU and a bfloat16/float16 CPU weight [out, in]; got "
                         f"x {x.dtype} {tuple(x.shape)} on {x.device}, weight {weight.dtype} {tuple(weight.shape)}")
    return _run(weight, x.reshape(-1, k)).reshape(*x.shape[:-1], out)


def _run(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The product for checked arguments: ``x [rows, in]`` -> ``[rows, out]`` in ``x.dtype``."""
    x32 = x.float()
    out, k = weight.shape
    slab = max(1, SCRATCH_BYTES // (4 * k))
    if slab >= out:
        return F.linear(x32, weight.float()).to(x.dtype)
    y = torch.empty(x.shape[0], out, dtype=x.dtype)
    for start in range(0, out, slab):
        y[:, start:start + slab] = F.linear(x32, weight[start:start + slab].float())
    return y


def bind(weight: torch.Tensor):
    """:func:`linear` for this one weight with its checks done once: ``run(x [rows, in]) -> [rows, out]``.

    Raises:
        ValueError: a weight :func:`available` refuses.
    """
    if not available(weight):
        raise ValueError(f"widened linear: cannot take a {weight.dtype} weight {tuple(weight.shape)}")
    return lambda x: _run(weight, x)


#: The product :func:`gemm_choice` times: a prefill chunk's rows through a square weight.
PROBE_SHAPE = (256, 1024, 1024)  # rows, in, out


def default_gemm(dtype: torch.dtype) -> str:
    """The half GEMM choice a busy machine takes without cached timings: ``"half"`` where oneDNN has a
    GEMM of ``dtype`` on this CPU (``torch.ops.mkldnn._is_mkldnn_bf16_supported`` /
    ``_is_mkldnn_fp16_supported``), else ``"float32"`` (torch's generic half-precision loop)."""
    mkldnn = torch.ops.mkldnn
    probe = "_is_mkldnn_bf16_supported" if dtype == torch.bfloat16 else "_is_mkldnn_fp16_supported"
    try:
        return "half" if torch.backends.mkldnn.is_available() and getattr(mkldnn, probe)() else "float32"
    except (AttributeError, RuntimeError):
        return "float32"


def gemm_choice(dtype: torch.dtype) -> Choice:
    """Whether this machine multiplies ``dtype`` (bfloat16 or float16) activations by a weight of that
    dtype faster through torch's own GEMM (``"half"``) or widened to float32 (``"float32"``,
    :func:`linear`), timed on :data:`PROBE_SHAPE` (:func:`tpengine.backends.cpu.measured.fastest`: cached
    per machine; on a busy machine without cached timings :func:`default_gemm`)."""
    rows, k, out = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=g).to(dtype), torch.randn(out, k, generator=g).to(dtype)
    return fastest(f"half gemm {str(dtype).removeprefix('torch.')} {rows}x{k}x{out}",
                   {"half": [lambda: F.linear(x, w)], "float32": [lambda: _run(w, x)]}, passes=3,
                   default=default_gemm(dtype))


def gemm_dtype(dtype: torch.dtype, choice: Choice | None) -> torch.dtype:
    """The dtype a product of ``dtype`` operands is computed in, by ``choice`` (:func:`gemm_choice`'s
    for ``dtype``): float32 where it chose the widened product, else ``dtype`` (also for float32 and
    for no choice)."""
    if dtype not in _HALF or choice is None:
        return dtype
    return torch.float32 if choice.name == "float32" else dtype
