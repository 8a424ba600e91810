"""bfloat16 decode attention on CPU through a C kernel (``cpu_decode.c``, built by
:mod:`tpengine.backends.cpu.cpu_library`).

Why: one decode step attends one query token per sequence over contiguous ``[B * Hkv, L, D]``
keys and values (see :mod:`tpengine.backends.cpu.kv_mirror`). ``torch.bmm`` does that as B * Hkv
matrices of ``G x D @ D x L`` (G query heads per KV head) and pays oneDNN's per-matrix overhead,
reading K and V well below the memory's streaming rate (docs/notes/kernels.md). The kernel computes
the same two products with AVX512-BF16 dot products (``vdpbf16ps``), prefetching ahead across
sequences, and reads only the visible keys of each sequence (not the mirror's masked tail). The
float32 softmax between them stays ``torch.softmax``, so the arithmetic is the torch path's:
scores rounded to bfloat16 then scaled in float32, probabilities rounded to bfloat16, ``p @ V``
accumulated in float32 -- up to the order of the float32 sums (a rare one-ulp difference in a
bfloat16 result).
"""

from __future__ import annotations

import torch

from tpengine.backends.cpu import cpu_library
from tpengine.backends.cpu.cpu_ops import ops

MAX_G, MAX_D = 8, 256  # the C code's stack buffers: query heads per KV head, head size
#: the C functions (AVX512-BF16 builds only; elsewhere torch.bmm is faster: cpu_decode.c)
KERNELS = ("tpe_decode_scores", "tpe_decode_pv")


def available(q: torch.Tensor, g: int, d: int, cpu_kernels: bool) -> bool:
    """Whether :func:`decode_attention` can take this step: ``cpu_kernels`` (``EngineConfig.cpu_kernels``),
    the C kernels are usable (:func:`tpengine.backends.cpu.cpu_library.usable`: a CPU bfloat16 query, the
    library has :data:`KERNELS`), ``g <= 8`` query heads per KV head and ``d <= 256``."""
    return cpu_kernels and g <= MAX_G and d <= MAX_D and cpu_library.usable(q, kernels=KERNELS)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_lens: torch.Tensor,
                     scale: float, soft_cap: float | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q @ k^T * scale, masked) @ v`` for one query token per sequence, bfloat16 on CPU,
    through the ops ``torch.ops.tpengine.decode_scores`` and ``decode_pv``. ``soft_cap`` ``c``: the
    scaled scores become ``tanh(s / c) * c`` (in torch, between the two ops); ``bias``: a float32
    additive mask broadcastable to ``[B, Hkv, G, L]`` (0 or -inf, e.g. a sliding window's,
    :func:`tpengine.backends.cpu.attention.key_mask`) added before the softmax, which must mask the keys
    from ``context_lens`` on too when ``soft_cap`` is given (the cap turns their -inf into ``-c``).

    Shapes: ``q [B, Hkv, G, D]``, ``k`` and ``v [B, Hkv, L, D]`` contiguous (``L`` >= every
    length), ``context_lens [B]`` int64: sequence ``b`` sees keys ``< context_lens[b]`` (a
    length-0 padding row sees key 0). Returns ``[B, Hkv, G, D]`` bfloat16. Raises ValueError on
    a shape, dtype or layout mismatch or a length over ``L`` (checked in the C code, no extra
    pass); RuntimeError if the library is unavailable (check :func:`available` first).
    """
    if not cpu_library.has(*KERNELS):
        raise RuntimeError(f"CPU C decode kernels unavailable: {cpu_library.unavailable_reason() or cpu_library.isa()}")
    b, hkv, g, d = q.shape
    if (k.shape != v.shape or k.shape[:2] != (b, hkv) or k.shape[3] != d or context_lens.shape != (b,)
            or g > MAX_G or d > MAX_D):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, context_lens "
                         f"{tuple(context_lens.shape)}: expected [B, Hkv, G<={MAX_G}, D<={MAX_D}], "
                         "[B, Hkv, L, D] x2, [B]")
    if not all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.device.type == "cpu" for t in (k, v)):
        raise ValueError("k and v must be contiguous bfloat16 CPU tensors")
    cap = k.shape[2]
    if cap == 0:  # every sequence, even a length-0 padding row, reads key 0
        raise ValueError("k and v hold no keys (L = 0)")
    q = q.to(torch.bfloat16).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    scores = torch.empty(b, hkv, g, cap, dtype=torch.float32)
    ops.decode_scores(q, k, lens, scores, scale)
    if soft_cap is not None:
        scores.div_(soft_cap).tanh_().mul_(soft_cap)
    if bias is not None:
        scores.add_(bias)
    p = torch.softmax(scores, dim=-1).to(torch.bfloat16)
    out = torch.empty(b, hkv, g, d, dtype=torch.bfloat16)
    ops.decode_pv(p, v, lens, out)
    return out
