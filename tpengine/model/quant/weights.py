"""Weight-only quantized storage: W8A16 (int8) and W4A16 (int4) of the parallel linears, the
vocabulary-parallel embedding and the LM head.

The loader quantizes each column/row-parallel linear's weight, and the embedding's and LM head's
vocabulary rows, as soon as this rank's float slice of it is in
(:func:`tpengine.model.quant.apply.quantize_linear`), and
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

Under ``--quantization int8`` the embedding / LM head is int8 per output channel; under
``int4`` it is int4 with coded zeros at group :data:`INT4_VOCAB_GROUP_SIZE`, the linears' storage
(``QuantScheme.vocab``; a scheme built directly may choose another, or None to keep them in
float). The coded zeros are what keep an int4 table within the quality bar
(docs/notes/quantized-head.md).

Tensor parallelism: quantization is a function of one output row (int8) or one group (grouped
int8, int4) only, so a rank's quantized slice is bit for bit the same slice of the tp=1
quantized weight:

* a column split (and the vocabulary split) takes whole output rows, with their scales (and
  zeros); vocabulary padding rows are zero, and quantize to zero with scale (and zero) 0, as a
  stored folder (:mod:`tpengine.model.quant.checkpoint`) holds them;
* a row split cuts the input dimension: for grouped schemes every rank's input range must start
  on a group boundary (:func:`check_quantization` refuses a tp where it does not); for int8 per
  channel the per-row ``absmax`` is of the FULL row, the max over the ranks of their slices'
  absmax (the loader passes an all-reduce MAX), never of the rank's slice alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tpengine.config import QUANTIZATIONS  # the values of EngineConfig.quantization besides None
from tpengine.errors import UserError
from tpengine.model.quant.arith import (
    INT4_ROW_MULTIPLE,
    Int4PackLayout,
    _group_dequant,
    _int4_mm,
    _int4_pack,
    _int4_values,
    _pad_out,
    coded_zeros,
    int4_pack_layout,
)

__all__ = ["QUANTIZATIONS", "Int4CodedWeight", "Int4Weight", "Int8Weight", "QuantScheme", "QuantizedWeight",
           "check_quantization"]
#: Group size of ``--quantization int4`` (input columns per scale/zero).
INT4_GROUP_SIZE = 32
#: Group size of the embedding / LM head under ``--quantization int4`` (see docs/design.md).
INT4_VOCAB_GROUP_SIZE = 32
#: Group sizes torch's CPU int4 kernel takes (and so grouped int8, made of two int4 products).
INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class QuantScheme:
    """One weight-only scheme: ``name`` "int8" (``group_size`` None: per output channel, or input
    columns per scale) or "int4" (``group_size`` input columns per scale and zero; ``zero_codes``:
    the zero stored as an int8 code, :class:`Int4CodedWeight`, else as
    a float, :class:`Int4Weight`);
    ``vocab``, the scheme of the vocabulary-parallel embedding and LM head (None: they stay in float)."""

    name: str
    group_size: int | None = None
    vocab: QuantScheme | None = None
    zero_codes: bool = False

    @classmethod
    def of(cls, name: str, group_size: int | None = None) -> QuantScheme:
        """The scheme named ``name`` (one of :data:`QUANTIZATIONS`), as ``--quantization``
        stores it: int8 per output channel (or ``group_size``), its ``vocab`` int8 per channel;
        int4 with coded zeros, ``group_size`` default :data:`INT4_GROUP_SIZE`, its ``vocab`` the
        same int4 at :data:`INT4_VOCAB_GROUP_SIZE` (see the module docstring).

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
        return cls("int4", group, cls("int4", INT4_VOCAB_GROUP_SIZE, zero_codes=True), zero_codes=True)


# ------------------------------------------------------------------------------- storage
def _one_row(run: Callable, kernel: Callable) -> Callable:
    """``run`` (a weight's bound product at any rows) carrying ``kernel``'s ``c_spec``, the C call that
    ``run`` makes for one row (``kernel`` is what it calls at one row), where the kernel has one: what
    a backend's decode program calls in its place."""
    run.c_spec = getattr(kernel, "c_spec", None)
    return run


