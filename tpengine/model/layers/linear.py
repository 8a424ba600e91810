"""Column- and row-parallel linear layers (Megatron-LM, Shoeybi et al. 2019).

Weights are created empty (on ``device``, default meta) in their local shapes; the loader fills
them from this rank's slice, cut by :class:`tpengine.model.plan.ShardPlan`.

Each layer has one forward: ``x`` as ``[rows, in]`` rows through ``self.impl``, the implementation
its device's platform bound once the weight is loaded (:meth:`_Packable.bind`,
:meth:`tpengine.backends.platform.Platform.bind_model`: on the CPU the quantized kernel, oneDNN's
packed layout, tpengine's GEMV / GEMM kernels at the row counts measured faster on this machine, or
``F.linear``); unbound, the torch path (:func:`tpengine.backends.torch_ops.bind_linear`). The loader
may :meth:`pack` a layer once its weight is loaded: the weight is replaced by the layout its platform
made (the CPU's oneDNN blocked layout; the measurements behind the choice: docs/notes/kernels.md).
"""

from __future__ import annotations

import torch
from torch import nn

from tpengine.backends import torch_ops
from tpengine.comm import all_reduce


class _Packable(nn.Module):
    """A layer whose ``weight [out, in]`` may be replaced, once loaded, by its platform's layout
    (see the module docstring): :meth:`pack` swaps it in, and ``weight`` becomes None, so the
    layer never holds its weight twice. ``in_features`` and ``out_features`` keep the shape.
    With ``--quantization``, ``quant`` holds the weight instead (a
    :class:`~tpengine.model.quant.weights.QuantizedWeight`, set by
    :func:`~tpengine.model.quant.apply.quantize_linear`; such a layer is not packed)."""

    packed: torch.Tensor | None = None
    kernels: tuple[str, ...] = ()  # the plain weight's path per row bucket (set by the loader where measured)
    packed_bytes = 0  # the plain layout's bytes of the weight it replaced (oneDNN's may pad a little)

    def __init__(self):
        super().__init__()
        self.quant: nn.Module | None = None
        self.impl = None  # bound by bind(): [rows, in] -> [rows, out] (+ bias, but for a row-parallel layer)

    @property
    def impl_bias(self) -> torch.Tensor | None:
        """The bias :attr:`impl` adds: the layer's own, but None for a row-parallel layer (its bias is
        added once, after the all-reduce)."""
        return None if isinstance(self, RowParallelLinear) else self.bias

    def bind(self, impl=None):
        """Bind ``impl`` (``[rows, in] -> [rows, out]`` plus :attr:`impl_bias`: what the platform chose
        for this weight, :meth:`tpengine.backends.platform.Platform.bind_model`) or, without one, the
        torch path (:func:`tpengine.backends.torch_ops.bind_linear`); a forward before any bind binds the
        torch path on first use. Returns it."""
        self.impl = impl if impl is not None else torch_ops.bind_linear(self.weight, self.impl_bias, self.quant)
        return self.impl

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in] -> [..., out]`` through :attr:`impl` on ``x``'s rows."""
        impl = self.impl or self.bind()
        if x.dim() == 2 and x.is_contiguous():
            return impl(x)
        return impl(x.reshape(-1, x.shape[-1]).contiguous()).reshape(*x.shape[:-1], -1)

    def pack(self, prepack) -> bool:
        """Replace ``weight`` by ``prepack(weight)``, its platform's layout
        (:meth:`tpengine.backends.platform.Platform.prepack`), where that gives one; returns whether it
        did. During the reorder both layouts exist, for this one weight; a packed layer runs only what
        its platform binds."""
        if self.weight is None or self.weight.is_meta:
            return False
        packed = prepack(self.weight)
        if packed is None:
            return False
        self.packed_bytes = self.weight.numel() * self.weight.element_size()
        self.packed, self.weight, self.impl = packed, None, None
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
        return self._rows(x)


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
        the next norm, :meth:`tpengine.backends.torch_ops.TorchOps.all_reduce_add_rms_norm`); only without a bias.

        Raises:
            ValueError: ``reduce`` False on a layer with a bias (it is added after the sum).
        """
        y = self._rows(x)
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
        return self._rows(x)
