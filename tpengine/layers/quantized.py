"""Weight-only quantized storage: W8A16 (int8) and W4A16 (int4) of the parallel linears, the
vocabulary-parallel embedding and the LM head.

The loader quantizes each column/row-parallel linear's weight, and the embedding's and LM head's
vocabulary rows, as soon as this rank's float slice of it is in (:func:`quantize_linear`), and
drops the float weight: only the weight being converted is ever held in both forms. Activations
stay in the model dtype (float32, bfloat16 or float16). Every :class:`QuantizedWeight` multiplies
(``forward``) and hands out dequantized rows (``rows``, the embedding lookup: the same stored
values the matmul reads, so a tied embedding and LM head share ONE quantized table).

* int8, per output channel: symmetric, ``scale = absmax(row) / 127``, ``q = round(w / scale)`` in
  ``[-127, 127]``; ``y = (x @ q.T) * scale`` through ``torch._weight_int8pack_mm``.
* int8, grouped (``group_size`` g consecutive input columns of a row share a scale, as GGUF's
  Q8_0 with g = 32): ``w = q * scale``. torch has no grouped int8 kernel, so the byte is split in
  two nibbles, ``q = lo + 16 * (hi - 8)`` (``lo = q & 15``, ``hi = (q >> 4) + 8``, both 0..15), and
  ``y`` is the sum of two int4 products: ``lo`` with scale ``s`` and zero ``8 s``, ``hi`` with
  scale ``16 s`` and zero 0 (exact: ``(lo - 8) s + 8 s + (hi - 8) 16 s = q s``).
* int4: asymmetric, group-wise along the input dimension (``group_size`` consecutive input columns
  of one output row share a scale and a zero; 32 for ``--quantization int4``, 64, 128, 256
  possible), in the "mid" convention of torch's CPU kernel and gpt-fast's ``quantize.py``
  (``get_group_qparams``): ``scale = (max - min) / 15``, ``zero = min + 8 * scale``,
  ``q = round((w - zero) / scale + 8)`` in ``[0, 15]``, ``w ~ (q - 8) * scale + zero``; through
  ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on the layout of
  ``_convert_weight_to_int4pack_for_cpu`` (rows are read back out of that layout for a lookup,
  see :func:`int4_pack_layout`).

Under ``--quantization int8`` and ``int4`` the embedding / LM head is int8 per output channel
(``QuantScheme.vocab``; a scheme built directly may choose another, e.g. int4 with group
:data:`INT4_VOCAB_GROUP_SIZE`, or None to keep them in float). Not int4 under ``int4``: the
tied SmolLM2 table has outlier columns, and an int4 head cost +6% perplexity against +0.2% for
int8 (docs/notes/quantized-head.md).

Tensor parallelism: quantization is a function of one output row (int8) or one group (grouped
int8, int4) only, so a rank's quantized slice is bit for bit the same slice of the tp=1
quantized weight:

* a column split (and the vocabulary split) takes whole output rows, with their scales (and
  zeros); vocabulary padding rows are zero, and quantize to zero with scale (and zero) 0, as a
  stored folder (:mod:`tpengine.quant_checkpoint`) holds them;
* a row split cuts the input dimension: for grouped schemes every rank's input range must start
  on a group boundary (:func:`check_quantization` refuses a tp where it does not); for int8 per
  channel the per-row ``absmax`` is of the FULL row, the max over the ranks of their slices'
  absmax (the loader passes an all-reduce MAX), never of the rank's slice alone.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from tpengine.config import QUANTIZATIONS  # the values of EngineConfig.quantization besides None
from tpengine.errors import UserError

__all__ = ["QUANTIZATIONS", "Int4Weight", "Int8Weight", "QuantScheme", "QuantizedWeight", "check_quantization",
           "quantize_linear"]
#: Group size of ``--quantization int4`` (input columns per scale/zero).
INT4_GROUP_SIZE = 32
#: Group size of the embedding / LM head under ``--quantization int4`` (see docs/design.md).
INT4_VOCAB_GROUP_SIZE = 32
#: Group sizes torch's CPU int4 kernel takes (and so grouped int8, made of two int4 products).
INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class QuantScheme:
    """One weight-only scheme: ``name`` "int8" (``group_size`` None: per output channel, or input
    columns per scale) or "int4" (``group_size`` input columns per scale and zero); ``vocab``, the
    scheme of the vocabulary-parallel embedding and LM head (None: they stay in float)."""

    name: str
    group_size: int | None = None
    vocab: QuantScheme | None = None

    @classmethod
    def of(cls, name: str, group_size: int | None = None) -> QuantScheme:
        """The scheme named ``name`` (one of :data:`QUANTIZATIONS`), as ``--quantization``
        stores it: int4's ``group_size`` defaults to :data:`INT4_GROUP_SIZE`, int8's to per
        output channel; ``vocab`` is int8 per channel for both (see the module docstring).

        Raises:
            ValueError: an unknown name or a group size not in :data:`INT4_GROUP_SIZES`.
        """
        if name not in QUANTIZATIONS:
            raise ValueError(f"invalid quantization {name!r}: must be one of {', '.join(QUANTIZATIONS)}")
        sizes = ", ".join(map(str, INT4_GROUP_SIZES))
        if name == "int8":
            if group_size is not None and group_size not in INT4_GROUP_SIZES:
                raise ValueError(f"invalid int8 group size {group_size!r}: must be unset (per output channel) "
                                 f"or one of {sizes}")
            return cls("int8", group_size, cls("int8", None))
        group = INT4_GROUP_SIZE if group_size is None else group_size
        if group not in INT4_GROUP_SIZES:
            raise ValueError(f"invalid int4 group size {group!r}: must be one of {sizes}")
        return cls("int4", group, cls("int8", None))


# ---------------------------------------------------------------------------------- int8
def quantize_int8(w: torch.Tensor, dtype: torch.dtype, absmax: torch.Tensor | None = None,
                  group_size: int | None = None):
    """Symmetric int8 of ``w [out, in]``: ``(q int8 [out, in], scales in dtype)``, per output
    channel (``group_size`` None: ``scales [out]``) or per ``group_size`` input columns
    (``scales [out, in / group_size]``); ``scale = absmax / 127`` (1 for an all-zero row or
    group), ``q = round(w / scale)`` clamped to ``[-127, 127]``, computed with the stored
    (``dtype``) scale. ``absmax [out]`` (float32, per channel only) is the rows' absolute max,
    default ``w``'s own; give the full rows' for a slice of a row-parallel layer.

    Raises:
        ValueError: ``in`` not a multiple of ``group_size``.
    """
    out, k = w.shape
    w32 = w.float()
    if group_size is not None:
        if k % group_size:
            raise ValueError(f"int8: {k} input columns are not a multiple of the group size {group_size}")
        w32 = w32.reshape(out, k // group_size, group_size)
    if absmax is None:
        absmax = w32.abs().amax(dim=-1)
    scales = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax)).to(dtype)
    q = torch.round(w32 / scales.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(out, k), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 ``[out, in]`` weight ``q * scale`` of ``q [out, in]`` and ``scales [out]``
    (per channel) or ``[out, in / g]`` (grouped): the reference for the int8 kernels."""
    out, k = q.shape
    s = scales.float().reshape(out, -1)
    return (q.float().reshape(out, s.shape[1], -1) * s[..., None]).reshape(out, k)


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
    sz = scales_and_zeros.float()[:, :out].transpose(0, 1)  # [out, groups, 2]
    g = q.float().reshape(out, k // group_size, group_size)
    return ((g - 8) * sz[..., :1] + sz[..., 1:]).reshape(out, k)


#: The CPU int4 kernel's output rows come in multiples of this (a layer's are padded up to it).
INT4_ROW_MULTIPLE = 16


def _int4_pack(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scales_and_zeros)`` for the CPU int4 kernel of ``q int32 [out, in]`` (0..15) and
    ``scales_and_zeros [in / g, out, 2]``, rows padded with zeros (scale 0) to a multiple of
    :data:`INT4_ROW_MULTIPLE`."""
    out, k = q.shape
    pad = -out % INT4_ROW_MULTIPLE
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scales_and_zeros = torch.cat([scales_and_zeros, scales_and_zeros.new_zeros(
            scales_and_zeros.shape[0], pad, 2)], dim=1)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1), scales_and_zeros.contiguous()


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor,
             out_features: int) -> torch.Tensor:
    """``x [M, in] @ w.T -> [M, out_features]`` of a :func:`_int4_pack` weight (padding cut off)."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)
    return y if y.shape[-1] == out_features else y[:, :out_features]


@dataclass(frozen=True)
class Int4PackLayout:
    """Where ``_convert_weight_to_int4pack_for_cpu`` (this torch build, this CPU's capability)
    puts value ``(n, k)`` of a ``[rows, in]`` matrix, two values a byte: rows come in blocks of
    ``block`` (the last one ``tail`` rows, 0 when ``rows`` is a multiple of ``block``); a block
    of ``nb`` rows takes ``nb * in / 2`` consecutive bytes, column by column (``nb / 2`` bytes a
    column), row ``r`` of a full block at byte ``pos[r]`` of each column, in the nibble at bit
    ``shift[r]`` (0 or 4); ``tail_pos``/``tail_shift`` likewise for the last, shorter block."""

    rows: int
    block: int
    pos: torch.Tensor
    shift: torch.Tensor
    tail_pos: torch.Tensor
    tail_shift: torch.Tensor

    @property
    def tail(self) -> int:
        return self.tail_pos.numel()

    def byte_index(self, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bytes [M, k] int64, shifts [M, 1])``: the byte of every value of rows ``ids [M]``
        of a ``[rows, k]`` matrix's packed form, and each row's nibble."""
        blk, r = ids // self.block, ids % self.block
        pos, shift, stride = self.pos[r], self.shift[r], torch.full_like(ids, self.block // 2)
        if self.tail:
            in_tail = blk == self.rows // self.block
            rt = r.clamp(max=self.tail - 1)
            pos = torch.where(in_tail, self.tail_pos[rt], pos)
            shift = torch.where(in_tail, self.tail_shift[rt], shift)
            stride = torch.where(in_tail, self.tail // 2, stride)
        start = blk * (self.block * k // 2) + pos
        return start[:, None] + torch.arange(k) * stride[:, None], shift[:, None]


def int4_pack_layout(rows: int) -> Int4PackLayout:
    """Learn the packed layout of ``rows`` rows (a multiple of :data:`INT4_ROW_MULTIPLE`) from
    the packing function itself: pack two-column probes whose values spell out each row's
    index (base 16) and its column, see where every value went, and check the layout on a
    random ``[rows, 64]`` matrix. Above 1024 rows it is learnt and checked on ``512 + rows %
    512`` rows (the same blocks, fewer of them), then checked on random ``[rows, 2]`` values.
    (torch's layout depends on the CPU capability: 64-row blocks with AVX512, 32 with AVX2.)

    Raises:
        RuntimeError: the packing does not follow the column-by-column block structure read here.
    """
    if rows > 1024:
        layout = dataclasses.replace(int4_pack_layout(512 + rows % 512), rows=rows)
        _check_int4_layout(layout, 2)
        return layout
    pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    n = torch.arange(rows)

    def where(values: torch.Tensor) -> torch.Tensor:  # the value held by every nibble slot
        b = pack(values.to(torch.int32).contiguous(), 1).reshape(-1).long()
        return torch.stack([b & 15, b >> 4], dim=-1).reshape(-1)  # slot = 2 * byte + (high nibble)

    row = torch.zeros(2 * rows, dtype=torch.long)
    for d in range(max(1, ((rows - 1).bit_length() + 3) // 4)):
        digit = (n >> (4 * d)) & 15
        row += where(torch.stack([digit, digit], dim=1)) << (4 * d)
    col = where(torch.stack([torch.zeros_like(n), torch.ones_like(n)], dim=1))
    slot = torch.empty(rows, 2, dtype=torch.long)
    slot[row, col] = torch.arange(2 * rows)
    byte0, shift = slot[:, 0] // 2, (slot[:, 0] % 2) * 4
    block = int((slot[:, 1] // 2 - byte0).max()) * 2
    pos = byte0 - (n // block) * block
    full = rows // block * block
    layout = Int4PackLayout(rows, block, pos[:block], shift[:block], pos[full:], shift[full:])
    _check_int4_layout(layout, 64)
    return layout


def _check_int4_layout(layout: Int4PackLayout, k: int) -> None:
    """Raise RuntimeError unless ``layout`` reads a random ``[rows, k]`` matrix back out of its packed form."""
    probe = torch.randint(0, 16, (layout.rows, k), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    if layout.tail % 2 or not torch.equal(_int4_values(packed, layout, torch.arange(layout.rows), k), probe):
        raise RuntimeError(f"torch's int4 packed layout ({torch.__version__}, CPU capability "
                           f"{torch.backends.cpu.get_cpu_capability()}) is not the block layout tpengine reads "
                           f"embedding rows from; keep the embedding unquantized (QuantScheme vocab None)")


def _int4_values(packed: torch.Tensor, layout: Int4PackLayout, ids: torch.Tensor, k: int) -> torch.Tensor:
    """The 0..15 values ``int32 [M, k]`` of rows ``ids [M]`` of a :func:`_int4_pack` weight."""
    index, shift = layout.byte_index(ids, k)
    return (packed.reshape(-1)[index].int() >> shift.int()) & 15


def _group_dequant(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> torch.Tensor:
    """float32 ``q * scale (+ zero)`` of ``q [M, in]`` and per-group ``scales``/``zeros [M, groups]``."""
    m, k = q.shape
    w = q.float().reshape(m, scales.shape[1], -1) * scales.float()[..., None]
    if zeros is not None:
        w = w + zeros.float()[..., None]
    return w.reshape(m, k)


# ------------------------------------------------------------------------------- storage
class QuantizedWeight(nn.Module):
    """A quantized weight ``[out_features, in_features]`` (a linear's, or the vocabulary rows of
    an embedding / LM head): ``forward(x [..., in]) -> [..., out]`` in ``x``'s dtype (the model
    dtype its scales are stored in); ``rows(ids [...]) -> [..., in]``, the dequantized rows
    ``ids`` in that dtype (an embedding lookup); ``dequantize()``, the whole float32 weight;
    ``nbytes``, the bytes held. Built by :func:`quantize_weight`; CPU only."""

    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @property
    def dtype(self) -> torch.dtype:
        raise NotImplementedError

    def _rows_f32(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def prepare_rows(self) -> None:
        """Do now (at load) what the first :meth:`rows` would (learn int4's packed layout)."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self._rows_f32(flat).to(self.dtype).reshape(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self._rows_f32(torch.arange(self.out_features))

    def zero_rows_from(self, start: int) -> None:
        """Set the scales (and zeros) of output rows ``start..`` to zero, in place: vocabulary
        padding rows (their values are 0 already) as a stored folder holds them."""
        for name, b in self.named_buffers():
            if "scales" in name:
                (b[start:] if b.dim() == 1 else b[:, start:]).zero_()


class Int8Weight(QuantizedWeight):
    """W8A16, ``w = q * scale`` of ``q int8 [out, in]`` and ``scales``.

    Per output channel (``group_size`` None or ``in``; ``scales [out]`` or ``[out, 1]``): buffers
    ``qweight``, ``scales [out]``; ``y = (x @ qweight.T) * scales`` (``torch._weight_int8pack_mm``).
    Grouped (``scales [out, in / group_size]``, ``group_size`` one of :data:`INT4_GROUP_SIZES`):
    the two nibbles of ``q`` as two int4 weights (module docstring), buffers ``packed_lo``,
    ``packed_hi`` and ``scales_and_zeros_lo``/``_hi [in / group_size, out_padded, 2]``.

    Raises:
        ValueError: ``q`` not int8 2-D, ``scales`` of another shape, or a group size that does
            not divide ``in`` or is not one of :data:`INT4_GROUP_SIZES`.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, group_size: int | None = None):
        super().__init__()
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"Int8Weight: q must be a 2-D int8 tensor, not {q.dtype} of shape {list(q.shape)}")
        self.out_features, self.in_features = out, k = q.shape
        self.group_size = None if group_size in (None, k) else group_size
        g = self.group_size
        if g is None:
            if scales.numel() != out or scales.shape[0] != out:
                raise ValueError(f"Int8Weight: per-channel scales must be [{out}] or [{out}, 1], "
                                 f"not {list(scales.shape)}")
            self.register_buffer("qweight", q.contiguous())
            self.register_buffer("scales", scales.reshape(out).contiguous())
            return
        if g not in INT4_GROUP_SIZES or k % g:
            raise ValueError(f"Int8Weight: group size {g} must divide the {k} input columns and be one of "
                             f"{', '.join(map(str, INT4_GROUP_SIZES))}")
        if tuple(scales.shape) != (out, k // g):
            raise ValueError(f"Int8Weight: scales must be [{out}, {k // g}] for group size {g}, "
                             f"not {list(scales.shape)}")
        qi = q.int()
        s = scales.t()  # [groups, out]
        lo = torch.stack([s, 8 * s], dim=-1)
        hi = torch.stack([16 * s, torch.zeros_like(s)], dim=-1)
        for name, values, sz in (("lo", qi & 15, lo), ("hi", (qi >> 4) + 8, hi)):
            packed, sz = _int4_pack(values, sz)
            self.register_buffer(f"packed_{name}", packed)
            self.register_buffer(f"scales_and_zeros_{name}", sz)

    @property
    def dtype(self) -> torch.dtype:
        return (self.scales if self.group_size is None else self.scales_and_zeros_lo).dtype

    @functools.cached_property
    def _layout(self) -> Int4PackLayout:
        return int4_pack_layout(self.packed_lo.shape[0])

    def prepare_rows(self) -> None:
        if self.group_size is not None:
            self._layout  # noqa: B018

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()
        if self.group_size is None:
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:
            g, n = self.group_size, self.out_features
            y = _int4_mm(x2, self.packed_lo, g, self.scales_and_zeros_lo, n) + _int4_mm(
                x2, self.packed_hi, g, self.scales_and_zeros_hi, n)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _rows_f32(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group_size is None:
            return self.qweight[ids].float() * self.scales[ids].float()[:, None]
        k = self.in_features
        lo = _int4_values(self.packed_lo, self._layout, ids, k)
        hi = _int4_values(self.packed_hi, self._layout, ids, k)
        return _group_dequant(lo + 16 * (hi - 8), self.scales_and_zeros_lo[:, ids, 0].t(), None)


class Int4Weight(QuantizedWeight):
    """W4A16: ``packed`` (``_convert_weight_to_int4pack_for_cpu`` of the 0..15 values, two per
    byte), ``scales_and_zeros [in / group_size, out_padded, 2]``; ``y = x @ ((q - 8) * scale + zero).T``.
    The kernel takes output rows in multiples of :data:`INT4_ROW_MULTIPLE`: other counts are
    padded with zero rows (scale 0), and the padding is cut off the output. ``rows`` reads the
    values back out of the packed layout (:func:`int4_pack_layout`)."""

    def __init__(self, q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        packed, sz = _int4_pack(q, scales_and_zeros)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    @functools.cached_property
    def _layout(self) -> Int4PackLayout:
        return int4_pack_layout(self.packed.shape[0])

    def prepare_rows(self) -> None:
        self._layout  # noqa: B018

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _int4_mm(x.reshape(-1, self.in_features).contiguous(), self.packed, self.group_size,
                     self.scales_and_zeros, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _rows_f32(self, ids: torch.Tensor) -> torch.Tensor:
        q = _int4_values(self.packed, self._layout, ids, self.in_features)
        sz = self.scales_and_zeros[:, ids].transpose(0, 1)  # [M, groups, 2]
        return _group_dequant(q - 8, sz[..., 0], sz[..., 1])


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
    return Int4Weight(*quantize_int4(w, scheme.group_size, dtype), scheme.group_size)


def quantize_linear(layer: nn.Module, scheme: QuantScheme,
                    reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Replace the loaded float ``layer.weight [out, in]`` of a column/row-parallel linear, a
    :class:`~tpengine.layers.embedding.VocabParallelEmbedding` or a
    :class:`~tpengine.layers.embedding.ParallelLMHead` (this rank's vocabulary rows) by its
    quantized storage ``layer.quant`` (``weight`` becomes None). For a
    :class:`~tpengine.layers.linear.RowParallelLinear` under per-channel int8, ``reduce_max``
    (an all-reduce MAX over the tp ranks, in place) turns the slice's row absmax into the full rows'.
    A vocabulary layer's padding rows get scale (and zero) 0, as a stored folder holds them.

    Raises:
        UserError: see :func:`quantize_weight`.
    """
    from tpengine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from tpengine.layers.linear import RowParallelLinear

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


# ------------------------------------------------------------------------------ the split
def _row_boundaries(plan: Any) -> dict[str, list[int]]:
    """Leaf name of each row-parallel layer -> every rank's input start and end under ``plan``."""
    hd = plan.head_dim
    return {"self_attn.o_proj": sorted({b * hd for r in plan.ranks for b in r.q_heads}),
            "mlp.down_proj": sorted({b for r in plan.ranks for b in r.intermediate})}


def check_quantization(hf_config: Any, tp_size: int, scheme: QuantScheme) -> None:
    """Refuse, before any weight is read, a grouped ``scheme`` (int4, grouped int8) whose groups
    the tp split would cut: every linear's input size (hidden for q/k/v and gate/up; the heads'
    and the intermediate size for o_proj and down_proj) must be a multiple of the group size,
    and each rank's input range of o_proj and down_proj (from :class:`tpengine.plan.ShardPlan`)
    must start on a group boundary; the hidden size must be a multiple of ``scheme.vocab``'s
    group size (the embedding / LM head). Per-channel int8 always fits.

    Raises:
        UserError: naming the layer, the group size, this tp and the valid tp sizes.
    """
    from tpengine.plan import ShardPlan

    d = ShardPlan.dims(hf_config)
    gv = None if scheme.vocab is None else scheme.vocab.group_size
    if gv is not None and d["hidden_size"] % gv:
        raise UserError(f"--quantization {scheme.name}: the embedding / LM head ({scheme.vocab.name}, group size "
                        f"{gv}) has {d['hidden_size']} input features, not a multiple of {gv}")
    if scheme.group_size is None:
        return
    g = scheme.group_size
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
