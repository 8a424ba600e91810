"""Quantizing a loaded layer: a float weight into :mod:`tpengine.model.quant.weights` storage
(:func:`quantize_weight`), and a column/row-parallel linear, vocabulary-parallel embedding or LM
head into its quantized form in place (:func:`quantize_linear`, called by the loader as soon as a
rank's float slice of the weight is in; the tensor-parallel conventions are the module docstring
of :mod:`tpengine.model.quant.weights`)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tpengine.errors import UserError
from tpengine.model.quant.arith import quantize_int4, quantize_int4_coded, quantize_int8
from tpengine.model.quant.weights import Int4CodedWeight, Int4Weight, Int8Weight, QuantizedWeight, QuantScheme


def quantize_weight(w: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype,
                    absmax: torch.Tensor | None = None) -> QuantizedWeight:
    """``w [out, in]`` as ``scheme``'s storage, scales in ``dtype``; ``absmax [out]``: int8's full
    rows' absolute max (per channel only, see :func:`quantize_int8`).

    Raises:
        UserError: ``w`` not on the CPU (the kernels are torch's CPU ones).
    """
    if w.device.type != "cpu":
        raise UserError(f"--quantization {scheme.name} runs on the CPU only; the weights are on {w.device}")
    if scheme.name == "int8":
        return Int8Weight(*quantize_int8(w, dtype, absmax, scheme.group_size), scheme.group_size)
    if scheme.zero_codes:
        return Int4CodedWeight(*quantize_int4_coded(w, scheme.group_size, dtype), scheme.group_size)
    return Int4Weight(*quantize_int4(w, scheme.group_size, dtype), scheme.group_size)


def quantize_linear(layer: nn.Module, scheme: QuantScheme,
                    reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Replace the loaded float ``layer.weight [out, in]`` of a column/row-parallel linear, a
    :class:`~tpengine.model.layers.embedding.VocabParallelEmbedding` or a
    :class:`~tpengine.model.layers.embedding.ParallelLMHead` (this rank's vocabulary rows) by its
    quantized storage ``layer.quant`` (``weight`` becomes None). For a
    :class:`~tpengine.model.layers.linear.RowParallelLinear` under per-channel int8, ``reduce_max``
    (an all-reduce MAX over the tp ranks, in place) turns the slice's row absmax into the full rows'.
    A vocabulary layer's padding rows get scale (and zero) 0, as a stored folder holds them.

    Raises:
        UserError: see :func:`quantize_weight`.
    """
    from tpengine.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from tpengine.model.layers.linear import RowParallelLinear

    w = layer.weight.data
    absmax = None
    if (scheme.name == "int8" and scheme.group_size is None and isinstance(layer, RowParallelLinear)
            and reduce_max is not None):
        absmax = reduce_max(w.float().abs().amax(dim=1))
    layer.quant = quantize_weight(w, scheme, w.dtype, absmax)
    layer.weight = None
    if isinstance(layer, (VocabParallelEmbedding, ParallelLMHead)):  # padding rows: scale 0, as stored
        layer.quant.zero_rows_from(max(0, layer.vocab_size - layer.vocab_start))
    if isinstance(layer, VocabParallelEmbedding):
        layer.quant.prepare_rows()  # at load, not in the first step
