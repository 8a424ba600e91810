"""Triton paged-attention kernels: KV store, split-K decode ("flash decoding"), varlen prefill.

Same interface, layout and semantics as :mod:`tpengine.backends.reference` (its docstrings are
the contract); this module is the CUDA path, run by
:class:`tpengine.backends.cuda.attention.TritonAttentionBackend`. q/k/v/out and the caches are addressed through
explicit strides, so any layout works (a unit ``head_dim`` stride is fastest); the small int64
index tensors (slot_mapping, cu_seqlens, block_tables rows, context_lens, q_to_kv) are made
contiguous by the wrappers. Every tensor must be on the same device.
Block ids are looked up per key row (``pos // block_size``), so ``block_size`` need not be a
power of two nor match the key tile.

Sources: online softmax -- Milakov & Gimelshein 2018, "Online normalizer calculation for
softmax"; tiling -- Dao et al. 2022, "FlashAttention"; context splits + a reduce kernel --
Dao et al. 2023, "Flash-Decoding for long-context inference"; paged layout -- Kwon et al. 2023
(vLLM). On CPU tensors the kernels run only under ``TRITON_INTERPRET=1`` (set before ``triton``
is imported); use float32 there.

A layer's sliding window ``w`` and logit soft cap ``c`` (the reference's semantics) are arguments of the
attention calls: with a window, each program starts at the first key its queries see (the blocks before
it are not read; a decode split wholly before it runs no iteration), and masks the keys before each
query's window; with a cap, the scaled scores become ``tanh(s / c) * c`` (:func:`_soft_cap`). Both are
constexpr-switched (``HAS_WINDOW``, ``HAS_CAP``), so a layer without them compiles and runs the kernels
as before.

An int8 KV cache (``kv_scales``: :mod:`tpengine.backends.kv_quant`) is the constexpr ``QUANT``: the store
kernel quantizes each (token, head) row -- ``127 / absmax``, round half to even (:func:`_rint`), a float32
scale per row -- and the attention kernels read ``codes * scale`` in float32 (prefill: cast to the query's
dtype for ``tl.dot``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpengine.backends.checks import check_cache, check_heads, check_store, check_window_cap, prefill_lengths

__all__ = ["store_kvcache", "prefill_attention", "decode_attention"]

#: tokens per decode split; a context longer than this is split across programs + reduced.
DECODE_PARTITION = 512
#: cap on decode splits (the reduce kernel holds a [splits, D] tile); longer tables get longer splits.
MAX_SPLITS = 64


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` accumulated in float32; ``IEEE``: exact fp32 products (no TF32) for fp32 inputs."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _soft_cap(s, cap):
    """``tanh(s / cap) * cap`` (divide, tanh, multiply), float32: Cephes' tanhf -- ``x + x^3 P(x^2)`` for
    ``|x| < 0.625``, else ``1 - 2 / (exp(2|x|) + 1)`` with x's sign -- in ``tl.exp`` (libdevice's tanh does
    not run under the interpreter)."""
    x = s / cap
    a = tl.abs(x)
    z = x * x
    p = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
         - 3.33332819422e-1)
    small = p * z * x + x
    big = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    t = tl.where(a < 0.625, small, tl.where(x < 0, -big, big))
    return t * cap


# ---------------------------------------------------------------------------------------------
# store
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rint(x):
    """``x`` rounded to the nearest integer, halves to even (``nearbyintf``, ``torch.round``), for
    ``|x| <= 127.5`` (where ``x + 0.5`` is exact in float32)."""
    r = tl.floor(x + 0.5)
    return tl.where(((r - x) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0), r - 1.0, r)


@triton.jit
def _quantize_rows(x, m):
    """Rows ``x [H, D]`` (masked by ``m``) -> ``(codes [H, D] float32 in [-127, 127], scale [H])``:
    :mod:`tpengine.backends.kv_quant`'s arithmetic."""
    xf = tl.where(m, x.to(tl.float32), 0.0)
    amax = tl.max(tl.abs(xf), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    codes = tl.minimum(tl.maximum(_rint(xf * inv[:, None]), -127.0), 127.0)
    return codes, amax / 127.0


@triton.jit
def _store_kernel(key, value, kc, vc, ksc, vsc, slots, block_size, hkv, s_kn, s_kh, s_kd, s_vn, s_vh, s_vd,
                  s_cb, s_cs, s_ch, s_cd, s_vcb, s_vcs, s_vch, s_vcd, s_sb, s_ss, s_sh,
                  HEAD_DIM: tl.constexpr, H_P2: tl.constexpr, D_P2: tl.constexpr, QUANT: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slots + i)
    h = tl.arange(0, H_P2)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    m = (h < hkv) & (d < HEAD_DIM)
    if slot >= 0:  # -1: padding token, nothing to write
        blk = slot // block_size
        off = slot % block_size
        kv = tl.load(key + i * s_kn + h * s_kh + d * s_kd, mask=m)
        vv = tl.load(value + i * s_vn + h * s_vh + d * s_vd, mask=m)
        if QUANT:  # int8 codes and a float32 scale per (token, head) row
            hs = tl.arange(0, H_P2)
            kv, kscale = _quantize_rows(kv, m)
            vv, vscale = _quantize_rows(vv, m)
            tl.store(ksc + blk * s_sb + off * s_ss + hs * s_sh, kscale, mask=hs < hkv)
            tl.store(vsc + blk * s_sb + off * s_ss + hs * s_sh, vscale, mask=hs < hkv)
        tl.store(kc + blk * s_cb + off * s_cs + h * s_ch + d * s_cd, kv.to(kc.dtype.element_ty), mask=m)
        tl.store(vc + blk * s_vcb + off * s_vcs + h * s_vch + d * s_vcd, vv.to(vc.dtype.element_ty), mask=m)


def _scale_args(k_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None) -> tuple:
    """The kernels' scale arguments: ``(k_scale, v_scale, *strides)`` of an int8 cache's scales
    (``[num_blocks, block_size, Hkv]`` float32 each, one layout), else stand-ins never read.

    Raises:
        ValueError: scales of another shape or dtype, or of two layouts.
    """
    if kv_scales is None:
        return k_cache, k_cache, 0, 0, 0
    ks, vs = kv_scales
    if (ks.shape != k_cache.shape[:3] or vs.shape != ks.shape or ks.stride() != vs.stride()
            or ks.dtype != torch.float32 or vs.dtype != torch.float32 or k_cache.dtype != torch.int8):
        raise ValueError(f"an int8 cache's scales must be [{', '.join(map(str, k_cache.shape[:3]))}] float32 in one "
                         f"layout; got {tuple(ks.shape)} {ks.dtype}, {tuple(vs.shape)} {vs.dtype} for a "
                         f"{k_cache.dtype} cache")
    return ks, vs, *ks.stride()


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Triton version of :func:`tpengine.backends.reference.store_kvcache` (same contract, ``kv_scales``
    included).

    One program per token; slot -1 is skipped; values are cast to the cache dtype (int8 with
    ``kv_scales``: quantized). Raises ValueError on shape mismatch. Out-of-range slots are NOT checked
    (memory corruption on GPU).
    """
    _, bs, hkv, d = check_store(key, value, k_cache, v_cache, slot_mapping)
    n = key.shape[0]
    if n == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    _store_kernel[(n,)](
        key, value, k_cache, v_cache, *_scale_args(k_cache, kv_scales)[:2], slot_mapping, bs, hkv, *key.stride(),
        *value.stride(), *k_cache.stride(), *v_cache.stride(), *_scale_args(k_cache, kv_scales)[2:],
        HEAD_DIM=d, H_P2=triton.next_power_of_2(hkv), D_P2=triton.next_power_of_2(d), QUANT=kv_scales is not None,
    )


# ---------------------------------------------------------------------------------------------
# decode: one query token per sequence, split along the context, then reduce
# ---------------------------------------------------------------------------------------------


@triton.jit
def _decode_kernel(q, kc, vc, ksc, vsc, bt, ctx_lens, q_to_kv, out, part_acc, part_ml, scale, block_size, window,
                   soft_cap, s_qb, s_qh, s_qd, s_cb, s_cs, s_ch, s_cd, s_vb, s_vs, s_vh, s_vd, s_sb, s_ss, s_sh, s_bt,
                   s_ob, s_oh, s_od, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                   PARTITION: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_CAP: tl.constexpr, QUANT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    nh = tl.num_programs(1)
    ctx = tl.load(ctx_lens + b).to(tl.int32)
    start = sp * PARTITION
    end = tl.minimum(start + PARTITION, ctx)
    if HAS_WINDOW:  # the last `window` keys only: a split wholly before them runs no iteration
        start = tl.maximum(start, ctx - window)
    kvh = tl.load(q_to_kv + h)
    d = tl.arange(0, D_P2)
    dm = d < HEAD_DIM
    qv = tl.load(q + b * s_qb + h * s_qh + d * s_qd, mask=dm, other=0.0).to(tl.float32) * scale
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([D_P2], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):  # empty when start >= ctx: the reduce ignores such splits
        pos = n0 + tl.arange(0, BLOCK_N)
        pm = pos < end
        blk = tl.load(bt + b * s_bt + pos // block_size, mask=pm, other=0)
        off = pos % block_size
        km = pm[:, None] & dm[None, :]
        k = tl.load(kc + blk[:, None] * s_cb + off[:, None] * s_cs + kvh * s_ch + d[None, :] * s_cd,
                    mask=km, other=0.0).to(tl.float32)
        if QUANT:  # codes * their row's scale
            k = k * tl.load(ksc + blk * s_sb + off * s_ss + kvh * s_sh, mask=pm, other=0.0)[:, None]
        s = tl.sum(k * qv[None, :], axis=1)
        if HAS_CAP:
            s = _soft_cap(s, soft_cap)
        s = tl.where(pm, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(vc + blk[:, None] * s_vb + off[:, None] * s_vs + kvh * s_vh + d[None, :] * s_vd,
                    mask=km, other=0.0).to(tl.float32)
        if QUANT:
            v = v * tl.load(vsc + blk * s_sb + off * s_ss + kvh * s_sh, mask=pm, other=0.0)[:, None]
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    if NUM_SPLITS == 1:
        res = acc / tl.where(l_i > 0, l_i, 1.0)  # empty context -> zeros
        tl.store(out + b * s_ob + h * s_oh + d * s_od, res.to(out.dtype.element_ty), mask=dm)
    else:
        row = (b * nh + h) * NUM_SPLITS + sp  # partials are contiguous [B, Hq, S, D] / [B, Hq, S, 2]
        tl.store(part_acc + row * HEAD_DIM + d, acc, mask=dm)
        tl.store(part_ml + row * 2, m_i)
        tl.store(part_ml + row * 2 + 1, l_i)


@triton.jit
def _decode_reduce_kernel(ctx_lens, out, part_acc, part_ml, s_ob, s_oh, s_od,
                          HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, PARTITION: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, S_P2: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    nh = tl.num_programs(1)
    ctx = tl.load(ctx_lens + b).to(tl.int32)
    n_valid = tl.cdiv(ctx, PARTITION)
    sidx = tl.arange(0, S_P2)
    sm = sidx < n_valid
    row = (b * nh + h) * NUM_SPLITS + sidx
    m = tl.load(part_ml + row * 2, mask=sm, other=float("-inf"))
    l = tl.load(part_ml + row * 2 + 1, mask=sm, other=0.0)
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all > float("-inf"), m_all, 0.0)  # empty context: avoid -inf - -inf
    w = tl.where(sm, tl.exp(m - m_all), 0.0)
    d = tl.arange(0, D_P2)
    dm = d < HEAD_DIM
    acc = tl.load(part_acc + row[:, None] * HEAD_DIM + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    num = tl.sum(w[:, None] * acc, axis=0)
    den = tl.sum(w * l, axis=0)
    res = num / tl.where(den > 0, den, 1.0)
    tl.store(out + b * s_ob + h * s_oh + d * s_od, res.to(out.dtype.element_ty), mask=dm)


def decode_splits(capacity: int, head_dim: int, partition_size: int | None = None) -> tuple[int, int, int]:
    """Decode launch geometry: ``(key tile, tokens per split, number of splits)``.

    ``capacity`` = block-table width x block size (tokens). The split length is
    ``partition_size`` (default :data:`DECODE_PARTITION`), raised so that there are at most
    :data:`MAX_SPLITS` splits, and rounded up to a multiple of the key tile.
    """
    block_n = min(64, max(16, 4096 // triton.next_power_of_2(head_dim)))
    part = max(partition_size or DECODE_PARTITION, triton.cdiv(capacity, MAX_SPLITS))
    part = triton.cdiv(part, block_n) * block_n
    return block_n, part, max(1, triton.cdiv(capacity, part))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, q_to_kv: torch.Tensor,
                     scale: float,
                     partition_size: int | None = None, sliding_window: int | None = None,
                     soft_cap: float | None = None,
                     kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Triton version of :func:`tpengine.backends.reference.decode_attention` (same contract, the
    ``sliding_window``, ``soft_cap`` and ``kv_scales`` included).

    Grid ``(B, Hq, splits)``; each program streams ``partition_size`` tokens (default
    :data:`DECODE_PARTITION`, rounded up to the key tile) with an online softmax; with more
    than one split, float32 partials go to a ``[B, Hq, splits, D]`` workspace and a reduce
    kernel merges them. ``splits`` comes from the block table's capacity
    (``max_blocks * block_size``; at most :data:`MAX_SPLITS`, longer tables get longer splits),
    so there is no host sync and the launch is CUDA-graph friendly; splits past a sequence's
    end run no iterations and the reduce ignores them. Zero-length contexts give zeros. Raises
    ValueError on shape mismatch; ``context_lens`` beyond the table's capacity is NOT checked.
    """
    check_window_cap(sliding_window, soft_cap)
    _, bs, hkv, d = check_cache(k_cache, v_cache)
    check_heads(q, q_to_kv, hkv, d)
    nb, hq = q.shape[0], q.shape[1]
    if block_tables.dim() != 2 or block_tables.shape[0] != nb or context_lens.shape != (nb,):
        raise ValueError(
            f"block_tables must be [{nb}, max_blocks] and context_lens [{nb}]; got "
            f"{tuple(block_tables.shape)}, {tuple(context_lens.shape)}"
        )
    out = q.new_empty(q.shape)  # contiguous, whatever q's strides
    if nb == 0:
        return out
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    q_to_kv = q_to_kv.contiguous()
    d_p2 = triton.next_power_of_2(d)
    block_n, part, splits = decode_splits(block_tables.shape[1] * bs, d, partition_size)
    if splits > 1:
        part_acc = torch.empty(nb, hq, splits, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(nb, hq, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    sc = _scale_args(k_cache, kv_scales)
    _decode_kernel[(nb, hq, splits)](
        q, k_cache, v_cache, *sc[:2], block_tables, context_lens, q_to_kv, out, part_acc, part_ml, float(scale), bs,
        sliding_window or 0, float(soft_cap or 1.0),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *sc[2:], block_tables.stride(0), *out.stride(),
        HEAD_DIM=d, D_P2=d_p2, BLOCK_N=block_n, PARTITION=part, NUM_SPLITS=splits,
        HAS_WINDOW=sliding_window is not None, HAS_CAP=soft_cap is not None, QUANT=kv_scales is not None,
    )
    if splits > 1:
        _decode_reduce_kernel[(nb, hq)](
            context_lens, out, part_acc, part_ml, *out.stride(),
            HEAD_DIM=d, D_P2=d_p2, PARTITION=part, NUM_SPLITS=splits, S_P2=triton.next_power_of_2(splits),
        )
    return out


# ---------------------------------------------------------------------------------------------
# prefill: varlen causal attention, cached prefix (paged) + new tokens (dense)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _softmax_tile(s, vis, vt, m_i, l_i, acc, IEEE: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """One key tile of the prefill's online softmax: the scores ``s`` ``[BLOCK_M, BLOCK_N]`` (float32,
    scaled and capped) masked to the visible keys ``vis``, folded into the running row max ``m_i`` and
    sum ``l_i`` ``[BLOCK_M]`` and the output rows ``acc`` ``[BLOCK_M, D_P2]`` (float32) with the tile's
    values ``vt`` ``[BLOCK_N, D_P2]``. With a window a row may see no key yet (its max -inf): its
    exponentials are taken against 0 instead (``m_safe``), not -inf - -inf.

    Returns:
        the new ``(m_i, l_i, acc)``.
    """
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = m_new
    if HAS_WINDOW:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, IEEE)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(q, k, v, kc, vc, ksc, vsc, out, cu_q, cu_k, bt, q_to_kv, scale, block_size, window, soft_cap,
                    s_qn, s_qh, s_qd, s_kn, s_kh, s_kd, s_vn, s_vh, s_vd,
                    s_cb, s_cs, s_ch, s_cd, s_vcb, s_vcs, s_vch, s_vcd, s_sb, s_ss, s_sh, s_bt, s_on, s_oh, s_od,
                    HEAD_DIM: tl.constexpr, D_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
                    QUANT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q0 = tl.load(cu_q + b)
    lq = (tl.load(cu_q + b + 1) - q0).to(tl.int32)
    if mb * BLOCK_M >= lq:
        return
    lk = (tl.load(cu_k + b + 1) - tl.load(cu_k + b)).to(tl.int32)
    prefix = lk - lq
    kvh = tl.load(q_to_kv + h)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = offs_m < lq
    d = tl.arange(0, D_P2)
    dm = d < HEAD_DIM
    qt = tl.load(q + (q0 + offs_m)[:, None] * s_qn + h * s_qh + d[None, :] * s_qd,
                 mask=mm[:, None] & dm[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_P2], dtype=tl.float32)
    # with a window, each phase starts at the first key the tile's first query sees (the blocks before it
    # unread), and a key is visible to query i (position prefix + offs_m[i]) iff it is after
    # prefix + offs_m[i] - window; a row may then see no key of a tile: its running max stays -inf, and
    # the exponentials are taken against 0 instead (m_safe), not -inf - -inf
    lo1 = 0
    lo2 = 0
    if HAS_WINDOW:
        lo1 = tl.maximum(prefix + mb * BLOCK_M - window + 1, 0)
        lo2 = tl.maximum(mb * BLOCK_M - window + 1, 0)
    # phase 1: the cached prefix (positions 0..prefix-1), visible to every query; paged reads
    for n0 in range(lo1, prefix, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pm = pos < prefix
        blk = tl.load(bt + b * s_bt + pos // block_size, mask=pm, other=0)
        off = pos % block_size
        km = pm[:, None] & dm[None, :]
        kt = tl.load(kc + blk[:, None] * s_cb + off[:, None] * s_cs + kvh * s_ch + d[None, :] * s_cd,
                     mask=km, other=0.0)
        vt = tl.load(vc + blk[:, None] * s_vcb + off[:, None] * s_vcs + kvh * s_vch + d[None, :] * s_vcd,
                     mask=km, other=0.0)
        if QUANT:  # codes * their row's scale, in float32
            srow = blk * s_sb + off * s_ss + kvh * s_sh
            kt = kt.to(tl.float32) * tl.load(ksc + srow, mask=pm, other=0.0)[:, None]
            vt = vt.to(tl.float32) * tl.load(vsc + srow, mask=pm, other=0.0)[:, None]
        kt, vt = kt.to(qt.dtype), vt.to(qt.dtype)
        s = _dot(qt, tl.trans(kt), IEEE) * scale
        if HAS_CAP:
            s = _soft_cap(s, soft_cap)
        vis = pm[None, :]
        if HAS_WINDOW:
            vis = vis & (pos[None, :] > prefix + offs_m[:, None] - window)
        m_i, l_i, acc = _softmax_tile(s, vis, vt, m_i, l_i, acc, IEEE, HAS_WINDOW)
    # phase 2: the new tokens (dense k/v), causal: new key j visible to query i iff j <= i
    hi = tl.minimum(lq, (mb + 1) * BLOCK_M)
    for n0 in range(lo2, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pm = pos < lq
        km = pm[:, None] & dm[None, :]
        kt = tl.load(k + (q0 + pos)[:, None] * s_kn + kvh * s_kh + d[None, :] * s_kd, mask=km, other=0.0)
        vt = tl.load(v + (q0 + pos)[:, None] * s_vn + kvh * s_vh + d[None, :] * s_vd, mask=km, other=0.0)
        s = _dot(qt, tl.trans(kt.to(qt.dtype)), IEEE) * scale
        if HAS_CAP:
            s = _soft_cap(s, soft_cap)
        vis = pm[None, :] & (pos[None, :] <= offs_m[:, None])
        if HAS_WINDOW:
            vis = vis & (pos[None, :] > offs_m[:, None] - window)
        m_i, l_i, acc = _softmax_tile(s, vis, vt, m_i, l_i, acc, IEEE, HAS_WINDOW)
    if HAS_WINDOW:  # the tile's padding rows past Lq may have seen no key at all
        l_i = tl.where(l_i > 0, l_i, 1.0)
    res = acc / l_i[:, None]
    tl.store(out + (q0 + offs_m)[:, None] * s_on + h * s_oh + d[None, :] * s_od, res.to(out.dtype.element_ty),
             mask=mm[:, None] & dm[None, :])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      block_tables: torch.Tensor | None, q_to_kv: torch.Tensor, scale: float,
                      lengths: tuple | None = None, sliding_window: int | None = None,
                      soft_cap: float | None = None,
                      kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Triton version of :func:`tpengine.backends.reference.prefill_attention` (same contract, the
    ``sliding_window``, ``soft_cap`` and ``kv_scales`` included).
    ``lengths``: :func:`tpengine.backends.checks.prefill_lengths` of the offsets, if already known
    (the backend's ``prepare`` reads them once per step); else this call reads them (one host sync).

    Grid ``(B, Hq, cdiv(max Lq, BLOCK_M))``; each program holds a ``BLOCK_M`` query tile of one
    head, first streams the cached prefix through the block table, then the new tokens' k/v
    (causal), with an online softmax and ``tl.dot`` (exact fp32 for float32 inputs). Raises
    ValueError on malformed lengths/shapes or a prefix without
    ``block_tables``.
    """
    check_window_cap(sliding_window, soft_cap)
    _, bs, hkv, d = check_cache(k_cache, v_cache)
    check_heads(q, q_to_kv, hkv, d)
    if k.shape != v.shape or k.shape[0] != q.shape[0] or tuple(k.shape[1:]) != (hkv, d):
        raise ValueError(f"k/v must be [{q.shape[0]}, {hkv}, {d}]; got {tuple(k.shape)}, {tuple(v.shape)}")
    _, _, lqs, lks = prefill_lengths(cu_seqlens_q, cu_seqlens_k, q.shape[0]) if lengths is None else lengths
    if block_tables is None:
        if any(a != b for a, b in zip(lqs, lks)):
            raise ValueError("a sequence has a cached prefix (Lk > Lq) but block_tables is None")
        block_tables = q_to_kv.new_zeros(len(lqs), 1)  # never read
    out = q.new_empty(q.shape)  # contiguous, whatever q's strides
    max_lq = max(lqs, default=0)
    if max_lq == 0:
        return out
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    block_tables, q_to_kv = block_tables.contiguous(), q_to_kv.contiguous()
    d_p2 = max(16, triton.next_power_of_2(d))  # tl.dot needs K >= 16
    block = 64 if d_p2 <= 64 else 32
    if q.device.type == "cuda" and q.dtype != torch.float32 and d_p2 <= 128:
        block = 64
    sc = _scale_args(k_cache, kv_scales)
    _prefill_kernel[(len(lqs), q.shape[1], triton.cdiv(max_lq, block))](
        q, k, v, k_cache, v_cache, *sc[:2], out, cu_seqlens_q, cu_seqlens_k, block_tables, q_to_kv, float(scale), bs,
        sliding_window or 0, float(soft_cap or 1.0),
        *q.stride(), *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), *sc[2:], block_tables.stride(0),
        *out.stride(),
        HEAD_DIM=d, D_P2=d_p2, BLOCK_M=block, BLOCK_N=block, IEEE=q.dtype == torch.float32,
        HAS_WINDOW=sliding_window is not None, HAS_CAP=soft_cap is not None, QUANT=kv_scales is not None,
    )
    return out