class QuantizedWeight(nn.Module):
    """A quantized weight ``[out_features, in_features]`` (a linear's, or the vocabulary rows of
    an embedding / LM head): ``forward(x [..., in]) -> [..., out]`` in ``x``'s dtype (the model
    dtype its scales are stored in); ``rows(ids [...]) -> [..., in]``, the dequantized rows
    ``ids`` in that dtype (an embedding lookup); ``dequantize()``, the whole float32 weight;
    ``nbytes``, the bytes held. Built by :func:`tpengine.model.quant.apply.quantize_weight`; CPU only."""

    out_features: int
    in_features: int
    #: Up to this many rows ``forward`` runs the device's kernels (:attr:`qkernels`), above it torch's;
    #: set per weight shape by measurement (on the CPU :func:`tpengine.backends.cpu.qgemv_choice.choose`).
    gemv_rows = 0
    #: Up to this many rows (at most ``gemv_rows``) an int4 or per-channel int8 weight's kernel quantizes the
    #: activations to int8 and multiplies in integers (on the CPU ``cpu_qgemv.int4(..., act_int8=True)``,
    #: ``cpu_qgemv.int8(..., act_int8=True)``); 0: never. Set
    #: by the same measurement; its results differ from the float kernel's by the activations' rounding.
    q8_rows = 0
    #: From this many rows on ``forward`` dequantizes the weight into a scratch float tensor and runs
    #: one GEMM (prefill); 0: never. Set by the same measurement.
    dequant_rows = 0
    #: The dtype of that scratch weight and its GEMM (the output rounded back to ``x``'s dtype); None:
    #: ``x``'s dtype. float32 where this machine's half-precision GEMM measured slower than the widened
    #: one (:func:`tpengine.backends.cpu.cpu_widen.gemm_dtype`); set with ``dequant_rows``.
    dequant_dtype: torch.dtype | None = None
    #: The device's quantized kernels (:meth:`set_kernels`); None: torch's only.
    qkernels: Any = None

    def _many(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` of a contiguous ``x [rows, in]`` above ``gemv_rows``: torch's kernel, or the
        dequantize-then-GEMM path from ``dequant_rows`` rows on."""
        raise NotImplementedError

    @property
    def kernels_take(self) -> bool:
        """Whether tpengine's C kernels can take this weight (the library loads, and for int4
        torch packed it in the layout they read)."""
        return False

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

    def set_kernels(self, kernels) -> None:
        """Bind the device's quantized kernels (on the CPU the module
        :mod:`tpengine.backends.cpu.cpu_qgemv`: ``kernels_built``, ``int4_layout_ok``, ``int8``,
        ``bind_int8``, ``int4``, ``bind_int4``, ``dequant_int4``, ``int4_rows``, ``bind_int4_rows``), or None: torch's
        kernels only. Set by the platform (:meth:`tpengine.backends.platform.Platform.bind_model`)
        before :attr:`kernels_take` is read."""
        self.qkernels = kernels
        self.__dict__.pop("kernels_take", None)  # a cached answer for the kernels before
        self.__dict__.pop("_rows_run", None)  # (an int4 lookup bound with them)

    def bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """``forward`` for a contiguous ``x [rows, in]`` with the per-call checks of tpengine's
        kernel done once (the layer's bound ``impl``, its decode hot path); the same results as ``forward``."""
        return self.forward

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

    @functools.cached_property
    def kernels_take(self) -> bool:
        k = self.qkernels
        return (k is not None and k.kernels_built(int4=self.group_size is not None)
                and (self.group_size is None or k.int4_layout_ok(self._layout)))

    def bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.group_size is not None:
            return self.forward
        if not self.gemv_rows:
            return self._many
        kernel, limit, many = self.qkernels.bind_int8(self.qweight, self.scales), self.gemv_rows, self._many
        if not self.q8_rows:
            return _one_row(lambda x: kernel(x) if x.shape[0] <= limit else many(x), kernel)
        q8, limit8 = self.qkernels.bind_int8(self.qweight, self.scales, act_int8=True), self.q8_rows
        return _one_row(lambda x: q8(x) if x.shape[0] <= limit8 else kernel(x) if x.shape[0] <= limit else many(x), q8)

    def _many(self, x: torch.Tensor) -> torch.Tensor:
        if self.group_size is None:
            if self.dequant_rows and x.shape[0] >= self.dequant_rows:
                dt = self.dequant_dtype or x.dtype
                return F.linear(x.to(dt), self.qweight.to(dt) * self.scales.to(dt)[:, None]).to(x.dtype)
            return torch._weight_int8pack_mm(x, self.qweight, self.scales)
        g, n = self.group_size, self.out_features
        return _int4_mm(x, self.packed_lo, g, self.scales_and_zeros_lo, n) + _int4_mm(
            x, self.packed_hi, g, self.scales_and_zeros_hi, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()
        if x2.shape[0] > self.gemv_rows:
            y = self._many(x2)
        elif self.group_size is None:
            y = self.qkernels.int8(x2, self.qweight, self.scales, act_int8=x2.shape[0] <= self.q8_rows)
        else:
            g, n = self.group_size, self.out_features
            y = self.qkernels.int4(x2, self.packed_lo, self.scales_and_zeros_lo, g, n) + self.qkernels.int4(
                x2, self.packed_hi, self.scales_and_zeros_hi, g, n)
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

    @functools.cached_property
    def kernels_take(self) -> bool:
        k = self.qkernels
        return k is not None and k.kernels_built(int4=True) and k.int4_layout_ok(self._layout)

    # What the kernels read. tpengine's C kernels: the scales (here scales_and_zeros) and the zero
    # codes (None here); torch's kernel: scales_and_zeros. Int4CodedWeight overrides all three.
    def _kernel_scales(self) -> torch.Tensor:
        return self.scales_and_zeros

    def _kernel_codes(self) -> torch.Tensor | None:
        return None

    def _torch_sz(self) -> torch.Tensor:
        return self.scales_and_zeros

    def bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        if not self.gemv_rows:
            return self._many
        args = (self.packed, self._kernel_scales(), self.group_size, self.out_features, self._kernel_codes())
        kernel, limit, many = self.qkernels.bind_int4(*args), self.gemv_rows, self._many
        if not self.q8_rows:
            return _one_row(lambda x: kernel(x) if x.shape[0] <= limit else many(x), kernel)
        q8, limit8 = self.qkernels.bind_int4(*args, act_int8=True), self.q8_rows
        return _one_row(lambda x: q8(x) if x.shape[0] <= limit8 else kernel(x) if x.shape[0] <= limit else many(x), q8)

    def _many(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        if self.dequant_rows and x.shape[0] >= self.dequant_rows:  # [in, n_pad] scratch
            dt = self.dequant_dtype or x.dtype
            wt = self.qkernels.dequant_int4(self.packed, self._kernel_scales().to(dt), self.group_size,
                                        self._kernel_codes())
            return (x.to(dt) @ (wt if wt.shape[1] == n else wt[:, :n])).to(x.dtype)
        return _int4_mm(x, self.packed, self.group_size, self._torch_sz(), n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()
        if x2.shape[0] > self.gemv_rows:
            y = self._many(x2)
        else:
            y = self.qkernels.int4(x2, self.packed, self._kernel_scales(), self.group_size, self.out_features,
                                   self._kernel_codes(), act_int8=x2.shape[0] <= self.q8_rows)
        return y.reshape(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        # one C call where the build's kernels read the layout, in place of _rows_f32's ~20 torch ops
        # (docs/notes/avx2.md); the same values bit for bit. The kernel's weight checks once, bound on
        # the first CPU lookup (a decode step's one id: docs/notes/kernels.md); set_kernels drops it
        run = self.__dict__.get("_rows_run")
        if run is not None and ids.is_cpu:
            return run(ids)
        if self.packed.device.type == "cpu" and ids.device.type == "cpu" and self.kernels_take:
            run = self.__dict__["_rows_run"] = self.qkernels.bind_int4_rows(
                self.packed, self._kernel_scales(), self.group_size, self._kernel_codes())
            return run(ids)
        return super().rows(ids)

    def _rows_f32(self, ids: torch.Tensor) -> torch.Tensor:
        q = _int4_values(self.packed, self._layout, ids, self.in_features)
        sz = self.scales_and_zeros[:, ids].transpose(0, 1)  # [M, groups, 2]
        return _group_dequant(q - 8, sz[..., 0], sz[..., 1])


# ------------------------------------------------------------------ int4 with coded zeros
# W4A16 with the zero of each group stored as an int8 code (``--quantization int4``'s storage):
# :class:`Int4CodedWeight`, the arithmetic in :func:`tpengine.model.quant.arith.quantize_int4_coded`
# (docs/design.md, "Quantized weights").


class Int4CodedWeight(Int4Weight):
    """W4A16 with int8 zero codes (:func:`~tpengine.model.quant.arith.quantize_int4_coded`): ``packed``
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


# ------------------------------------------------------------------ which tp sizes a scheme allows
def _row_boundaries(plan: Any, dense: bool = True) -> dict[str, list[int]]:
    """Leaf name of each row-parallel layer -> every rank's input start and end under ``plan`` (``dense``:
    some layer has a dense MLP)."""
    hd = plan.head_dim
    out = {"self_attn.o_proj": sorted({b * hd for r in plan.ranks for b in r.q_heads})}
    if dense:
        out["mlp.down_proj"] = sorted({b for r in plan.ranks for b in r.intermediate})
    if plan.num_experts:
        out["mlp.experts.*.down_proj"] = sorted({b for r in plan.ranks for b in r.expert_intermediate})
    if plan.shared_expert_intermediate_size:
        out["mlp.shared_expert.down_proj"] = sorted({b for r in plan.ranks for b in r.shared_expert_intermediate})
    return out


def check_quantization(hf_config: Any, tp_size: int, scheme: QuantScheme, expert_parallel: bool = False) -> None:
    """Refuse, before any weight is read, a grouped ``scheme`` (int4, grouped int8) whose groups
    the tp split would cut: every linear's input size (hidden for q/k/v and gate/up; the heads'
    and the intermediate size for o_proj and down_proj; a routed expert's intermediate for its
    down_proj) must be a multiple of the group size, and each rank's input range of o_proj and
    down_proj (an expert's too: split under tensor parallelism, whole under ``expert_parallel``; from
    :class:`tpengine.model.plan.ShardPlan`) must start on a group boundary; the hidden size must be a
    multiple of ``scheme.vocab``'s group size (the embedding / LM head). Per-channel int8 always fits.

    Raises:
        UserError: naming the layer, the group size, this tp and the valid tp sizes.
    """
    from tpengine.model.families import has_dense_mlp
    from tpengine.model.plan import ShardPlan

    d = ShardPlan.dims(hf_config)
    gv = None if scheme.vocab is None else scheme.vocab.group_size
    if gv is not None and d["hidden_size"] % gv:
        raise UserError(f"--quantization {scheme.name}: the embedding / LM head ({scheme.vocab.name}, group size "
                        f"{gv}) has {d['hidden_size']} input features, not a multiple of {gv}")
    if scheme.group_size is None:
        return
    g = scheme.group_size
    sizes = {"self_attn.q_proj/k_proj/v_proj, mlp.gate_proj/up_proj": d["hidden_size"],
             "self_attn.o_proj": d["num_heads"] * d["head_dim"]}
    dense = has_dense_mlp(hf_config)
    if dense:
        sizes["mlp.down_proj"] = d["intermediate_size"]
    experts, expert_inter = ShardPlan.expert_dims(hf_config)
    if experts:
        sizes["mlp.experts.*.down_proj"] = expert_inter
        if getattr(hf_config, "shared_expert_intermediate_size", None):
            sizes["mlp.shared_expert.down_proj"] = int(hf_config.shared_expert_intermediate_size)
    for layer, n in sizes.items():
        if n % g:
            raise UserError(f"--quantization {scheme.name} (group size {g}): {layer} has {n} input features, "
                            f"not a multiple of {g}; this model cannot be quantized with group size {g} at any tp")

    def bad_layer(tp: int) -> tuple[str, int] | None:
        try:
            plan = ShardPlan.build(hf_config, tp, expert_parallel)
        except UserError:  # (a tp the experts cannot take: not a valid one)
            return "experts", 1
        for layer, bounds in _row_boundaries(plan, dense).items():
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
