"""Fused element-wise ops of the decoder layer, each choosing its C kernel or its torch chain itself:
residual add + RMSNorm, RoPE, SiLU(gate) * up, the prefill attention's scale + causal mask +
softmax, and the KV cache's row copies.

Every function takes ``cpu_kernels`` (``EngineConfig.cpu_kernels``, held by the layers as
``self.cpu_kernels``): when it is set and the C kernels can take the tensors (bfloat16 on CPU, and for
the residual add + RMSNorm and SiLU * up also float32; shapes they cover; the library loads:
:mod:`tpengine.backends.cpu.cpu_library`), the op runs as one ``torch.ops.tpengine.*`` call
(:mod:`tpengine.backends.cpu.cpu_ops`, ``cpu_fused.c``), which keeps
the torch chain's roundings op by op, up to the order of a float32 sum and the last bit of exp;
otherwise it runs the torch chain (the same ops in the same order as HF's modules, bit-identical
to HF in float32). Callers use the return value and never branch. On CPU each chain is 2-10
torch ops, each a dispatch and a pass over memory (the measured gains are in ``docs``/the README).
"""

from __future__ import annotations

import functools

import torch

from tpengine import forensics
from tpengine.backends import torch_ops
from tpengine.backends.cpu import cpu_library
from tpengine.backends.cpu.cpu_ops import index_error, ops
from tpengine.backends.torch_ops import TorchOps
from tpengine.comm import all_reduce
from tpengine.distributed import activation_comm


