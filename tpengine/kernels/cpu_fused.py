"""Fused bfloat16 element-wise ops of the decoder layer on CPU, through ``cpu_fused.c`` (built by
:mod:`tpengine.kernels.cpu_native`): residual add + RMSNorm, RoPE in place, SiLU(gate) * up, the
prefill attention's scale + causal mask + softmax in place, and the KV cache's row copies.

In bfloat16 on CPU each of these is a chain of 2-7 torch ops, each a dispatch and a pass over
memory; at 64 decode tokens the chains took ~6 ms of a ~50 ms SmolLM2-135M step (~2.7 ms here),
and in a 64 x 128-token prefill residual add + RMSNorm took ~4 ms per call (0.8 ms here) and the
scale + mask + softmax ~5 ms per layer (1.6 ms here).
Each function keeps its chain's roundings op by op (see ``cpu_fused.c``) and returns None when
the C kernels cannot take the tensors (not bfloat16 on CPU, shapes the kernels do not cover, or
the library is unavailable), so the caller runs the torch ops instead: float32 never comes here.
"""

from __future__ import annotations

import torch

from tpengine.kernels import cpu_native


def add_rms_norm(h: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``h2 = h + x`` (``h`` itself when ``x`` is None) and ``weight * rms_norm(h2)``, HF Llama's
    RMSNorm in float32 inside. Shapes: ``h``, ``x [..., n]`` with ``n % 16 == 0``, ``weight [n]``.
    Returns ``(h2, normed)`` (``h2`` is ``h`` when ``x`` is None; neither input is written), or
    None (see module)."""
    n = h.shape[-1]
    if (n == 0 or n % 16 or weight.shape != (n,) or (x is not None and x.shape != h.shape)
            or not cpu_native.usable(h, weight, *(() if x is None else (x,)))):
        return None
    h, weight = h.contiguous(), weight.contiguous()
    x = None if x is None else x.contiguous()  # kept alive across the call (a temporary's memory is freed)
    h2 = h if x is None else torch.empty_like(h)
    y = torch.empty_like(h)
    cpu_native.load().tpe_add_rms_norm(h.data_ptr(), None if x is None else x.data_ptr(), weight.data_ptr(),
                                       h2.data_ptr(), y.data_ptr(), h.numel() // n, n, eps, torch.get_num_threads())
    return h2, y


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """HF's RoPE ``qk * cos + rotate_half(qk) * sin`` in place. Shapes: ``qk [1, T, H, D]`` (may be
    a view into a wider row, e.g. the fused q/k/v GEMM output: last two dims packed, rows evenly
    strided), ``cos``/``sin [1, T, D]``; ``D % 32 == 0``. Returns ``qk``, or None (see module)."""
    if qk.dim() != 4 or qk.shape[0] != 1:
        return None
    _, t, heads, d = qk.shape
    if (d % 32 or qk.stride(-1) != 1 or qk.stride(-2) != d or (t > 1 and qk.stride(1) < heads * d)
            or cos.shape != (1, t, d) or sin.shape != (1, t, d) or not cpu_native.usable(qk, cos, sin)):
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    cpu_native.load().tpe_rope(qk.data_ptr(), qk.stride(1), heads, d, cos.data_ptr(), sin.data_ptr(), t,
                               torch.get_num_threads())
    return qk


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor | None:
    """``silu(gate) * up`` for ``gate_up [..., 2 * inter]`` (gate first), ``inter % 16 == 0``, as
    torch computes ``F.silu(gate).mul_(up)`` in bfloat16. Returns a new ``[..., inter]`` tensor, or
    None (see module)."""
    if gate_up.shape[-1] != 2 * inter or inter <= 0 or inter % 16 or not cpu_native.usable(gate_up):
        return None
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    cpu_native.load().tpe_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter,
                                   torch.get_num_threads())
    return out


def causal_softmax_(s: torch.Tensor, scale: float) -> torch.Tensor | None:
    """In place: ``softmax(s * scale + causal mask, dim=-1)`` for square score blocks
    ``s [..., n, n]`` (query ``i`` sees keys ``j <= i``), with the roundings of torch's bfloat16
    ``s.mul_(scale).add_(mask)`` then ``torch.softmax`` (float32 inside; masked keys get 0).
    ``s`` contiguous, ``1 <= n <= 16384``. Returns ``s``, or None (see module)."""
    n = s.shape[-1]
    if (s.dim() < 2 or s.shape[-2] != n or not 1 <= n <= 16384 or not s.is_contiguous()
            or not cpu_native.usable(s)):
        return None
    cpu_native.load().tpe_causal_softmax(s.data_ptr(), s.numel() // (n * n), n, scale, torch.get_num_threads())
    return s


def copy_rows(src: tuple[torch.Tensor, torch.Tensor], dst: tuple[torch.Tensor, torch.Tensor],
              dst_index: torch.Tensor, src_index: torch.Tensor | None = None) -> bool:
    """``dst[j][dst_index[i]] = src[j][src_index[i] if src_index is not None else i]`` for j = 0, 1
    (keys and values): one C call instead of an ``index_copy_`` (+ ``index_select``) per tensor.

    Shapes: ``src`` two ``[M, *row]`` tensors with equal strides whose rows are each contiguous
    (rows may be any distance apart, e.g. the k and v parts of a fused q/k/v output; ``M == N``
    without ``src_index``); ``dst`` two contiguous ``[R, *row]`` tensors of the same dtype;
    ``dst_index``/``src_index [N]`` int64 in range -- the caller's guarantee, not checked. Returns
    False, copying nothing, when the C kernels cannot take it (bfloat16 on CPU only; see module),
    so the caller uses torch."""
    (sa, sb), (da, db) = src, dst
    n, row = dst_index.shape[0], da.shape[1:]
    if (n == 0 or sa.dim() == 0 or sa.shape[0] == 0 or sa.shape[1:] != row or sb.shape != sa.shape
            or sb.stride() != sa.stride() or not sa[0].is_contiguous() or db.shape != da.shape
            or not (da.is_contiguous() and db.is_contiguous()) or sa.dtype != da.dtype or sb.dtype != da.dtype
            or (sa.shape[0] != n if src_index is None else src_index.shape != (n,))
            or not cpu_native.usable(sa, sb, da, db)):
        return False
    elem = sa.element_size()
    di = dst_index.to(torch.int64).contiguous()
    si = None if src_index is None else src_index.to(torch.int64).contiguous()
    cpu_native.load().tpe_copy_rows(sa.data_ptr(), sb.data_ptr(), sa.stride(0) * elem,
                                    None if si is None else si.data_ptr(), da.data_ptr(), db.data_ptr(),
                                    di.data_ptr(), n, da[0].numel() * elem, torch.get_num_threads())
    return True
