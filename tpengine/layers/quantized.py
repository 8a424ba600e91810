"""Weight-only quantized storage of the parallel linears: W8A16 (int8) and W4A16 (int4).

The loader quantizes each column/row-parallel linear's weight as soon as this rank's float slice
of it is in (:func:`quantize_linear`), and drops the float weight: only the weight being converted
is ever held in both forms. Activations stay in the model dtype (float32, bfloat16 or float16).

* int8: symmetric, one scale per output channel, ``scale = absmax(row) / 127``, ``q = round(w /
  scale)`` in ``[-127, 127]``; ``y = (x @ q.T) * scale`` through ``torch._weight_int8pack_mm``.
* int4: asymmetric, group-wise along the input dimension (``group_size`` consecutive input columns
  of one output row share a scale and a zero; 32 for ``--quantization int4``, 128 possible), in the
  "mid" convention of torch's CPU kernel and gpt-fast's ``quantize.py`` (``get_group_qparams``):
  ``scale = (max - min) / 15``, ``zero = min + 8 * scale``, ``q = round((w - zero) / scale + 8)`` in
  ``[0, 15]``, ``w ~ (q - 8) * scale + zero``; through ``torch.ops.aten._weight_int4pack_mm_for_cpu``
  on the layout of ``_convert_weight_to_int4pack_for_cpu``.

Tensor parallelism: quantization is a function of one output row (int8) or one group (int4) only,
so a rank's quantized slice is bit for bit the same slice of the tp=1 quantized weight:

* a column split takes whole output rows, with their scales (and zeros);
* a row split cuts the input dimension: for int4 every rank's input range must start on a group
  boundary (:func:`check_quantization` refuses a tp where it does not); for int8 the per-row
  ``absmax`` is of the FULL row, the max over the ranks of their slices' absmax (the loader passes
  an all-reduce MAX), never of the rank's slice alone.

The LM head and the embeddings are not quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from tpengine.config import QUANTIZATIONS  # the values of EngineConfig.quantization besides None
from tpengine.errors import UserError

__all__ = ["QUANTIZATIONS", "QuantScheme", "QuantizedWeight", "check_quantization", "quantize_linear"]
#: Group size of ``--quantization int4`` (input columns per scale/zero).
INT4_GROUP_SIZE = 32
#: Group sizes torch's CPU int4 kernel takes.
INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class QuantScheme:
    """One weight-only scheme: ``name`` "int8" (per output channel, ``group_size`` None) or "int4"
    (``group_size`` input columns per scale and zero)."""

    name: str
    group_size: int | None = None

    @classmethod
    def of(cls, name: str, group_size: int | None = None) -> QuantScheme:
        """The scheme named ``name`` (one of :data:`QUANTIZATIONS`); int4's ``group_size``
        defaults to :data:`INT4_GROUP_SIZE`.

        Raises:
            ValueError: an unknown name or an int4 group size not in :data:`INT4_GROUP_SIZES`.
        """
        if name not in QUANTIZATIONS:
            raise ValueError(f"invalid quantization {name!r}: must be one of {', '.join(QUANTIZATIONS)}")
        if name == "int8":
            return cls("int8", None)
        group = INT4_GROUP_SIZE if group_size is None else group_size
        if group not in INT4_GROUP_SIZES:
            raise ValueError(f"invalid int4 group size {group!r}: must be one of "
                             f"{', '.join(map(str, INT4_GROUP_SIZES))}")
        return cls("int4", group)


# ---------------------------------------------------------------------------------- int8
def quantize_int8(w: torch.Tensor, dtype: torch.dtype, absmax: torch.Tensor | None = None):
    """Symmetric per-output-channel int8 of ``w [out, in]``: ``(q int8 [out, in], scales [out] in
    dtype)``, ``scale = absmax / 127`` (1 for an all-zero row), ``q = round(w / scale)`` clamped to
    ``[-127, 127]``, computed with the stored (``dtype``) scale. ``absmax [out]`` (float32) is the
    rows' absolute max, default ``w``'s own; give the full rows' for a slice of a row-parallel layer."""
    w32 = w.float()
    if absmax is None:
        absmax = w32.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax)).to(dtype)
    q = torch.round(w32 / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 ``[out, in]`` weight ``q * scale`` (the reference for the int8 kernel)."""
    return q.float() * scales.float()[:, None]


# ---------------------------------------------------------------------------------- int4
def quantize_int4(w: torch.Tensor, group_size: int, dtype: torch.dtype):
    """Asymmetric group-wise int4 of ``w [out, in]`` (``in`` a multiple of ``group_size``):
    ``(q int32 [out, in] in 0..15, scales_and_zeros [in / group_size, out, 2] in dtype)``, per
    group ``scale = max(max - min, 1e-6) / 15``, ``zero = min + 8 * scale`` (gpt-fast's
    ``get_group_qparams``), ``q = round((w - zero) / scale + 8)`` clamped to ``[0, 15]`` with the
    stored (``dtype``) scale and zero.

    Raises:
        ValueError: ``in`` not a multiple of ``group_size``.
    """
    out, k = w.shape
    if k % group_size:
        raise ValueError(f"int4: {k} input columns are not a multiple of the group size {group_size}")
    g = w.float().reshape(out, k // group_size, group_size)
    mx, mn = g.amax(dim=-1), g.amin(dim=-1)
    scales = ((mx - mn).clamp(min=1e-6) / 15).to(dtype)
    zeros = (mn + 8 * scales.float()).to(dtype)
    q = torch.round((g - zeros.float()[..., None]) / scales.float()[..., None] + 8).clamp_(0, 15)
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    return q.reshape(out, k).to(torch.int32), sz


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 ``[out, in]`` weight ``(q - 8) * scale + zero`` of ``q [out, in]`` (0..15) and
    ``scales_and_zeros [in / group_size, out, 2]`` (the reference for the int4 kernel)."""
    out, k = q.shape
    sz = scales_and_zeros.float().transpose(0, 1)  # [out, groups, 2]
    g = q.float().reshape(out, k // group_size, group_size)
    return ((g - 8) * sz[..., :1] + sz[..., 1:]).reshape(out, k)


# ------------------------------------------------------------------------------- storage
class QuantizedWeight(nn.Module):
    """A linear layer's quantized weight ``[out_features, in_features]``: ``forward(x [..., in])
    -> [..., out]`` in ``x``'s dtype (the model dtype its scales are stored in); ``nbytes``, the
    bytes held. Built by :func:`quantize_weight`; CPU only."""

    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


class Int8Weight(QuantizedWeight):
    """W8A16: ``qweight int8 [out, in]``, ``scales [out]``; ``y = (x @ qweight.T) * scales``."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", scales.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features).contiguous(), self.qweight, self.scales)
        return y.reshape(*x.shape[:-1], self.out_features)


#: The CPU int4 kernel's output rows come in multiples of this (a layer's are padded up to it).
INT4_ROW_MULTIPLE = 16


class Int4Weight(QuantizedWeight):
    """W4A16: ``packed`` (``_convert_weight_to_int4pack_for_cpu`` of the 0..15 values, two per
    byte), ``scales_and_zeros [in / group_size, out_padded, 2]``; ``y = x @ ((q - 8) * scale + zero).T``.
    The kernel takes output rows in multiples of :data:`INT4_ROW_MULTIPLE`: other counts are
    padded with zero rows (scale 0), and the padding is cut off the output."""

    def __init__(self, q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        pad = -self.out_features % INT4_ROW_MULTIPLE
        if pad:
            q = torch.cat([q, q.new_zeros(pad, self.in_features)])
            scales_and_zeros = torch.cat([scales_and_zeros, scales_and_zeros.new_zeros(
                scales_and_zeros.shape[0], pad, 2)], dim=1)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1))
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features).contiguous(), self.packed,
                                                       self.group_size, self.scales_and_zeros)
        if y.shape[-1] != self.out_features:
            y = y[:, :self.out_features]
        return y.reshape(*x.shape[:-1], self.out_features)


def quantize_weight(w: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype,
                    absmax: torch.Tensor | None = None) -> QuantizedWeight:
    """``w [out, in]`` as ``scheme``'s storage, scales in ``dtype``; ``absmax [out]``: int8's full
    rows' absolute max (see :func:`quantize_int8`).

    Raises:
        UserError: ``w`` not on the CPU (the kernels are torch's CPU ones).
    """
    if w.device.type != "cpu":
        raise UserError(f"--quantization {scheme.name} runs on the CPU only; the weights are on {w.device}")
    if scheme.name == "int8":
        return Int8Weight(*quantize_int8(w, dtype, absmax))
    return Int4Weight(*quantize_int4(w, scheme.group_size, dtype), scheme.group_size)


def quantize_linear(layer: nn.Module, scheme: QuantScheme,
                    reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Replace the loaded float ``layer.weight [out, in]`` of a column/row-parallel linear by its
    quantized storage ``layer.quant`` (``weight`` becomes None). For a
    :class:`~tpengine.layers.linear.RowParallelLinear` under int8, ``reduce_max`` (an all-reduce
    MAX over the tp ranks, in place) turns the slice's row absmax into the full rows'.

    Raises:
        UserError: see :func:`quantize_weight`.
    """
    from tpengine.layers.linear import RowParallelLinear

    w = layer.weight.data
    absmax = None
    if scheme.name == "int8" and isinstance(layer, RowParallelLinear) and reduce_max is not None:
        absmax = reduce_max(w.float().abs().amax(dim=1))
    layer.quant = quantize_weight(w, scheme, w.dtype, absmax)
    layer.weight = None


# ------------------------------------------------------------------------------ the split
def _row_boundaries(plan: Any) -> dict[str, list[int]]:
    """Leaf name of each row-parallel layer -> every rank's input start and end under ``plan``."""
    hd = plan.head_dim
    return {"self_attn.o_proj": sorted({b * hd for r in plan.ranks for b in r.q_heads}),
            "mlp.down_proj": sorted({b for r in plan.ranks for b in r.intermediate})}


def check_quantization(hf_config: Any, tp_size: int, scheme: QuantScheme) -> None:
    """Refuse, before any weight is read, an int4 ``scheme`` whose groups the tp split would cut:
    every linear's input size (hidden for q/k/v and gate/up; the heads' and the intermediate
    size for o_proj and down_proj) must be a multiple of the group size, and each rank's input
    range of o_proj and down_proj (from :class:`tpengine.plan.ShardPlan`) must start on a group
    boundary. int8 always fits.

    Raises:
        UserError: naming the layer, the group size, this tp and the valid tp sizes.
    """
    from tpengine.plan import ShardPlan

    if scheme.group_size is None:
        return
    g = scheme.group_size
    d = ShardPlan.dims(hf_config)
    sizes = {"self_attn.q_proj/k_proj/v_proj, mlp.gate_proj/up_proj": d["hidden_size"],
             "self_attn.o_proj": d["num_heads"] * d["head_dim"], "mlp.down_proj": d["intermediate_size"]}
    for layer, n in sizes.items():
        if n % g:
            raise UserError(f"--quantization {scheme.name} (group size {g}): {layer} has {n} input features, "
                            f"not a multiple of {g}; this model cannot be quantized with group size {g} at any tp")

    def bad_layer(tp: int) -> tuple[str, int] | None:
        for layer, bounds in _row_boundaries(ShardPlan.build(hf_config, tp)).items():
            for b in bounds:
                if b % g:
                    return layer, b
        return None

    found = bad_layer(tp_size)
    if found is None:
        return
    layer, b = found
    valid = [t for t in ShardPlan.valid_tp_sizes(hf_config) if bad_layer(t) is None]
    raise UserError(f"--quantization {scheme.name} (group size {g}) at tp={tp_size}: the row-parallel layer "
                    f"{layer} splits its input at column {b}, not on a group boundary (a multiple of {g}); "
                    f"valid tp sizes: {', '.join(map(str, valid))}")
