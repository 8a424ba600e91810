"""The plain torch paths every layer runs where no device backend bound anything faster: the fused
element-wise ops (residual add + RMSNorm, RoPE, SiLU(gate) * up), the linear product, and the greedy
pick's maximum. Device-neutral: the model's layers default to these (a layer built by hand in a test,
or a device without a platform package), and a device's platform
(:class:`tpengine.backends.platform.Platform`) binds its own in their place.

Each op is the same torch ops in the same order as the HF module it stands for, so results match HF
bit for bit in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tpengine.comm import all_reduce


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dimension (HF's RoPE convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def add_rms_norm(h: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h2 = h + x`` (``h`` itself when ``x`` is None) and ``weight * rms_norm(h2)`` (float32 inside).
    A ``weight`` of ``h``'s dtype is HF Llama's RMSNorm (the normalized value rounded to that dtype, then
    multiplied); a float32 ``weight`` beside half-precision ``h`` multiplies in float32 and rounds once,
    as Gemma's and OLMo 2's norms do. Shapes: ``h``, ``x [..., n]``, ``weight [n]``. Returns
    ``(h2, normed)``; neither input is written."""
    n = h.shape[-1]
    if x is not None:
        h = h + x
    if h.dtype == torch.float32 and weight.dtype == torch.float32:
        return h, F.rms_norm(h, (n,), weight, eps)
    if weight.dtype == torch.float32:
        return h, F.rms_norm(h.float(), (n,), weight, eps).to(h.dtype)
    return h, weight * F.rms_norm(h.float(), (n,), None, eps).to(h.dtype)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's RoPE ``qk * cos + rotate_half(qk) * sin`` for every head: ``qk [..., T, H, D]``,
    ``cos``/``sin [..., T, D]`` -> a new ``[..., T, H, D]`` tensor of ``qk``'s dtype. Tables kept in
    float32 beside half-precision heads (OLMo 2's rotary embedding) rotate in float32 and round once, as
    HF's ``apply_rotary_pos_emb`` of those families does."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [..., T, 1, D]: every head
    out = qk * cos + rotate_half(qk) * sin
    return out if out.dtype == qk.dtype else out.to(qk.dtype)


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [..., 2 * inter]`` (gate first) -> a new ``[..., inter]`` tensor."""
    return F.silu(gate_up[..., :inter]).mul_(gate_up[..., inter:])


def gelu_tanh_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (GeGLU with torch's tanh-approximate GELU, HF's ``gelu_pytorch_tanh``) for
    ``gate_up [..., 2 * inter]`` (gate first) -> a new ``[..., inter]`` tensor."""
    return F.gelu(gate_up[..., :inter], approximate="tanh").mul_(gate_up[..., inter:])


def soft_cap_(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``tanh(x / cap) * cap`` in place on ``x`` (any shape), as HF's Gemma 2 head computes its final
    logits (three ops, each rounded to ``x``'s dtype). Returns ``x``."""
    return x.div_(cap).tanh_().mul_(cap)


class TorchOps:
    """The fused element-wise ops as plain torch chains: the ops object a layer holds until a device's
    platform gives it another (the CPU's :class:`tpengine.backends.cpu.cpu_fused.FusedOps`). Every
    layer of a model holds the same object, so no forward branches on a flag. ``cpu_kernels`` is False:
    these ops call no C kernel."""

    cpu_kernels = False

    def __repr__(self) -> str:
        return "TorchOps()"

    def add_rms_norm(self, h: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`add_rms_norm`."""
        return add_rms_norm(h, x, weight, eps)

    def all_reduce_add_rms_norm(self, t: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + all_reduce(t), weight * rms_norm(h + all_reduce(t)))``: a row-parallel layer's partial
        output ``t`` summed over the ranks (:func:`tpengine.comm.all_reduce`), then :func:`add_rms_norm`.
        Shapes: ``t``, ``h [rows, n]``, ``weight [n]``."""
        return add_rms_norm(h, all_reduce(t), weight, eps)

    def rope_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """:func:`rope` (a new tensor; the caller uses the return value)."""
        return rope(qk, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """:func:`silu_mul`."""
        return silu_mul(gate_up, inter)

    def gelu_tanh_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """:func:`gelu_tanh_mul`."""
        return gelu_tanh_mul(gate_up, inter)

    def soft_cap_(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """:func:`soft_cap_`."""
        return soft_cap_(x, cap)


def bind_linear(weight: torch.Tensor | None, bias: torch.Tensor | None,
                quant=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A linear layer's implementation without a device's kernels: a quantized weight's own
    (``quant.bind()``, :class:`~tpengine.model.quant.weights.QuantizedWeight`) plus ``bias``, else
    ``F.linear(x, weight, bias)``. ``run(x [rows, in]) -> [rows, out]``.

    Raises:
        ValueError: neither a weight nor a quantized weight (a layer whose weight a platform replaced
            by a layout only that platform can run, bound without it).
    """
    if quant is not None:
        q = quant.bind()
        return q if bias is None else (lambda x: q(x) + bias)
    if weight is None:
        raise ValueError("a linear layer without a plain or quantized weight has no torch path: its platform "
                         "must bind it (tpengine.backends.platform.Platform.bind_model)")
    return lambda x: F.linear(x, weight, bias)


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.max(dim=-1)`` of ``[B, V]`` logits: each row's maximum and the first index holding it (NaN
    the largest). Returns ``(values [B] in x.dtype, indices [B] int64)``."""
    return x.max(dim=-1)


def col_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.max(dim=0)`` of ``[V, B]`` transposed logits: :func:`row_max` of ``x.T``."""
    return x.max(dim=0)
