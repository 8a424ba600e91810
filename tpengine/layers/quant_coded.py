"""W4A16 with the zero of each group stored as an int8 code (``--quantization int4``'s storage):
:class:`Int4CodedWeight`, the arithmetic in :func:`tpengine.layers.quant_math.quantize_int4_coded`
(docs/design.md, "Quantized weights")."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tpengine.kernels import cpu_qgemv
from tpengine.layers.quant_math import (
    INT4_ROW_MULTIPLE,
    _group_dequant,
    _int4_mm,
    _int4_pack,
    _int4_values,
    _pad_out,
    coded_zeros,
)
from tpengine.layers.quantized import Int4Weight


class Int4CodedWeight(Int4Weight):
    """W4A16 with int8 zero codes (:func:`~tpengine.layers.quant_math.quantize_int4_coded`): ``packed``
    as :class:`Int4Weight`, ``scales [in / group_size, out_padded]`` and ``zero_codes`` int8 of the same
    shape, ``y = x @ ((q - 8) * scale + code * scale / 16).T``. tpengine's kernels read the codes; torch's
    kernel (more rows than ``gemv_rows`` and fewer than ``dequant_rows``, or no C kernels) gets a
    transient ``scales_and_zeros`` built per call (its zeros rounded to the scales' dtype)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zero_codes: torch.Tensor, group_size: int):
        nn.Module.__init__(self)
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        pad = -q.shape[0] % INT4_ROW_MULTIPLE
        packed, scales = _int4_pack(q, scales)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("zero_codes", _pad_out(zero_codes, pad))

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    def _torch_sz(self) -> torch.Tensor:
        return torch.stack([self.scales, coded_zeros(self.scales, self.zero_codes).to(self.scales.dtype)], dim=-1)

    def bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        if not self.gemv_rows:
            return self._many
        native = cpu_qgemv.bind_int4(self.packed, self.scales, self.group_size, self.out_features, self.zero_codes)
        limit, many = self.gemv_rows, self._many
        return lambda x: native(x) if x.shape[0] <= limit else many(x)

    def _many(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        if self.dequant_rows and x.shape[0] >= self.dequant_rows:
            wt = cpu_qgemv.dequant_int4(self.packed, self.scales, self.group_size, self.zero_codes)
            return x @ (wt if wt.shape[1] == n else wt[:, :n])
        return _int4_mm(x, self.packed, self.group_size, self._torch_sz(), n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()
        if x2.shape[0] > self.gemv_rows:
            y = self._many(x2)
        else:
            y = cpu_qgemv.int4(x2, self.packed, self.scales, self.group_size, self.out_features, self.zero_codes)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _rows_f32(self, ids: torch.Tensor) -> torch.Tensor:
        q = _int4_values(self.packed, self._layout, ids, self.in_features)
        s = self.scales[:, ids]
        return _group_dequant(q - 8, s.t(), coded_zeros(s, self.zero_codes[:, ids]).t())
