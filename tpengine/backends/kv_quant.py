"""The int8 KV cache (``kv_cache_dtype="int8"``): each cached key or value row of one head (``D``
elements of one token) is stored as ``D`` int8 codes and one float32 scale, symmetric absmax
quantization per token and per head (the scheme of vLLM's per-token-head int8 KV quantization and
of llama.cpp's q8_0 blocks, with the block being one head's row):

    scale = absmax(x) / 127,  code = clamp(round_half_even(x * (127 / absmax(x))), -127, 127)

computed in float32 (0 codes and a 0 scale for an all-zero row); a row reads back as
``code * scale``. The rounding error of an element is at most ``scale / 2 = absmax / 254`` (plus
float32 rounding). Every path writes the codes with exactly this arithmetic (the CPU paged C kernel
``cpu_paged_i8.c``, the torch paths here, the Triton store kernel: the C kernel's ``nearbyintf`` and
``torch.round`` both round half to even), so a cache written by one path is the cache every other
would write.

Scales are float32, not bfloat16: 4 bytes per head row against the row's ``D`` (64-256) codes, so at
most 6 % of the cache, and a scale then carries no rounding of its own (a bfloat16 scale would add
up to 0.4 % relative error to every element of the row, more than the int8 rounding of its larger
elements).

Layout: the codes are a layer's ``k_cache``/``v_cache`` ``[num_blocks, block_size, Hkv, D]`` int8;
the scales ``k_scale``/``v_scale`` ``[num_blocks, block_size, Hkv]`` float32, one per cached row, in
the same blocks (so they are written with the KV store, copied by copy-on-write and reused by prefix
caching with their blocks). The backends take them as ``kv_scales = (k_scale, v_scale)`` (None for a
cache in the model's dtype).
"""

from __future__ import annotations

import torch

__all__ = ["KV_CACHE_DTYPES", "cache_dtype", "bytes_per_token", "quantize", "dequantize", "store", "gather"]

#: ``kv_cache_dtype`` -> the cache's storage dtype (None: the model's dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "int8": torch.int8}
QMAX = 127.0
SCALE_DTYPE = torch.float32


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the KV cache for ``kv_cache_dtype`` (:data:`KV_CACHE_DTYPES`): the model's
    dtype for "auto", int8 for "int8". Raises ValueError for another name."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"invalid kv_cache_dtype={kv_cache_dtype!r}: must be one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, model_elem: int, kv_cache_dtype: str) -> int:
    """KV-cache bytes one token takes on a rank: keys and values of ``num_layers`` layers of
    ``num_kv_heads`` heads of ``head_dim``; ``model_elem`` bytes an element for "auto", else one byte
    an element plus a float32 scale per head row ("int8")."""
    row = head_dim * model_elem if kv_cache_dtype == "auto" else head_dim + SCALE_DTYPE.itemsize
    return 2 * num_layers * num_kv_heads * row


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` (any float dtype) -> ``(codes [..., D] int8, scale [...] float32)`` per row of
    ``D``, the module's arithmetic."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    # a true division (a python number over a tensor is computed as its reciprocal times the number,
    # which rounds differently from the C kernel's 127.f / amax)
    inv = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax))
    codes = torch.round(xf * inv[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes, amax / QMAX


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes [..., D]`` int8 and ``scale [...]`` -> ``codes * scale`` in float32, cast to ``dtype``."""
    return (codes.float() * scale.float()[..., None]).to(dtype)


def store(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          kv_scales: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor) -> None:
    """Quantize ``key``/``value [N, Hkv, D]`` and write codes and scales at cache slots ``slots [N]``
    (int64, all >= 0, in range: the caller checked them) of the int8 caches and their scales."""
    bs = k_cache.shape[1]
    blk, off = slots // bs, slots % bs
    for x, cache, sc in ((key, k_cache, kv_scales[0]), (value, v_cache, kv_scales[1])):
        codes, scale = quantize(x)
        cache[blk, off] = codes
        sc[blk, off] = scale


def gather(cache: torch.Tensor, scale: torch.Tensor, block_row: torch.Tensor, n: int, start: int,
           dtype: torch.dtype) -> torch.Tensor:
    """Tokens ``start..n-1`` of one sequence from an int8 ``cache [blocks, bs, Hkv, D]`` and its
    ``scale [blocks, bs, Hkv]`` through its block-table row, dequantized -> ``[n - start, Hkv, D]`` in
    ``dtype`` (the blocks before ``start`` are not read)."""
    bs = cache.shape[1]
    pos = torch.arange(start, n, device=cache.device)
    rows = block_row[pos // bs] * bs + pos % bs
    return dequantize(cache.reshape(-1, *cache.shape[2:]).index_select(0, rows),
                      scale.reshape(-1, scale.shape[2]).index_select(0, rows), dtype)
