"""The CPU C kernels as torch ops, ``torch.ops.tpengine.*`` (so the profiler names them), with their
arguments checked at the boundary.

Each op is declared with ``torch.library.Library("tpengine", "DEF")`` and gets a CPU implementation
that checks shapes, dtypes and layout (ValueError naming the op, the argument and what is valid)
and then calls the C function from :func:`tpengine.backends.cpu.cpu_library.load` through ctypes. Indices
are bounded inside the C code, before anything is written: an out-of-range ``copy_rows`` index
raises IndexError naming the index, its value and the valid range. Outputs are passed in (mutated
arguments, ``(a!)`` in the schema), so every op returns nothing. ``add_rms_norm`` and ``silu_mul``
also take float32 tensors (``tpe_*_f32``). Callers are
:mod:`tpengine.backends.cpu.cpu_fused` and :mod:`tpengine.backends.cpu.cpu_decode`; they decide whether the C
kernels may run at all (:func:`tpengine.backends.cpu.cpu_library.usable`).
"""

from __future__ import annotations

import torch

from tpengine.backends.cpu import cpu_library

BF16 = torch.bfloat16

_LIB = torch.library.Library("tpengine", "DEF")
SCHEMAS = {
    "add_rms_norm": ("add_rms_norm(Tensor h, Tensor? x, Tensor weight, Tensor(a!)? h_out, Tensor(b!) y, "
                     "float eps) -> ()"),
    "rope_": "rope_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()",
    "silu_mul": "silu_mul(Tensor gate_up, Tensor(a!) out) -> ()",
    "causal_softmax_": "causal_softmax_(Tensor(a!) s, float scale) -> ()",
    "copy_rows": ("copy_rows(Tensor src_a, Tensor src_b, Tensor? src_index, Tensor(a!) dst_a, Tensor(b!) dst_b, "
                  "Tensor dst_index) -> ()"),
    "decode_scores": "decode_scores(Tensor q, Tensor k, Tensor lens, Tensor(a!) scores, float scale) -> ()",
    "decode_pv": "decode_pv(Tensor p, Tensor v, Tensor lens, Tensor(a!) out) -> ()",
    "row_argmax": "row_argmax(Tensor x, Tensor(a!) index) -> ()",
    "col_argmax": "col_argmax(Tensor x, Tensor(a!) index) -> ()",
}


def _fn(name: str):
    """The C function ``name`` of the loaded library. Raises RuntimeError when the library is
    unavailable or this build left the kernel out (:func:`tpengine.backends.cpu.cpu_library.missing`)."""
    why = cpu_library.missing(name)
    if why:
        raise RuntimeError(f"CPU C kernel {name} unavailable: {why}")
    return getattr(cpu_library.load(), name)


def _need(ok: bool, op: str, what) -> None:
    """Raise ValueError ``tpengine.<op>: <what()>`` unless ``ok`` (``what`` is called only then)."""
    if not ok:
        raise ValueError(f"tpengine.{op}: {what()}")


def _bf16(op: str, **tensors: torch.Tensor) -> None:
    """Every tensor contiguous bfloat16 on CPU."""
    if _fast_bf16(*tensors.values()):
        return
    for name, t in tensors.items():
        _need(t.dtype == BF16 and t.is_cpu and t.is_contiguous(), op,
              lambda: f"{name} must be a contiguous bfloat16 CPU tensor; got {t.dtype} on {t.device}, "
              f"strides {tuple(t.stride())} for shape {tuple(t.shape)}")


def _fast_bf16(*tensors: torch.Tensor) -> bool:
    """The common case of :func:`_bf16`, cheaply (the error message is built only on failure)."""
    for t in tensors:
        if not (t.dtype == BF16 and t.is_cpu and t.is_contiguous()):
            return False
    return True


def _index(op: str, name: str, t: torch.Tensor, n: int) -> None:
    _need(t.dtype == torch.int64 and t.shape == (n,) and t.is_contiguous(), op,
          lambda: f"{name} must be a contiguous int64 [{n}] tensor; got {t.dtype} {tuple(t.shape)}")


def _same_float(op: str, **tensors: torch.Tensor) -> torch.dtype:
    """Every tensor contiguous on CPU, all bfloat16 or all float32; returns that dtype."""
    dtype = next(iter(tensors.values())).dtype
    if dtype == torch.float32 and all(t.dtype == dtype and t.is_cpu and t.is_contiguous() for t in tensors.values()):
        return dtype
    _bf16(op, **tensors)
    return BF16