def add_rms_norm(h: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 cpu_kernels: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``h2 = h + x`` (``h`` itself when ``x`` is None) and ``weight * rms_norm(h2)``, HF Llama's
    RMSNorm (float32 inside). Shapes: ``h``, ``x [..., n]``, ``weight [n]``. Returns ``(h2, normed)``;
    neither input is written. C kernel: bfloat16 or float32 on CPU, ``n % 16 == 0``."""
    n = h.shape[-1]
    if (cpu_kernels and n and n % 16 == 0 and weight.shape == (n,) and (x is None or x.shape == h.shape)
            and cpu_library.usable(h, weight, *(() if x is None else (x,)), float32=True,
                                   kernels=("tpe_add_rms_norm", "tpe_add_rms_norm_f32"))):
        h, weight = h.contiguous(), weight.contiguous()
        x = None if x is None else x.contiguous()  # kept alive across the call (a temporary's memory is freed)
        h2 = h if x is None else torch.empty_like(h)
        y = torch.empty_like(h)
        ops.add_rms_norm(h, x, weight, None if x is None else h2, y, eps)
        return h2, y
    return torch_ops.add_rms_norm(h, x, weight, eps)


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cpu_kernels: bool) -> torch.Tensor:
    """HF's RoPE ``qk * cos + rotate_half(qk) * sin`` for every head. Shapes: ``qk [..., T, H, D]``
    (may be a view into a wider row, e.g. the fused q/k/v GEMM output), ``cos``/``sin [..., T, D]``
    (the same leading dims). Returns the result: ``qk`` itself, rotated in place, from the C kernel
    (bfloat16 or float32 on CPU, tables of ``qk``'s dtype, ``D % 32 == 0``, each token's heads packed,
    tokens evenly strided; the same roundings as the torch ops), else a new tensor from the torch ops."""
    d = qk.shape[-1]
    if cpu_kernels and qk.dim() >= 3 and cos.shape == sin.shape == (*qk.shape[:-2], d) and d % 32 == 0 \
            and cpu_library.usable(qk, cos, sin, float32=True, kernels=("tpe_rope", "tpe_rope_f32")):
        try:
            rows = qk.view(-1, *qk.shape[-2:])  # [T, H, D] over the same memory
        except RuntimeError:
            rows = None
        t, heads = rows.shape[:2] if rows is not None else (0, 0)
        if (rows is not None and rows.stride(-1) == 1 and rows.stride(-2) == d
                and (t <= 1 or rows.stride(0) >= heads * d)):
            ops.rope_(rows, cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous())
            return qk
    return torch_ops.rope(qk, cos, sin)


def soft_cap_(x: torch.Tensor, cap: float, cpu_kernels: bool) -> torch.Tensor:
    """:func:`tpengine.backends.torch_ops.soft_cap_` in place on ``x``: one C pass over a contiguous
    bfloat16 tensor on CPU (``tpe_soft_cap``: the same three roundings, tanh up to its last float32 bits),
    else torch's three ops. Returns ``x``."""
    if cpu_kernels and x.dtype == torch.bfloat16 and x.is_contiguous() and cpu_library.usable(
            x, kernels=("tpe_soft_cap",)):
        cpu_library.load().tpe_soft_cap(x.data_ptr(), x.numel(), float(cap), torch.get_num_threads())
        return x
    return torch_ops.soft_cap_(x, cap)


def silu_mul(gate_up: torch.Tensor, inter: int, cpu_kernels: bool) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [..., 2 * inter]`` (gate first) -> a new ``[..., inter]``
    tensor, computed as torch's ``F.silu(gate).mul_(up)`` (C kernel: bfloat16 or float32 on CPU,
    ``inter % 16 == 0``)."""
    if (cpu_kernels and gate_up.shape[-1] == 2 * inter and inter > 0 and inter % 16 == 0
            and cpu_library.usable(gate_up, float32=True, kernels=("tpe_silu_mul", "tpe_silu_mul_f32"))):
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        ops.silu_mul(gate_up, out)
        return out
    return torch_ops.silu_mul(gate_up, inter)


def gelu_tanh_mul(gate_up: torch.Tensor, inter: int, cpu_kernels: bool) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``gate_up [..., 2 * inter]`` (gate first) -> a new ``[..., inter]``
    tensor, computed as torch's ``F.gelu(gate, approximate="tanh").mul_(up)`` (C kernel
    ``tpe_gelu_tanh_mul``: bfloat16 or float32 on CPU, ``inter % 16 == 0``; equal to torch's up to the last
    float32 bits of tanh before the rounding)."""
    if (cpu_kernels and gate_up.shape[-1] == 2 * inter and inter > 0 and inter % 16 == 0
            and cpu_library.usable(gate_up, float32=True, kernels=("tpe_gelu_tanh_mul", "tpe_gelu_tanh_mul_f32"))):
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        lib = cpu_library.load()
        fn = lib.tpe_gelu_tanh_mul if gate_up.dtype == torch.bfloat16 else lib.tpe_gelu_tanh_mul_f32
        fn(gate_up.data_ptr(), out.data_ptr(), out.numel() // inter, inter, torch.get_num_threads())
        return out
    return torch_ops.gelu_tanh_mul(gate_up, inter)


@functools.lru_cache(maxsize=8)
def causal_bias(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[n, n]`` additive causal mask: 0 on and below the diagonal, -inf above."""
    return torch.zeros(n, n, dtype=dtype, device=device).masked_fill_(
        torch.ones(n, n, dtype=torch.bool, device=device).triu_(1), float("-inf"))


def causal_softmax_(s: torch.Tensor, scale: float, cpu_kernels: bool) -> torch.Tensor:
    """``softmax(s * scale + causal mask, dim=-1)`` for square score blocks ``s [..., n, n]`` (query
    ``i`` sees keys ``j <= i``; masked keys get 0), as torch's ``s.mul_(scale).add_(mask)`` then
    ``torch.softmax`` (float32 inside for half types). ``s`` is overwritten; returns the result
    (``s`` itself from the C kernel: bfloat16 on CPU, ``s`` contiguous, ``n <= 16384``). Raises
    ValueError if ``s`` is not ``[..., n, n]``."""
    n = s.shape[-1] if s.dim() else 0
    if s.dim() < 2 or s.shape[-2] != n:
        raise ValueError(f"causal_softmax_: s must be square score blocks [..., n, n]; got {tuple(s.shape)}")
    if (cpu_kernels and s.dim() >= 2 and s.shape[-2] == n and 1 <= n <= 16384 and s.is_contiguous()
            and cpu_library.usable(s, kernels=("tpe_causal_softmax",))):
        ops.causal_softmax_(s, scale)
        return s
    # adding a cached [n, n] mask is one pass over s; masked_fill_ would build a boolean mask per call
    return torch.softmax(s.mul_(scale).add_(causal_bias(n, s.dtype, s.device)), dim=-1)


def _int64(index: torch.Tensor) -> torch.Tensor:
    return index if index.dtype == torch.int64 and index.is_contiguous() else index.to(torch.int64).contiguous()


def copy_rows(src: tuple[torch.Tensor, torch.Tensor], dst: tuple[torch.Tensor, torch.Tensor],
              dst_index: torch.Tensor, src_index: torch.Tensor | None = None, *, cpu_kernels: bool) -> None:
    """``dst[j][dst_index[i]] = src[j][src_index[i] if src_index is not None else i]`` for j = 0, 1
    (keys and values), cast to the destination dtype: one C call (bfloat16 or float32 on CPU, every tensor of
    one dtype) instead of an
    ``index_copy_`` (+ ``index_select``) per tensor.

    Shapes: ``src`` two ``[M, *row]`` tensors (``M == N`` without ``src_index``), ``dst`` two
    ``[R, *row]`` tensors, ``dst_index``/``src_index [N]`` int64. Raises ValueError when the
    numbers of rows and indices differ, IndexError
    ``dst_index[i] = v is out of range for R rows (valid: 0 to R-1)`` (or ``src_index``, ``M``) for
    an index out of range, never writing out of bounds: the C kernel checks every index before it
    writes anything (torch's ``index_copy_`` may have copied the rows before the bad one).
    """
    (sa, sb), (da, db) = src, dst
    n = dst_index.shape[0]
    m = sa.shape[0] if sa.dim() else 0
    if (m if src_index is None else src_index.shape[0]) != n:
        raise ValueError(f"copy_rows: {n} dst_index entries for {m} source rows"
                         + ("" if src_index is None else f" and {src_index.shape[0]} src_index entries"))
    if cpu_kernels and n and cpu_library.usable(sa, sb, da, db, float32=True):
        ss = sa.stride()  # the C layout: rows of dst contiguous, src rows equally strided and each contiguous
        if (ss[1:] == da.stride()[1:] and sb.stride() == ss and da.is_contiguous() and db.is_contiguous()
                and sa.shape[1:] == da.shape[1:] and sb.shape == sa.shape and db.shape == da.shape):
            ops.copy_rows(sa, sb, None if src_index is None else _int64(src_index), da, db, _int64(dst_index))
            return
    try:
        for s, d in ((sa, da), (sb, db)):
            d.index_copy_(0, dst_index, (s if src_index is None else s.index_select(0, src_index)).to(d.dtype))
    except (IndexError, RuntimeError):
        for name, index, rows in (("dst_index", dst_index, da.shape[0]),
                                  ("src_index", src_index, sa.shape[0] if sa.dim() else 0)):
            if index is not None and index.numel() and ((index < 0) | (index >= rows)).any():
                raise index_error(name, index, int(((index < 0) | (index >= rows)).nonzero()[0]), rows) from None
        raise


class FusedOps(TorchOps):
    """The fused element-wise ops of one model, bound once to its ``cpu_kernels`` setting
    (``EngineConfig.cpu_kernels``): every layer of the model holds the same object
    (:func:`tpengine.model.surgery.build_model`), so the layers' forwards never branch on a flag.
    Each method is the module function of the same name (shapes and results there); with
    ``cpu_kernels`` False, or tensors the C kernels do not take (any device but the CPU), it runs
    the torch chain."""

    def __init__(self, cpu_kernels: bool):
        self.cpu_kernels = cpu_kernels  # shadows TorchOps's False

    def __repr__(self) -> str:
        return f"FusedOps(cpu_kernels={self.cpu_kernels})"

    def add_rms_norm(self, h: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`add_rms_norm`."""
        return add_rms_norm(h, x, weight, eps, self.cpu_kernels)

    def all_reduce_add_rms_norm(self, t: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + all_reduce(t), weight * rms_norm(h + all_reduce(t)))``: a row-parallel layer's partial
        output ``t`` summed over the ranks, then :func:`add_rms_norm`. Through the shared-memory comm
        in one C call where it takes the tensors (``ShmComm.all_reduce_add_rms_norm``: one pass over
        the ranks' slots instead of a sum written and read again), else the two steps; the results
        are the same. Shapes: ``t``, ``h [rows, n]``, ``weight [n]``. ``t`` may be written."""
        comm = activation_comm()
        if self.cpu_kernels and comm is not None:  # the shared-memory comm (tpengine.backends.cpu.shm)
            prev = forensics.enter("all_reduce + RMSNorm of the activations (shared memory)")
            out = comm.all_reduce_add_rms_norm(t, h, weight, eps)
            forensics.leave(prev)  # not on an exception: the report names this collective
            if out is not None:
                return out
        return add_rms_norm(h, all_reduce(t), weight, eps, self.cpu_kernels)

    def rope_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """:func:`rope_`."""
        return rope_(qk, cos, sin, self.cpu_kernels)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """:func:`silu_mul`."""
        return silu_mul(gate_up, inter, self.cpu_kernels)

    def gelu_tanh_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """:func:`gelu_tanh_mul`."""
        return gelu_tanh_mul(gate_up, inter, self.cpu_kernels)

    def soft_cap_(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """:func:`soft_cap_`."""
        return soft_cap_(x, cap, self.cpu_kernels)
