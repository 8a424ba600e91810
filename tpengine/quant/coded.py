"""W4A16 with the zero of each group stored as an int8 code (``--quantization int4``'s storage):
:class:`Int4CodedWeight`, the arithmetic in :func:`tpengine.quant.arith.quantize_int4_coded`
(docs/design.md, "Quantized weights")."""

from __future__ import annotations

import torch
from torch import nn

from tpengine.quant.arith import (
    INT4_ROW_MULTIPLE,
    _group_dequant,
    _int4_pack,
    _int4_values,
    _pad_out,
    coded_zeros,
)
from tpengine.quant.weights import Int4Weight


class Int4CodedWeight(Int4Weight):
    """W4A16 with int8 zero codes (:func:`~tpengine.quant.arith.quantize_int4_coded`): ``packed``
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

    def _kernel_scales(self) -> torch.Tensor:
        return self.scales

    def _kernel_codes(self) -> torch.Tensor:
        return self.zero_codes

    def _torch_sz(self) -> torch.Tensor:
        return torch.stack([self.scales, coded_zeros(self.scales, self.zero_codes).to(self.scales.dtype)], dim=-1)

    def _rows_f32(self, ids: torch.Tensor) -> torch.Tensor:
        q = _int4_values(self.packed, self._layout, ids, self.in_features)
        s = self.scales[:, ids]
        return _group_dequant(q - 8, s.t(), coded_zeros(s, self.zero_codes[:, ids]).t())
