"""The weight-only quantization arithmetic of :mod:`tpengine.model.quant.weights`: int8 and int4
quantize / dequantize (the references the kernels are tested against), torch's CPU int4 kernel
calls, and where ``_convert_weight_to_int4pack_for_cpu`` puts each value (so rows can be read
back for an embedding lookup). The conventions are the module docstring of
:mod:`tpengine.model.quant.weights`."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch


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
def _int4_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(groups float32 [out, in / g, g], their max, their min)`` of ``w [out, in]``.

    Raises:
        ValueError: ``in`` not a multiple of ``group_size``.
    """
    out, k = w.shape
    if k % group_size:
        raise ValueError(f"int4: {k} input columns are not a multiple of the group size {group_size}")
    g = w.float().reshape(out, k // group_size, group_size)
    return g, g.amax(dim=-1), g.amin(dim=-1)


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
    g, mx, mn = _int4_groups(w, group_size)
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


#: int4 with int8 zero codes: ``zero = code * scale / ZERO_CODE_STEP`` (``code`` in -128..127).
ZERO_CODE_STEP = 16


def coded_zeros(scales: torch.Tensor, zero_codes: torch.Tensor) -> torch.Tensor:
    """float32 zeros ``(code * scale) / 16`` of ``scales`` and int8 ``zero_codes`` (same shape), in the
    order the C kernels compute them (so the two agree bit for bit)."""
    return (zero_codes.float() * scales.float()) * (1.0 / ZERO_CODE_STEP)


def quantize_int4_coded(w: torch.Tensor, group_size: int, dtype: torch.dtype, search: bool = True):
    """Group-wise int4 of ``w [out, in]`` with the zero stored as an int8 code (a byte a group
    instead of a float: 4.75 bits a weight at group 32 and bfloat16 scales, against 5):
    ``(q int32 [out, in] in 0..15, scales [in / g, out] in dtype, zero_codes int8 [in / g, out])``,
    ``w ~ (q - 8) * scale + zero`` with ``zero = code * scale / 16`` (:func:`coded_zeros`).

    Per group, as :func:`quantize_int4`: ``scale = max(max - min, 1e-6) / 15`` (rounded to ``dtype``),
    the zero ``min + 8 * scale`` rounded to a multiple of ``scale / 16`` (``code``); a group whose
    zero falls outside the codes' range (``|zero| >= 8 * scale``: it does not contain 0) first has
    its range widened to take in 0 (min ``<= 0 <=`` max), which brings the zero into the range; an
    all-zero group is stored as a vocabulary padding row is, all 0: values, scale and code. Then
    ``q = round((w - zero) / scale + 8)`` clamped to ``[0, 15]``; with ``search`` (the default), each
    group whose min/max grid does not hold it (to ``dtype``'s rounding) first gets the scale and zero
    code of least error among that grid and 21 others (:func:`_search_int4_coded`, llama.cpp's Q4_K
    search). (The coded zero lets the grid sit
    anywhere between two steps, unlike an integer zero point ``(q - z) * scale``: SmolLM2's weights
    came from GGUF Q4_1 grids, whose zeros an integer zero point cannot hold, so it loses perplexity
    where this code keeps the grid; the figures are in docs/notes/quantized-head.md.)

    Raises:
        ValueError: ``in`` not a multiple of ``group_size``.
    """
    out, k = w.shape
    g, mx, mn = _int4_groups(w, group_size)

    def scale_of(mx, mn):
        return ((mx - mn).clamp(min=1e-6) / 15).to(dtype).float()

    s = scale_of(mx, mn)
    r = torch.round((mn + 8 * s) / s * ZERO_CODE_STEP)
    wide = (r < -128) | (r > 127)
    mn, mx = torch.where(wide, mn.clamp(max=0), mn), torch.where(wide, mx.clamp(min=0), mx)
    s = torch.where(wide, scale_of(mx, mn), s)
    empty = (mx == 0) & (mn == 0)
    codes = torch.round((mn + 8 * s) / s * ZERO_CODE_STEP).clamp_(-128, 127).masked_fill_(empty, 0)
    if search:
        s, codes = _search_int4_coded(g, s, codes, empty, dtype)
    codes = codes.to(torch.int8)
    zeros = coded_zeros(s, codes)
    q = torch.round((g - zeros[..., None]) / s[..., None] + 8).clamp_(0, 15).masked_fill_(empty[..., None], 0)
    s = s.masked_fill(empty, 0)
    return q.reshape(out, k).to(torch.int32), s.to(dtype).t().contiguous(), codes.t().contiguous()


#: The error search of :func:`_search_int4_coded`: grids of 15 + (RMIN + RDELTA * i) steps across a group's
#: range, i = 0..NSTEP (llama.cpp's ``make_qkx2_quants`` for Q4_K: -1, 0.1, 20).
SEARCH_RMIN, SEARCH_RDELTA, SEARCH_NSTEP = -1.0, 0.1, 20
#: A group whose min/max grid holds it to within the stored dtype's rounding (weighted squared error at
#: most this many eps^2 of its weighted sum of squares: a GGUF Q4_1 block in bfloat16, as SmolLM2's
#: linears are, sits at ~1 eps^2; 4-bit rounding costs ~250 eps^2 of bfloat16) is not searched.
SEARCH_EXACT = 16
#: Groups searched at once (memory: a few tensors of groups x (NSTEP + 1) x group size float32 values).
SEARCH_CHUNK = 1024


def _coded_fit(g: torch.Tensor, s: torch.Tensor, b: torch.Tensor, wt: torch.Tensor, dtype: torch.dtype):
    """Store the grid ``w ~ l * s + b`` as :func:`quantize_int4_coded` does (``s`` rounded to ``dtype``,
    ``zero = b + 8 s`` as a code) and quantize ``g [..., n]`` on it: ``(s float32, codes, weighted squared
    error [...])``; a grid with ``s <= 0`` (or not finite) has error ``inf``."""
    ok = torch.isfinite(s) & torch.isfinite(b) & (s > 0)
    s = torch.where(ok, s, torch.ones_like(s)).to(dtype).float()
    ok &= s > 0
    s = torch.where(ok, s, torch.ones_like(s))
    codes = torch.round((b + 8 * s) / s * ZERO_CODE_STEP).nan_to_num_(0).clamp_(-128, 127)
    zeros = coded_zeros(s, codes)
    q = torch.round((g - zeros[..., None]) / s[..., None] + 8).clamp_(0, 15)
    err = (wt * ((q - 8) * s[..., None] + zeros[..., None] - g) ** 2).sum(-1)
    return s, codes, torch.where(ok, err, torch.full_like(err, float("inf")))


def _search_int4_coded(g: torch.Tensor, s: torch.Tensor, codes: torch.Tensor, empty: torch.Tensor,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """For each group of ``g [out, groups, n]`` whose min/max grid (``s`` float32, ``codes`` [out, groups])
    does not hold it to within ``dtype``'s rounding (:data:`SEARCH_EXACT`), the scale and zero code of
    least weighted squared error among that grid and
    ``SEARCH_NSTEP + 1`` others: a grid of ``15 + SEARCH_RMIN + SEARCH_RDELTA * i`` steps across the
    group's range (widened to hold 0), each group's values rounded onto it, and then the scale and
    offset that fit those levels best (weighted least squares, the offset kept <= 0, as the codes
    need), stored as :func:`quantize_int4_coded` stores them. The weights are ``rms(group) + |w|``.
    Each candidate is scored in closed form from the sums of its levels (``sum w (s l + b - x)^2`` with
    the stored ``s`` and ``b``); the best one replaces the min/max grid only if its error, the values
    quantized on it as they will be, is lower. Returns the chosen ``(s, codes)``, the same shapes.

    Source: llama.cpp's ``make_qkx2_quants`` (ggml-quants.c; the Q4_K quantizer, Kawrakow 2023), here for
    the coded zero's grid ``(q - 8) * s + zero``."""
    shape, n = s.shape, g.shape[-1]
    gf, empty = g.reshape(-1, n), empty.reshape(-1)
    s, codes = s.reshape(-1).clone(), codes.reshape(-1).clone()
    steps = 15 + SEARCH_RMIN + SEARCH_RDELTA * torch.arange(SEARCH_NSTEP + 1, dtype=torch.float32)  # [C]
    for lo in range(0, gf.shape[0], SEARCH_CHUNK):
        part = slice(lo, lo + SEARCH_CHUNK)
        x = gf[part]
        wt = x.pow(2).mean(-1, keepdim=True).sqrt() + x.abs()
        _, _, base = _coded_fit(x, s[part], coded_zeros(s[part], codes[part]) - 8 * s[part], wt, dtype)
        exact = base <= SEARCH_EXACT * torch.finfo(dtype).eps ** 2 * (wt * x * x).sum(-1)
        todo = (~exact & ~empty[part]).nonzero().squeeze(1)
        if todo.numel() == 0:
            continue
        x, wt, base = x[todo], wt[todo], base[todo]
        mn, mx = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
        iscale = steps / (mx - mn).clamp(min=1e-30)[:, None]  # [m, C]
        # [m, C, n] levels and their weighted sums (in place: these are the search's big tensors)
        lv = torch.mul((x - mn[:, None])[:, None, :], iscale[..., None]).round_().clamp_(0, 15)
        wl = lv * wt[:, None, :]
        sl, sl2 = wl.sum(-1), lv.mul_(wl).sum(-1)
        sxl = wl.mul_(x[:, None, :]).sum(-1)  # [m, C]
        wx = wt * x
        sw, sx, sx2 = wt.sum(-1, keepdim=True), wx.sum(-1, keepdim=True), (wx * x).sum(-1, keepdim=True)
        det = sw * sl2 - sl * sl
        fs, fb = (sw * sxl - sx * sl) / det, (sl2 * sx - sl * sxl) / det
        pos = fb > 0  # the levels start above 0: the grid must still hold 0 (the codes' range)
        fs, fb = torch.where(pos, sxl / sl2, fs), torch.where(pos, torch.zeros_like(fb), fb)
        ok = torch.isfinite(fs) & torch.isfinite(fb) & (fs > 0)
        cs = torch.where(ok, fs, torch.ones_like(fs)).to(dtype).float()  # the grid as stored
        ok &= cs > 0
        cs = torch.where(ok, cs, torch.ones_like(cs))
        cc = torch.round((fb + 8 * cs) / cs * ZERO_CODE_STEP).nan_to_num_(0).clamp_(-128, 127)
        cb = coded_zeros(cs, cc) - 8 * cs
        est = cs * cs * sl2 + 2 * cs * cb * sl + cb * cb * sw - 2 * cs * sxl - 2 * cb * sx + sx2
        pick = torch.where(ok, est, torch.full_like(est, float("inf"))).argmin(-1, keepdim=True)
        cs, cc = cs.gather(1, pick).squeeze(1), cc.gather(1, pick).squeeze(1)
        _, _, err = _coded_fit(x, cs, coded_zeros(cs, cc) - 8 * cs, wt, dtype)
        better = err < base
        s[lo + todo[better]], codes[lo + todo[better]] = cs[better], cc[better]
    return s.reshape(shape), codes.reshape(shape)


def dequantize_int4_coded(q: torch.Tensor, scales: torch.Tensor, zero_codes: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """The float32 ``[out, in]`` weight ``(q - 8) * scale + zero`` of ``q [out, in]`` (0..15),
    ``scales`` and ``zero_codes [in / group_size, out]`` (the reference for the coded int4 kernels)."""
    out, k = q.shape
    s = scales.float()[:, :out].t()
    z = coded_zeros(scales[:, :out], zero_codes[:, :out]).t()
    g = q.float().reshape(out, k // group_size, group_size)
    return ((g - 8) * s[..., None] + z[..., None]).reshape(out, k)


#: The CPU int4 kernel's output rows come in multiples of this (a layer's are padded up to it).
INT4_ROW_MULTIPLE = 16


def _int4_pack(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scales_and_zeros)`` for the CPU int4 kernel of ``q int32 [out, in]`` (0..15) and
    ``scales_and_zeros [in / g, out, 2]`` (or any ``[in / g, out, ...]`` scale tensor), rows padded with
    zeros (scale 0) to a multiple of :data:`INT4_ROW_MULTIPLE`."""
    out, k = q.shape
    pad = -out % INT4_ROW_MULTIPLE
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scales_and_zeros = _pad_out(scales_and_zeros, pad)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1), scales_and_zeros.contiguous()


def _pad_out(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``t [groups, out, ...]`` with ``pad`` zero output rows appended (dim 1), contiguous."""
    if not pad:
        return t.contiguous()
    return torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], dim=1).contiguous()


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


@functools.lru_cache(maxsize=64)
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
