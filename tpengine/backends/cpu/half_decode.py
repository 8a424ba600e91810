"""Half-precision decode attention on CPU where the C kernel does not apply (C kernels off, or a
CPU without AVX512-BF16): :func:`half_decode` as SDPA or as HF's eager arithmetic (half-precision
bmm, float32 softmax), and the key masks both take (:func:`key_mask`). Used by
:class:`tpengine.backends.cpu.attention.CPUAttentionBackend`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: SDPA for a half-precision decode of up to this many ``B * Hkv`` rows, else the bmm path. Not
#: measured per machine: the two paths round differently, and the C kernel (the bmm path's
#: arithmetic) must give the tokens this path gives.
SDPA_ROWS = 8


def half_decode(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, valid: torch.Tensor, bias: torch.Tensor,
                scale: float, sdpa: bool) -> torch.Tensor:
    """Half-precision decode attention without the C kernel: ``qg [B, Hkv, G, D]``, ``kg``/``vg``
    ``[B, Hkv, L, D]`` contiguous, ``valid``/``bias`` from :func:`key_mask` -> ``[B, Hkv, G, D]``.
    ``sdpa``: one ``scaled_dot_product_attention`` call; else as HF's eager attention computes it
    (half-precision bmm, float32 softmax), the arithmetic of the C kernel
    (:mod:`tpengine.backends.cpu.cpu_decode`)."""
    if sdpa:
        return F.scaled_dot_product_attention(qg, kg, vg, attn_mask=valid, scale=scale)
    nb, hkv, g, d = qg.shape
    s = torch.bmm(qg.reshape(nb * hkv, g, d), kg.view(nb * hkv, -1, d).transpose(1, 2))
    s = s.float().mul_(scale).view(nb, hkv, g, -1).add_(bias)
    p = torch.softmax(s, dim=-1).to(qg.dtype).view(nb * hkv, g, -1)
    return torch.bmm(p, vg.view(nb * hkv, -1, d)).view(nb, hkv, g, d)


def key_mask(context_lens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid, bias)``, ``[B, 1, 1, n]``: ``valid`` (bool) iff key position ``j`` is visible to
    sequence ``b``, i.e. ``j < context_lens[b]`` (a batch-padding row, length 0, sees position 0
    so its softmax stays finite; its output is zeroed after); ``bias`` the same as a float32
    additive mask (0 or -inf)."""
    valid = torch.arange(n, device=context_lens.device)[None, :] < context_lens[:, None]
    valid[:, 0] |= context_lens == 0
    valid = valid[:, None, None, :]
    return valid, torch.zeros(valid.shape, device=valid.device).masked_fill_(~valid, float("-inf"))
