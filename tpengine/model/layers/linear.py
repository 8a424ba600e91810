"""Column- and row-parallel linear layers (Megatron-LM, Shoeybi et al. 2019).

Weights are created empty (on ``device``, default meta) in their local shapes; the loader fills
them from this rank's slice, cut by :class:`tpengine.model.plan.ShardPlan`.

On CPU the loader may :meth:`pack` a layer once its weight is loaded: the weight is replaced by
its oneDNN blocked layout, multiplied through oneDNN's matmul (PyTorch's float32 ``F.linear``
goes through MKL's sgemm, which on non-Intel CPUs takes a narrower code path; a prepacked
bfloat16 weight saves the per-call reorder). Measured figures: docs/notes/kernels.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpengine.backends.cpu import cpu_gemm, cpu_gemv
from tpengine.backends.cpu.linear_layout import kernel_at
from tpengine.model.layers.comm import all_reduce


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight [out, in]`` reordered for oneDNN's CPU matmul, or None where that is not available
    (not a CPU float32/bfloat16 tensor, no oneDNN, no bfloat16 support in this CPU)."""
    mkldnn = torch.ops.mkldnn
    if (weight.device.type != "cpu" or not torch.backends.mkldnn.is_available()
            or not hasattr(mkldnn, "_reorder_linear_weight") or not hasattr(mkldnn, "_linear_pointwise")):
        return None
    if weight.dtype == torch.bfloat16 and not mkldnn._is_mkldnn_bf16_supported():
        return None
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    return mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None = None,
           quant: nn.Module | None = None, kernels: tuple[str, ...] = ()):
    """``x @ weight.T + bias``, through oneDNN with the ``packed`` copy of ``weight`` when there is one,
    through the ``quant`` kernel (:mod:`tpengine.quant.weights`) of a quantized weight, or,
    without a bias, through the path ``kernels`` names for ``x``'s row count
    (:func:`tpengine.backends.cpu.linear_layout.kernel_at`: :func:`tpengine.backends.cpu.cpu_gemv.gemv`,
    :func:`tpengine.backends.cpu.cpu_gemm.gemm` or ``F.linear``)."""
    if kernels and bias is None:
        path = kernel_at(kernels, x.numel() // x.shape[-1])
        if path == "gemv":
            return cpu_gemv.gemv(x, weight)
        if path == "gemm":
            return cpu_gemm.gemm(x, weight)
    if quant is not None:
        y = quant(x)
        return y + bias if bias is not None else y
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class _Packable(nn.Module):
    """A layer whose ``weight [out, in]`` may be replaced, once loaded, by its oneDNN layout
    (see the module docstring): :meth:`pack` swaps it in, and ``weight`` becomes None, so the
    layer never holds its weight twice. ``in_features`` and ``out_features`` keep the shape.
    With ``--quantization``, ``quant`` holds the weight instead (a
    :class:`~tpengine.quant.weights.QuantizedWeight`, set by
    :func:`~tpengine.quant.apply.quantize_linear`; such a layer is not packed)."""

    packed: torch.Tensor | None = None
    kernels: tuple[str, ...] = ()  # the plain weight's path per row bucket (set by the loader where measured)
    packed_bytes = 0  # the plain layout's bytes of the weight it replaced (oneDNN's may pad a little)

    def __init__(self):
        super().__init__()
        self.quant: nn.Module | None = None

    def pack(self) -> bool:
        """Replace ``weight`` by its oneDNN-layout copy (:func:`prepack`) where that is available;
        returns whether it did. During the reorder both layouts exist, for this one weight."""
        if self.weight is None or self.weight.is_meta:
            return False
        packed = prepack(self.weight)
        if packed is None:
            return False
        self.packed_bytes = self.weight.numel() * self.weight.element_size()
        self.packed, self.weight = packed, None
        return True


class ColumnParallelLinear(_Packable):
    """``y_local = x @ W_local.T + b_local``: this rank's output rows; no communication.

    Shapes: ``weight [out_local, in_features]``, ``bias [out_local]``; input ``[..., in_features]``
    -> output ``[..., out_local]``. For q/k/v the rows are those of this rank's query/KV heads.
    """

    def __init__(self, in_features: int, out_local: int, bias: bool, dtype=None, device="meta"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_local
        self.weight = nn.Parameter(torch.empty(out_local, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_local, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.quant, self.kernels)


class RowParallelLinear(_Packable):
    """``y = all_reduce(x_local @ W_local.T) + b``: this rank's input columns, summed over ranks.

    Shapes: ``weight [out_features, in_local]``, ``bias [out_features]`` (whole, added exactly
    once after the all-reduce — case C04); input ``[..., in_local]`` -> ``[..., out_features]``.
    """

    def __init__(self, in_local: int, out_features: int, bias: bool, dtype=None, device="meta"):
        super().__init__()
        self.in_features, self.out_features = in_local, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_local, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce`` False: this rank's partial sum, not all-reduced (the caller reduces it, e.g. in
        the next norm, :func:`tpengine.model.layers.comm.all_reduce_add_rms_norm`); only without a bias.

        Raises:
            ValueError: ``reduce`` False on a layer with a bias (it is added after the sum).
        """
        y = linear(x, self.weight, None, self.packed, self.quant, self.kernels)
        if not reduce:
            if self.bias is not None:
                raise ValueError("RowParallelLinear: reduce=False needs a layer without bias (the bias is added "
                                 "once, after the all-reduce)")
            return y
        y = all_reduce(y)
        return y + self.bias if self.bias is not None else y


class MergedColumnParallelLinear(_Packable):
    """Column-parallel layers that read the same input, run as one GEMM (q/k/v, gate/up).

    ``weight [sum(sizes), in_features]`` holds the parts' local weights (each this rank's
    ShardPlan slice) one after the other; the loader writes part ``i`` (named ``part_names[i]``,
    the checkpoint's leaf name, e.g. ``q_proj``) into rows ``offsets[i]:offsets[i + 1]``.
    ``bias`` likewise (all parts or none have one). Input ``[..., in_features]`` ->
    ``[..., sum(sizes)]``; the caller slices the parts.
    """

    def __init__(self, in_features: int, sizes: list[int], part_names: list[str], bias: bool, dtype=None,
                 device="meta"):
        super().__init__()
        if len(sizes) != len(part_names):
            raise ValueError(f"{len(sizes)} part sizes but {len(part_names)} part names")
        self.in_features, self.sizes, self.part_names = in_features, list(sizes), list(part_names)
        self.offsets = [0]
        for n in sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.out_features = self.offsets[-1]
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., sum(sizes)]``, the parts side by side in ``sizes`` order."""
        return linear(x, self.weight, self.bias, self.packed, self.quant, self.kernels)
