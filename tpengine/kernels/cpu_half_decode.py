"""Half-precision decode attention on CPU where the C kernel does not apply (C kernels off, or a
CPU without AVX512-BF16): :func:`half_decode` as SDPA or as HF's eager arithmetic (half-precision
bmm, float32 softmax), the key masks both take (:func:`key_mask`), and the measured switch between
the two (:func:`choose_sdpa_rows`, issue 17: timed per machine instead of a threshold from one
CPU). Used by :class:`tpengine.kernels.cpu_attention.CPUAttentionBackend`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpengine.kernels.measured import Choice, timings

#: Where none was measured (:func:`choose_sdpa_rows`): SDPA for a half-precision decode of up to this
#: many ``B * Hkv`` rows, else the bmm path.
SDPA_ROWS = 8
#: ``B * Hkv`` rows and keys per row the crossover is timed at.
SDPA_BUCKETS, SDPA_KEYS = (1, 2, 4, 8, 16, 32, 64), 256


def half_decode(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, valid: torch.Tensor, bias: torch.Tensor,
                scale: float, sdpa: bool) -> torch.Tensor:
    """Half-precision decode attention without the C kernel: ``qg [B, Hkv, G, D]``, ``kg``/``vg``
    ``[B, Hkv, L, D]`` contiguous, ``valid``/``bias`` from :func:`key_mask` -> ``[B, Hkv, G, D]``.
    ``sdpa``: one ``scaled_dot_product_attention`` call; else as HF's eager attention computes it
    (half-precision bmm, float32 softmax). Which is faster depends on the machine and ``B * Hkv``
    (:func:`choose_sdpa_rows`)."""
    if sdpa:
        return F.scaled_dot_product_attention(qg, kg, vg, attn_mask=valid, scale=scale)
    nb, hkv, g, d = qg.shape
    s = torch.bmm(qg.reshape(nb * hkv, g, d), kg.view(nb * hkv, -1, d).transpose(1, 2))
    s = s.float().mul_(scale).view(nb, hkv, g, -1).add_(bias)
    p = torch.softmax(s, dim=-1).to(qg.dtype).view(nb * hkv, g, -1)
    return torch.bmm(p, vg.view(nb * hkv, -1, d)).view(nb, hkv, g, d)


def choose_sdpa_rows(g: int, d: int, dtype: torch.dtype) -> Choice:
    """The most ``B * Hkv`` rows up to which SDPA beats the bmm path of :func:`half_decode` at every
    one of :data:`SDPA_BUCKETS` (0: never), timed on this machine with ``G`` query heads per KV
    head, head size ``d`` and :data:`SDPA_KEYS` keys (:func:`tpengine.kernels.measured.timings`,
    cached per machine). A noisy measurement (not cached) keeps :data:`SDPA_ROWS`: the two paths
    round differently, and two loads must not pick differently. ``Choice.name`` is the row count
    as a string."""
    gen = torch.Generator().manual_seed(0)
    work = {"sdpa": [], "bmm": []}
    for n in SDPA_BUCKETS:
        q, k, v = (torch.randn(n, 1, rows, d, generator=gen).to(dtype) for rows in (g, SDPA_KEYS, SDPA_KEYS))
        valid, bias = key_mask(torch.full((n,), SDPA_KEYS), SDPA_KEYS)
        for name in work:
            work[name].append(lambda q=q, k=k, v=v, m=valid, b=bias, s=name == "sdpa": half_decode(q, k, v, m, b,
                                                                                                  0.125, s))
    times, how = timings(f"decode sdpa/bmm g{g} d{d} {str(dtype).removeprefix('torch.')} keys {SDPA_KEYS}", work)
    if how != "cached" and how != "measured":  # noisy: SDPA and bmm round differently, so keep what
        return Choice(str(SDPA_ROWS), how + ", default kept", times)  # every such load gets
    rows = 0
    for n, a, b in zip(SDPA_BUCKETS, times["sdpa"], times["bmm"]):
        if a > b:
            break
        rows = n
    return Choice(str(rows), how, times)


def key_mask(context_lens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid, bias)``, ``[B, 1, 1, n]``: ``valid`` (bool) iff key position ``j`` is visible to
    sequence ``b``, i.e. ``j < context_lens[b]`` (a batch-padding row, length 0, sees position 0
    so its softmax stays finite; its output is zeroed after); ``bias`` the same as a float32
    additive mask (0 or -inf)."""
    valid = torch.arange(n, device=context_lens.device)[None, :] < context_lens[:, None]
    valid[:, 0] |= context_lens == 0
    valid = valid[:, None, None, :]
    return valid, torch.zeros(valid.shape, device=valid.device).masked_fill_(~valid, float("-inf"))
