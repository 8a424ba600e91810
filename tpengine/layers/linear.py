"""Column- and row-parallel linear layers (Megatron-LM, Shoeybi et al. 2019).

Weights are created empty (on ``device``, default meta) in their local shapes; the loader fills
them from this rank's slice, cut by :class:`tpengine.plan.ShardPlan`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpengine.distributed import all_reduce


class ColumnParallelLinear(nn.Module):
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
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class MergedColumnParallelLinear(nn.Module):
    """Column-parallel layers that read the same input, run as one GEMM (q/k/v, gate/up).

    ``weight [sum(sizes), in_features]`` is the concatenation of the parts' local weights (each
    already this rank's ShardPlan slice), ``bias`` likewise (all parts or none have one).
    Input ``[..., in_features]`` -> ``[..., sum(sizes)]``; the caller slices the parts.
    """

    def __init__(self, parts: list[ColumnParallelLinear]):
        super().__init__()
        if len({p.in_features for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
            raise ValueError("merged column layers need one input size and all or no biases")
        self.in_features = parts[0].in_features
        self.sizes = [p.out_features for p in parts]
        self.out_features = sum(self.sizes)
        self.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        self.bias = (None if parts[0].bias is None else
                     nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., sum(sizes)]``, the parts side by side in ``sizes`` order."""
        return F.linear(x, self.weight, self.bias)
