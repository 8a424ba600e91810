"""int8 and int4 weight-only matrix-vector products for the few rows of a decode step
(``cpu_qgemv.c``, built by :mod:`tpengine.backends.cpu.cpu_library`), on the storage
:mod:`tpengine.model.quant.weights` already holds (int8 ``[out, in]`` with per-channel scales; torch's
packed int4 layout with ``scales_and_zeros``, or scales and int8 zero codes), so no second copy of a weight exists.

torch's CPU weight-only kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) are
written for many rows; at one row they read the weight well below the memory bandwidth. Which path a
weight takes at each row count is measured on the machine that runs
(:mod:`tpengine.backends.cpu.qgemv_choice`).

An int4 weight with bfloat16 activations has a third candidate at those rows (:func:`q8_takes`): the
activations quantized to int8 in blocks of 32 and the products summed in integers
(``tpe_qgemv_int4_q8``, llama.cpp's q4_1 x q8_1 arithmetic; ``int4(..., act_int8=True)``), taken up to
``q8_rows`` rows where it measured faster than the float kernel. Its results differ from the float
kernel's by the activations' rounding (|x - d xq| <= d / 2, d = the block's max |x| / 127), about
bfloat16's own; float32 activations keep the float kernel, whose sums are float32's.

A per-channel int8 weight with bfloat16 activations has the same third candidate (``tpe_qgemv_int8_q8``,
llama.cpp's q8_0 x q8_0 arithmetic; ``int8(..., act_int8=True)``): the activations quantized to int8 in
blocks of 32 alike, the products summed in int32 per block (AVX-512 VNNI ``vpdpbusd``, AVX2
``vpmaddubsw``), each block's sum scaled by its ``d`` and the output by the channel's scale, taken up to
``q8_rows`` rows where it measured faster (docs/notes/kernels.md, "int8 x int8").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from tpengine.backends.cpu import cpu_library

#: The most rows one call takes.
MAX_ROWS = 8
_FLOAT = (torch.bfloat16, torch.float32)


def int4_blocks() -> tuple[int, ...]:
    """The rows per block of torch's packed int4 layouts the built int4 kernels read: 64 (the layout
    torch packs where it runs its AVX-512 code) in every build, and 32 (its AVX2 code's) in an AVX2
    build, which also runs on an AVX-512 CPU without AVX512-BF16 (torch packs 64 there); () without
    the kernels. Never raises."""
    if not kernels_built(int4=True):
        return ()
    return (64, 32) if cpu_library.isa() == "avx2" else (64,)


@functools.lru_cache(maxsize=1)
def torch_int4_block() -> int:
    """The rows per block of the layout ``_convert_weight_to_int4pack_for_cpu`` packs on this machine
    (its CPU capability: 64 with AVX512, 32 with AVX2; the whole layout is
    :func:`tpengine.model.quant.arith.int4_pack_layout`'s to learn), from 64 rows of two columns, all
    0 then all 15: a block of ``b`` rows puts its first column's ``b / 2`` bytes before its second's,
    so the first non-zero byte is byte ``b / 2``."""
    probe = torch.tensor([[0, 15]] * 64, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1).reshape(-1)
    return 2 * int(packed.nonzero()[0])


def int4_layout_ok(layout) -> bool:
    """Whether a :class:`tpengine.model.quant.arith.Int4PackLayout` is one ``cpu_qgemv.c`` reads
    (:func:`int4_blocks`): blocks of ``b`` = 64 or 32 rows, row ``r`` at byte ``r % (b / 2)`` of each
    column in nibble ``4 * (r // (b / 2))``; a last block of ``nb`` rows with rows ``2j`` and ``2j + 1``
    in byte ``j`` (torch's AVX-512 layout, 64-row blocks, and its AVX2 one, 32-row blocks)."""
    half = layout.block // 2
    r = torch.arange(layout.block)
    t = torch.arange(layout.tail)
    return (layout.block in int4_blocks() and torch.equal(layout.pos.long(), r % half)
            and torch.equal(layout.shift.long(), 4 * (r // half)) and torch.equal(layout.tail_pos.long(), t // 2)
            and torch.equal(layout.tail_shift.long(), 4 * (t % 2)))


def _rows(x: torch.Tensor, k: int, op: str) -> tuple[torch.Tensor, int]:
    rows = x.numel() // k if x.dim() and x.shape[-1] == k else -1
    if x.dtype not in _FLOAT or not 1 <= rows <= MAX_ROWS or k % 16:
        raise ValueError(f"{op}: x must be bfloat16 or float32 [..., {k}] with 1..{MAX_ROWS} rows and "
                         f"{k} % 16 == 0; got {x.dtype} {tuple(x.shape)}")
    return x.reshape(rows, k).contiguous(), rows


#: the C functions of the int8 kernel and of the int4 ones (AVX512-BF16 and AVX2 builds; cpu_library.has)
INT8_KERNELS, INT4_KERNELS = ("tpe_qgemv_int8",), ("tpe_qgemv_int4", "tpe_dequant_int4", "tpe_int4_rows")
KERNELS = INT8_KERNELS + INT4_KERNELS
#: the int4 x int8 kernel (AVX2 builds, and AVX-512 builds where the compiler targets VNNI and VBMI)
INT4_Q8_KERNELS = ("tpe_qgemv_int4_q8",)
#: the int8 x int8 kernel (built where the int4 x int8 one is)
INT8_Q8_KERNELS = ("tpe_qgemv_int8_q8",)
#: the activations' block (columns per int8 scale) of those kernels: group sizes and an int8 weight's
#: input columns must be multiples of it
Q8_BLOCK = 32


def q8_takes(mod) -> bool:
    """Whether a kernel with int8 activations is a candidate for the quantized weight ``mod``: bfloat16
    activations (float32 ones keep float32 sums, and with them the float32 tp=2 = tp=1 token tests), a
    weight the kernels take (:attr:`~tpengine.model.quant.weights.QuantizedWeight.kernels_take`) and a
    build with the kernel: an int4 weight whose group size is a multiple of :data:`Q8_BLOCK` (the int4 x
    int8 kernel), or a per-channel int8 weight whose input columns are (the int8 x int8 one). Never raises."""
    if not (bool(getattr(mod, "kernels_take", False)) and getattr(mod, "dtype", None) == torch.bfloat16):
        return False
    if type(mod).__name__.startswith("Int4"):
        return getattr(mod, "group_size", 1) % Q8_BLOCK == 0 and cpu_library.has(*INT4_Q8_KERNELS)
    return (type(mod).__name__ == "Int8Weight" and getattr(mod, "group_size", 1) is None
            and getattr(mod, "in_features", 1) % Q8_BLOCK == 0 and cpu_library.has(*INT8_Q8_KERNELS))


def kernels_built(int4: bool) -> bool:
    """Whether the library loads and has the int8 (``int4`` False) or the int4 kernels (a build with
    neither an AVX512-BF16 nor an AVX2 path has neither: those weights keep torch's kernels). Never raises."""
    return cpu_library.has(*(INT4_KERNELS if int4 else INT8_KERNELS))


def _lib(int4: bool):
    why = cpu_library.missing(*(INT4_KERNELS if int4 else INT8_KERNELS))
    if why:
        raise RuntimeError(f"CPU C qgemv kernels unavailable: {why}")
    return cpu_library.load()


def _check(status: int, op: str) -> None:
    if status != 0:  # the arguments were checked above: only a failed allocation gets here
        why = "out of memory" if status == -2 else "arguments it does not take"
        raise RuntimeError(f"qgemv {op}: the C kernel failed (status {status}: {why})")


def _block(op: str) -> int:
    """:func:`torch_int4_block`, which the build's kernels must read (:func:`int4_blocks`).

    Raises:
        ValueError: they do not.
    """
    block = torch_int4_block()
    if block not in int4_blocks():
        raise ValueError(f"{op}: torch packs int4 in blocks of {block} rows here; this build "
                         f"({cpu_library.isa()}) reads blocks of {', '.join(map(str, int4_blocks())) or 'no'} rows")
    return block


def int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, act_int8: bool = False) -> torch.Tensor:
    """``(x @ qweight.T) * scales`` for ``x [..., k]`` (1..8 rows, bfloat16 or float32),
    ``qweight int8 [n, k]``, ``scales [n]`` in ``x``'s dtype -> ``[..., n]`` in that dtype, the sums in
    float32. ``act_int8``: ``x`` quantized to int8 in blocks of :data:`Q8_BLOCK` (``d = max |x| / 127``,
    ``xq = round(x / d)``, ties to even; ``k % 32 == 0``) and multiplied in integers (``tpe_qgemv_int8_q8``;
    llama.cpp's ``ggml_vec_dot_q8_0_q8_0`` arithmetic): ``scales * sum_b d_b * (sum_{i in b} q xq)``, each
    block's int32 sum exact, the sum over blocks in float32; the product of the dequantized activations
    ``d * xq``, each within ``d / 2`` of ``x`` (bfloat16's own rounding is ``|x| / 256``; for float32
    activations this rounds far more than their own).

    Raises:
        ValueError: a dtype, shape or row count it does not take.
        RuntimeError: the C kernels are unavailable.
    """
    n, k = qweight.shape
    x2, rows = _rows(x, k, "qgemv int8")
    if (qweight.dtype != torch.int8 or not qweight.is_contiguous() or scales.shape != (n,) or scales.dtype != x.dtype
            or (act_int8 and k % Q8_BLOCK)):
        raise ValueError(f"qgemv int8: need a contiguous int8 [n, {k}] weight and [n] scales in {x.dtype}"
                         f"{f' and {k} % {Q8_BLOCK} == 0 input columns' if act_int8 else ''}; got "
                         f"{qweight.dtype} {tuple(qweight.shape)}, scales {scales.dtype} {tuple(scales.shape)}")
    y = torch.empty(rows, n, dtype=x.dtype)
    _check(_int8_fn(act_int8)(x2.data_ptr(), rows, k, qweight.data_ptr(), scales.contiguous().data_ptr(), n,
                              y.data_ptr(), int(x.dtype == torch.bfloat16), torch.get_num_threads()), "int8")
    return y.reshape(*x.shape[:-1], n)


def _int8_fn(act_int8: bool):
    """The C function of :func:`int8` (``act_int8``: the int8 x int8 one; RuntimeError where the build lacks it)."""
    return _lib(False).tpe_qgemv_int8 if not act_int8 else _q8_fn("int8", INT8_Q8_KERNELS)


def _q8_fn(kind: str, kernels: tuple[str, ...]):
    """The int8-activation kernel ``kernels[0]`` of ``kind`` ("int8" or "int4") weights.

    Raises:
        RuntimeError: the build lacks it.
    """
    why = cpu_library.missing(*kernels)
    if why:
        raise RuntimeError(f"CPU C {kind} x int8 kernel unavailable: {why}")
    return getattr(cpu_library.load(), kernels[0])


def _int4_scales(scales_and_zeros: torch.Tensor, zero_codes: torch.Tensor | None, op: str) -> tuple[int, int]:
    """``(groups, n_pad)`` of an int4 weight's scales: ``scales_and_zeros [groups, n_pad, 2]``, or with
    ``zero_codes`` (int8 ``[groups, n_pad]``) ``scales [groups, n_pad]`` (zero = code * scale / 16).

    Raises:
        ValueError: other shapes or dtypes, naming them.
    """
    if zero_codes is None:
        if scales_and_zeros.dim() == 3 and scales_and_zeros.shape[2] == 2:
            return scales_and_zeros.shape[0], scales_and_zeros.shape[1]
        raise ValueError(f"{op}: scales_and_zeros must be [groups, n_pad, 2]; got {tuple(scales_and_zeros.shape)}")
    if (scales_and_zeros.dim() != 2 or zero_codes.dtype != torch.int8 or zero_codes.shape != scales_and_zeros.shape
            or not zero_codes.is_contiguous()):
        raise ValueError(f"{op}: with zero codes, scales must be [groups, n_pad] and zero_codes a contiguous int8 "
                         f"tensor of that shape; got scales {tuple(scales_and_zeros.shape)}, zero_codes "
                         f"{zero_codes.dtype} {tuple(zero_codes.shape)}")
    return scales_and_zeros.shape


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def int4(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
         out_features: int, zero_codes: torch.Tensor | None = None, act_int8: bool = False) -> torch.Tensor:
    """``x @ ((q - 8) * scale + zero).T`` for ``x [..., k]`` (1..8 rows, bfloat16 or float32),
    ``packed`` (``_convert_weight_to_int4pack_for_cpu`` of ``n_pad`` rows, in the layout
    :func:`int4_layout_ok` accepts: the caller checks), ``scales_and_zeros [k / group_size,
    n_pad, 2]`` in ``x``'s dtype, or ``scales [k / group_size, n_pad]`` with ``zero_codes`` (int8,
    same shape; ``zero = code * scale / 16``) -> ``[..., out_features]`` (the first
    ``out_features <= n_pad``). ``act_int8``: ``x`` quantized to int8 in blocks of :data:`Q8_BLOCK`
    (``d = max |x| / 127``, ``xq = round(x / d)``, ties to even) and multiplied in integers
    (``tpe_qgemv_int4_q8``; llama.cpp's ``ggml_vec_dot_q4_1_q8_1`` arithmetic): the product of the
    dequantized activations ``d * xq``, each within ``d / 2`` of ``x``; ``group_size`` a multiple of 32.

    Raises:
        ValueError: a dtype, shape, group size or row count it does not take.
        RuntimeError: the C kernels are unavailable.
    """
    groups, n_pad = _int4_scales(scales_and_zeros, zero_codes, "qgemv int4")
    k = groups * group_size
    x2, rows = _rows(x, k, "qgemv int4")
    if (group_size % 16 or packed.dtype != torch.uint8 or packed.numel() * 2 != n_pad * k
            or not packed.is_contiguous() or n_pad % 16 or not 0 < out_features <= n_pad
            or scales_and_zeros.dtype != x.dtype or (act_int8 and group_size % Q8_BLOCK)):
        raise ValueError(f"qgemv int4: need uint8 packed [{n_pad}, {k // 2}], scales [{groups}, n_pad % 16 == 0] "
                         f"in {x.dtype}, group size % {Q8_BLOCK if act_int8 else 16} == 0 and 0 < out_features "
                         f"<= n_pad; got packed {packed.dtype} {tuple(packed.shape)}, scales {scales_and_zeros.dtype} "
                         f"{tuple(scales_and_zeros.shape)}, group size {group_size}, out_features {out_features}")
    fn, block = _int4_fn(act_int8), _block("qgemv int4")
    y = torch.empty(rows, out_features, dtype=x.dtype)
    _check(fn(x2.data_ptr(), rows, k, packed.data_ptr(), scales_and_zeros.contiguous().data_ptr(), _ptr(zero_codes),
              group_size, out_features, n_pad, block, y.data_ptr(), int(x.dtype == torch.bfloat16),
              torch.get_num_threads()), "int4")
    return y.reshape(*x.shape[:-1], out_features)


def _int4_fn(act_int8: bool):
    """The C function of :func:`int4` (``act_int8``: the int4 x int8 one; RuntimeError where the build lacks it)."""
    return _lib(True).tpe_qgemv_int4 if not act_int8 else _q8_fn("int4", INT4_Q8_KERNELS)


def bind_int8(qweight: torch.Tensor, scales: torch.Tensor, act_int8: bool = False):
    """:func:`int8` for one weight with its checks done once: ``run(x [rows, k] contiguous in the
    scales' dtype, 1 <= rows <= MAX_ROWS) -> [rows, n]`` (the caller guarantees the arguments);
    ``act_int8`` as :func:`int8`'s (the same C arguments: the decode program's "q8" call either way).

    Raises:
        ValueError: see :func:`int8`.
        RuntimeError: the C kernel is unavailable.
    """
    n, k = qweight.shape
    int8(torch.zeros(1, k, dtype=scales.dtype), qweight, scales, act_int8)  # the checks, once
    fn, qp, sp, dtype, bf = _int8_fn(act_int8), qweight.data_ptr(), scales.data_ptr(), scales.dtype, \
        int(scales.dtype == torch.bfloat16)

    def run(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], n, dtype=dtype)
        _check(fn(x.data_ptr(), x.shape[0], k, qp, sp, n, y.data_ptr(), bf, torch.get_num_threads()), "int8")
        return y
    # its call in a decode program (cpu_program)
    run.c_spec = ("q8", "tpe_qgemv_int8_q8" if act_int8 else "tpe_qgemv_int8", k, qp, sp, n, bf)
    return run


def bind_int4(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, out_features: int,
              zero_codes: torch.Tensor | None = None, act_int8: bool = False):
    """:func:`int4` for one weight with its checks done once: ``run(x [rows, k] contiguous in the
    scales' dtype, 1 <= rows <= MAX_ROWS) -> [rows, out_features]``.

    Raises:
        ValueError: see :func:`int4`.
        RuntimeError: the C kernel is unavailable.
    """
    groups, n_pad = _int4_scales(scales_and_zeros, zero_codes, "qgemv int4")
    k, dtype = groups * group_size, scales_and_zeros.dtype
    int4(torch.zeros(1, k, dtype=dtype), packed, scales_and_zeros, group_size, out_features, zero_codes,
         act_int8)  # checks, once
    fn, pp, sp, zp = _int4_fn(act_int8), packed.data_ptr(), scales_and_zeros.data_ptr(), _ptr(zero_codes)
    bf, block = int(dtype == torch.bfloat16), _block("qgemv int4")

    def run(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], out_features, dtype=dtype)
        _check(fn(x.data_ptr(), x.shape[0], k, pp, sp, zp, group_size, out_features, n_pad, block, y.data_ptr(), bf,
                  torch.get_num_threads()), "int4")
        return y
    # its call in a decode program (cpu_program)
    run.c_spec = ("q4", "tpe_qgemv_int4_q8" if act_int8 else "tpe_qgemv_int4", k, pp, sp, zp, group_size,
                  out_features, n_pad, block, bf)
    return run


def dequant_int4(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 zero_codes: torch.Tensor | None = None) -> torch.Tensor:
    """The transposed float weight ``wt [k, n_pad]`` (``wt[i, o] = (q[o, i] - 8) * scale + zero``) of an
    int4 weight in the layout :func:`int4_layout_ok` accepts (scales as :func:`int4` takes them), in the
    scales' dtype: a scratch tensor for one prefill GEMM (``x @ wt``), freed with it.

    Raises:
        ValueError: a dtype or shape it does not take.
    """
    groups, n_pad = _int4_scales(scales_and_zeros, zero_codes, "dequant int4")
    k, dtype = groups * group_size, scales_and_zeros.dtype
    if (dtype not in _FLOAT or group_size % 16 or packed.dtype != torch.uint8
            or packed.numel() * 2 != n_pad * k or not packed.is_contiguous() or n_pad % 16):
        raise ValueError(f"dequant int4: need uint8 packed [{n_pad}, {k // 2}] and bfloat16/float32 scales "
                         f"[{groups}, n_pad % 16 == 0]; got {packed.dtype} {tuple(packed.shape)}, {dtype} "
                         f"{tuple(scales_and_zeros.shape)}")
    fn, block = _lib(True).tpe_dequant_int4, _block("dequant int4")
    wt = torch.empty(k, n_pad, dtype=dtype)
    _check(fn(packed.data_ptr(), scales_and_zeros.contiguous().data_ptr(), _ptr(zero_codes), group_size, k, n_pad,
              block, wt.data_ptr(), int(dtype == torch.bfloat16), torch.get_num_threads()), "dequant int4")
    return wt


def bind_int4_rows(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                   zero_codes: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`int4_rows` of one weight with the weight's checks made once: ``run(ids)`` for int64 ids
    ``[N]`` contiguous on the CPU (a step's embedding lookup) makes the C call alone; other ids go through
    :func:`int4_rows`. The same values and errors (an id outside the rows: :func:`int4_rows`' IndexError).
    A batch-1 decode step runs its Python cold after the decode program (docs/notes/kernels.md).

    Raises:
        ValueError: a weight :func:`int4_rows` does not take.
    """
    groups, n_pad = _int4_scales(scales_and_zeros, zero_codes, "int4 rows")
    k, dtype = groups * group_size, scales_and_zeros.dtype
    if (dtype not in _FLOAT or group_size % 16 or packed.dtype != torch.uint8 or packed.numel() * 2 != n_pad * k
            or not packed.is_contiguous() or n_pad % 16):
        int4_rows(packed, scales_and_zeros, group_size, torch.zeros(1, dtype=torch.int64), zero_codes)  # its error
    fn, sz = _lib(True).tpe_int4_rows, scales_and_zeros.contiguous()
    head = (packed.data_ptr(), sz.data_ptr(), _ptr(zero_codes), group_size, k, n_pad, _block("int4 rows"))
    bf16, empty, threads, i64 = int(dtype == torch.bfloat16), torch.empty, torch.get_num_threads, torch.int64

    def run(ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype != i64 or ids.dim() != 1 or not ids.is_cpu or not ids.is_contiguous():
            return int4_rows(packed, sz, group_size, ids, zero_codes)
        n = ids.shape[0]
        out = empty(n, k, dtype=dtype)
        bad = fn(*head, ids.data_ptr(), n, out.data_ptr(), bf16, threads())
        if bad >= 0:
            raise IndexError(f"int4 rows: id {int(ids[bad])} is outside the weight's rows 0..{n_pad - 1}")
        _check(bad + 1, "int4 rows")
        return out
    run.keep = (packed, sz, zero_codes)  # the pointers' tensors live as long as the call
    return run


def int4_rows(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, ids: torch.Tensor,
              zero_codes: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``ids`` (integers, any shape, each in ``0..n_pad - 1``) of an int4 weight in the layout
    :func:`int4_layout_ok` accepts (scales as :func:`int4` takes them), dequantized: ``[*ids.shape, k]``
    in the scales' dtype, ``(q - 8) * scale + zero`` with the product rounded to float32 before the sum,
    bit for bit what :meth:`tpengine.model.quant.weights.QuantizedWeight.rows` computes in torch (an
    embedding lookup in a quantized vocabulary).

    Raises:
        ValueError: a dtype or shape it does not take.
        IndexError: an id outside ``0..n_pad - 1``, naming it.
    """
    groups, n_pad = _int4_scales(scales_and_zeros, zero_codes, "int4 rows")
    k, dtype = groups * group_size, scales_and_zeros.dtype
    if (dtype not in _FLOAT or group_size % 16 or packed.dtype != torch.uint8 or packed.numel() * 2 != n_pad * k
            or not packed.is_contiguous() or n_pad % 16 or ids.is_floating_point() or ids.is_complex()
            or ids.dtype == torch.bool):
        raise ValueError(f"int4 rows: need uint8 packed [{n_pad}, {k // 2}], bfloat16/float32 scales "
                         f"[{groups}, n_pad % 16 == 0] and integer ids; got {packed.dtype} {tuple(packed.shape)}, "
                         f"{dtype} {tuple(scales_and_zeros.shape)}, ids {ids.dtype}")
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), k, dtype=dtype)
    bad = _lib(True).tpe_int4_rows(packed.data_ptr(), scales_and_zeros.contiguous().data_ptr(), _ptr(zero_codes),
                                   group_size, k, n_pad, _block("int4 rows"), flat.data_ptr(), flat.numel(),
                                   out.data_ptr(), int(dtype == torch.bfloat16), torch.get_num_threads())
    if bad >= 0:
        raise IndexError(f"int4 rows: id {int(flat[bad])} is outside the weight's rows 0..{n_pad - 1}")
    _check(bad + 1, "int4 rows")
    return out.reshape(*ids.shape, k)