def _add_rms_norm(h, x, weight, h_out, y, eps):
    n = h.shape[-1]
    dtype = _same_float("add_rms_norm", h=h, weight=weight, y=y, **({} if x is None else {"x": x, "h_out": h_out}))
    _need(n > 0 and n % 16 == 0 and weight.shape == (n,) and y.shape == h.shape
          and (x is None or x.shape == h.shape == h_out.shape), "add_rms_norm",
          lambda: f"need h, x, h_out, y [..., n] with n % 16 == 0 and weight [n]; got h {tuple(h.shape)}, weight "
          f"{tuple(weight.shape)}, y {tuple(y.shape)}")
    fn = _fn("tpe_add_rms_norm") if dtype == BF16 else _fn("tpe_add_rms_norm_f32")
    fn(h.data_ptr(), None if x is None else x.data_ptr(), weight.data_ptr(),
       None if x is None else h_out.data_ptr(), y.data_ptr(), h.numel() // n, n, eps, torch.get_num_threads())


def _rope(qk, cos, sin):
    _need(qk.dim() == 3, "rope_", lambda: f"qk must be [T, H, D]; got {tuple(qk.shape)}")
    t, heads, d = qk.shape
    dtype = _same_float("rope_", cos=cos, sin=sin)
    _need(qk.dtype == dtype and qk.is_cpu and d % 32 == 0 and qk.stride(-1) == 1
          and qk.stride(-2) == d and (t <= 1 or qk.stride(0) >= heads * d), "rope_",
          lambda: f"qk must be [T, H, D] of cos's dtype ({dtype}) with D % 32 == 0, each row's heads packed and rows "
          f"apart; got {qk.dtype} {tuple(qk.shape)} strides {tuple(qk.stride())}")
    _need(cos.shape == sin.shape == (t, d), "rope_", lambda: f"cos/sin must be [{t}, {d}]; got {tuple(cos.shape)}")
    _fn("tpe_rope" if dtype == BF16 else "tpe_rope_f32")(qk.data_ptr(), qk.stride(0), heads, d, cos.data_ptr(),
                                                         sin.data_ptr(), t, torch.get_num_threads())


def _silu_mul(gate_up, out):
    dtype = _same_float("silu_mul", gate_up=gate_up, out=out)
    inter = out.shape[-1] if out.dim() else 0
    _need(inter > 0 and inter % 16 == 0 and gate_up.shape == (*out.shape[:-1], 2 * inter), "silu_mul",
          lambda: f"need gate_up [..., 2 * inter] and out [..., inter], inter % 16 == 0; got {tuple(gate_up.shape)}, "
          f"{tuple(out.shape)}")
    fn = _fn("tpe_silu_mul") if dtype == BF16 else _fn("tpe_silu_mul_f32")
    fn(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter, torch.get_num_threads())


def _causal_softmax(s, scale):
    _bf16("causal_softmax_", s=s)
    n = s.shape[-1] if s.dim() else 0
    _need(s.dim() >= 2 and s.shape[-2] == n and 1 <= n <= 16384, "causal_softmax_",
          lambda: f"s must be [..., n, n] with 1 <= n <= 16384; got {tuple(s.shape)}")
    _fn("tpe_causal_softmax")(s.data_ptr(), s.numel() // (n * n), n, scale, torch.get_num_threads())


def _copy_rows(src_a, src_b, src_index, dst_a, dst_b, dst_index):
    n = dst_index.shape[0] if dst_index.dim() == 1 else -1
    ss, ds = src_a.stride(), dst_a.stride()
    sa_shape, da_shape = src_a.shape, dst_a.shape
    m = sa_shape[0] if sa_shape else -1
    dtype = dst_a.dtype
    if not ((_fast_bf16(dst_a, dst_b) or (dtype == torch.float32 and dst_b.dtype == dtype and dst_a.is_cpu
                                          and dst_b.is_cpu and dst_a.is_contiguous() and dst_b.is_contiguous()))
            and src_a.dtype == dtype and src_b.dtype == dtype and src_a.is_cpu
            and len(ss) == len(ds) >= 1 and ss[1:] == ds[1:] and src_b.stride() == ss and sa_shape[1:] == da_shape[1:]
            and src_b.shape == sa_shape and dst_b.shape == da_shape and dst_index.dtype == torch.int64
            and dst_index.is_contiguous() and n >= 0
            and (m == n if src_index is None else (src_index.dtype == torch.int64 and src_index.is_contiguous()
                                                   and src_index.shape == (n,)))):
        _copy_rows_explain(src_a, src_b, src_index, dst_a, dst_b, dst_index)
    es = dst_a.element_size()  # the C copy moves bytes: rows of ds[0] elements of this size
    bad = _fn("tpe_copy_rows")(src_a.data_ptr(), src_b.data_ptr(), ss[0] * es,
                               None if src_index is None else src_index.data_ptr(), m, dst_a.data_ptr(),
                               dst_b.data_ptr(), dst_index.data_ptr(), da_shape[0], n, ds[0] * es,
                               torch.get_num_threads())
    if bad >= 0:
        name, idx, rows = ("dst_index", dst_index, da_shape[0]) if bad < n else ("src_index", src_index, m)
        raise index_error(name, idx, bad % n, rows)


def _copy_rows_explain(src_a, src_b, src_index, dst_a, dst_b, dst_index):
    """Raise the ValueError naming what :func:`_copy_rows`'s check found wrong."""
    op, n = "copy_rows", dst_index.shape[0] if dst_index.dim() == 1 else -1
    _same_float(op, dst_a=dst_a, dst_b=dst_b)
    _need(False, op,
          lambda: f"need src_a/src_b [M, *row] of dst's dtype (bfloat16 or float32; equal strides, rows contiguous), "
                  f"dst_a/dst_b [R, *row], "
                  f"int64 indices [N]; got {tuple(src_a.shape)}, {tuple(src_b.shape)}, {tuple(dst_a.shape)}, "
                  f"{tuple(dst_b.shape)}, dst_index {dst_index.dtype} {tuple(dst_index.shape)}"
                  + ("" if src_index is None else f", src_index {src_index.dtype} {tuple(src_index.shape)}")
                  + (f" (no src_index: M must be {n})" if src_index is None else ""))


def index_error(name: str, index: torch.Tensor, i: int, rows: int) -> IndexError:
    """``IndexError: <name>[i] = <value> is out of range for <rows> rows (valid: 0 to <rows - 1>)``."""
    return IndexError(f"{name}[{i}] = {int(index[i])} is out of range for {rows} rows (valid: 0 to {rows - 1})")


def _decode_check(op, a, kv, lens, out, out_dtype):
    _bf16(op, **{"q" if op == "decode_scores" else "p": a}, kv=kv)
    _need(out.dtype == out_dtype and out.is_contiguous() and out.is_cpu, op,
          lambda: f"out must be a contiguous {out_dtype} CPU tensor")
    _need(a.dim() == 4 and kv.dim() == 4 and kv.shape[:2] == a.shape[:2] and a.shape[2] <= 8 and kv.shape[3] <= 256
          and kv.shape[2] > 0, op,
          lambda: f"need [B, Hkv, G<=8, *] and k/v [B, Hkv, L>0, D<=256]; got {tuple(a.shape)}, {tuple(kv.shape)}")
    _index(op, "lens", lens, a.shape[0])


def _len_error(lens, b, cap):
    return ValueError(f"context length {int(lens[b])} exceeds the {cap} keys given")


def _decode_scores(q, k, lens, scores, scale):
    _decode_check("decode_scores", q, k, lens, scores, torch.float32)
    b, hkv, g, d = q.shape
    cap = k.shape[2]
    _need(k.shape[3] == d and scores.shape == (b, hkv, g, cap), "decode_scores",
          lambda: f"need k [..., {d}] and scores [{b}, {hkv}, {g}, {cap}]; got {tuple(k.shape)}, {tuple(scores.shape)}")
    bad = _fn("tpe_decode_scores")(q.data_ptr(), k.data_ptr(), lens.data_ptr(), scores.data_ptr(), b * hkv, hkv, g,
                                   cap, d, scale, torch.get_num_threads())
    if bad >= 0:
        raise _len_error(lens, bad, cap)


def _decode_pv(p, v, lens, out):
    _decode_check("decode_pv", p, v, lens, out, BF16)
    b, hkv, g, cap = p.shape
    d = v.shape[3]
    _need(v.shape[2] == cap and out.shape == (b, hkv, g, d), "decode_pv",
          lambda: f"need v [{b}, {hkv}, {cap}, D] and out [{b}, {hkv}, {g}, D]; got {tuple(v.shape)}, "
                  f"{tuple(out.shape)}")
    bad = _fn("tpe_decode_pv")(p.data_ptr(), v.data_ptr(), lens.data_ptr(), out.data_ptr(), b * hkv, hkv, g, cap, d,
                               torch.get_num_threads())
    if bad >= 0:
        raise _len_error(lens, bad, cap)


def _argmax(op: str, x: torch.Tensor, index: torch.Tensor, along_rows: bool) -> None:
    _need(x.dtype in (torch.float32, BF16) and x.is_cpu and x.dim() == 2 and x.numel() > 0 and x.stride(1) == 1
          and x.stride(0) >= x.shape[1], op,
          lambda: f"x must be a non-empty float32 or bfloat16 [rows, cols] CPU tensor with contiguous rows; got "
          f"{x.dtype} {tuple(x.shape)} strides {tuple(x.stride())} on {x.device}")
    rows, cols = x.shape
    _index(op, "index", index, rows if along_rows else cols)
    fn = _fn(f"tpe_{'row' if along_rows else 'col'}_argmax_{'bf16' if x.dtype == BF16 else 'f32'}")
    fn(x.data_ptr(), rows, cols, x.stride(0), index.data_ptr(), torch.get_num_threads())


def _row_argmax(x, index):
    _argmax("row_argmax", x, index, True)


def _col_argmax(x, index):
    _argmax("col_argmax", x, index, False)


_IMPLS = {"add_rms_norm": _add_rms_norm, "rope_": _rope, "silu_mul": _silu_mul, "causal_softmax_": _causal_softmax,
          "copy_rows": _copy_rows, "decode_scores": _decode_scores, "decode_pv": _decode_pv,
          "row_argmax": _row_argmax, "col_argmax": _col_argmax}
for _name, _impl in _IMPLS.items():
    _LIB.define(SCHEMAS[_name])
    _LIB.impl(_name, _impl, "CPU")

ops = torch.ops.tpengine
