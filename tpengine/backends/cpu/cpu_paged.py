"""Paged decode attention on CPU in one C call per layer (``cpu_paged.c``, built by
:mod:`tpengine.backends.cpu.cpu_library`): RoPE on the new query and key heads, the new keys and values
stored at their slots, and attention over each sequence's cached keys read through its block
table -- the store, gather, two products and softmax of the torch path
(:mod:`tpengine.backends.cpu.attention`) without a contiguous copy of the context and without a
dispatch per op. float32 and bfloat16; the arithmetic is described in ``cpu_paged.c``. A layer's sliding
window and attention-logit soft cap (:mod:`tpengine.backends.reference`) are arguments of the call: a
sliding layer reads only the blocks inside each sequence's window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpengine.backends.checks import check_window_cap
from tpengine.backends.cpu import cpu_library

MAX_D = 256  # the C code keeps a query head in 16 vectors of 16 floats
MAX_G = 16  # query heads per KV head
DTYPES = (torch.float32, torch.bfloat16)


#: the int8-cache kernels (``cpu_paged_i8.c``; kv_cache_dtype "int8"), by the activations' dtype
I8_KERNELS = {torch.float32: "tpe_paged_decode_i8_f32", torch.bfloat16: "tpe_paged_decode_i8_bf16"}


def available(dtype: torch.dtype, head_dim: int, cpu_kernels: bool, int8_cache: bool = False) -> bool:
    """Whether :func:`decode` takes a layer of this dtype and head size: ``cpu_kernels``
    (``EngineConfig.cpu_kernels``), float32 or bfloat16 (the activations' dtype; ``int8_cache``: over an
    int8 KV cache, ``cpu_paged_i8.c``), ``head_dim % 32 == 0`` (RoPE rotates halves of whole 16-lane
    vectors) and ``<= 256``, and the C library has the kernel (AVX512-BF16 and AVX2 builds:
    :func:`cpu_library.has`)."""
    names = (I8_KERNELS[dtype],) if int8_cache and dtype in I8_KERNELS else ("tpe_paged_decode_f32",
                                                                             "tpe_paged_decode_bf16")
    return (cpu_kernels and dtype in DTYPES and head_dim % 32 == 0 and head_dim <= MAX_D
            and cpu_library.has(*names))


@dataclass(frozen=True)
class PagedIndex:
    """One decode step's index tensors, checked once for every layer: contiguous int64
    ``slot_mapping [B]``, ``block_tables [B, max_blocks]``, ``context_lens [B]``."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor


def paged_index(slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> PagedIndex:
    """The step's :class:`PagedIndex` (made contiguous).

    Raises:
        ValueError: not int64, or shapes that do not agree on B.
    """
    idx = [t.contiguous() for t in (slot_mapping, block_tables, context_lens)]
    b = idx[0].shape[0] if idx[0].dim() == 1 else -1
    if any(t.dtype != torch.int64 for t in idx) or b < 0 or idx[2].shape != (b,) or idx[1].dim() != 2 \
            or idx[1].shape[0] != b:
        raise ValueError(f"paged decode: int64 slot_mapping [B], block_tables [B, max_blocks], context_lens [B]; "
                         f"got {[(t.dtype, tuple(t.shape)) for t in idx]}")
    return PagedIndex(*idx)


def _rows(name: str, t: torch.Tensor, heads: int, d: int, dtype: torch.dtype) -> int:
    """``t [B, heads, D]`` with unit element stride and heads ``D`` apart; returns its row stride."""
    if t.dtype != dtype or t.dim() != 3 or t.shape[1:] != (heads, d) or t.stride(2) != 1 or t.stride(1) != d:
        raise ValueError(f"paged decode: {name} must be [B, {heads}, {d}] {dtype} with heads {d} elements apart; "
                         f"got {t.dtype} {tuple(t.shape)} strides {tuple(t.stride())}")
    return t.stride(0)


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
           k_cache: torch.Tensor, v_cache: torch.Tensor, q_to_kv: torch.Tensor, scale: float,
           index: PagedIndex, amx_min_batch: int = 0, sliding_window: int | None = None,
           soft_cap: float | None = None, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One decode step of one layer. ``q [B, Hq, D]``, ``k``/``v [B, Hkv, D]`` (views into the q/k/v
    GEMM output are fine: any row stride; RoPE is applied to ``q`` and ``k`` IN PLACE when ``cos``,
    ``sin [B, D]`` are given), caches ``[num_blocks, block_size, Hkv, D]`` contiguous, ``q_to_kv
    [Hq]`` int64 contiguous, and the step's ``index`` (:func:`paged_index`, made once per step):
    ``slot_mapping [B]`` (-1: not stored), ``block_tables [B, max_blocks]``, ``context_lens [B]``
    (the new token included; 0: a padding row, output zero). ``amx_min_batch``: the fewest sequences
    at which a bfloat16 step takes the kernel's AMX path (0: never; :func:`choose_amx` measures it;
    where :func:`amx_available` is False the AVX-512 path runs whatever it is). ``sliding_window`` ``w``:
    each sequence attends only to its last ``w`` keys, and only their blocks are read and checked (the
    entries before them may be -1; such a call takes the AVX-512 path, not AMX); ``soft_cap`` ``c``: the
    scaled scores become ``tanh(s / c) * c``. ``kv_scales``: the caches are int8 with these scales
    (``(k_scale, v_scale)``, ``[num_blocks, block_size, Hkv]`` float32 contiguous;
    :mod:`tpengine.backends.kv_quant`): the new keys and values are quantized into them and attention
    runs in integers over the codes, the query rounded to int8 per head and the softmax weights to 15 bits
    (``cpu_paged_i8.c``'s header; no AMX path). Returns ``[B, Hq, D]``.

    Raises:
        ValueError: a shape, dtype or layout mismatch, or a bad window or cap.
        IndexError: a slot, length or block id out of range (checked before anything is written).
    """
    lib = cpu_library.load()
    if lib is None:
        raise RuntimeError(f"CPU C kernels unavailable: {cpu_library.unavailable_reason()}")
    check_window_cap(sliding_window, soft_cap)
    dtype, (b, hq, d) = q.dtype, q.shape
    nb, bs, hkv, _ = k_cache.shape
    if dtype not in DTYPES or d % 32 or d > MAX_D:
        raise ValueError(f"paged decode: float32 or bfloat16 with head size % 32 == 0 and <= {MAX_D}; got {dtype}, {d}")
    qs, ks, vs = _rows("q", q, hq, d, dtype), _rows("k", k, hkv, d, dtype), _rows("v", v, hkv, d, dtype)
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"paged decode: q, k, v must have the same B; got {b}, {k.shape[0]}, {v.shape[0]}")
    cache_dtype = dtype if kv_scales is None else torch.int8
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != cache_dtype or t.shape != (nb, bs, hkv, d) or not t.is_contiguous():
            raise ValueError(f"paged decode: {name} must be contiguous [{nb}, {bs}, {hkv}, {d}] {cache_dtype}; got "
                             f"{t.dtype} {tuple(t.shape)}")
    for name, t in zip(("k_scale", "v_scale"), kv_scales or ()):
        if t.dtype != torch.float32 or t.shape != (nb, bs, hkv) or not t.is_contiguous():
            raise ValueError(f"paged decode: {name} must be contiguous [{nb}, {bs}, {hkv}] torch.float32; got "
                             f"{t.dtype} {tuple(t.shape)}")
    if cos is not None and not (cos.dtype == sin.dtype == dtype and cos.shape == sin.shape == (b, d)
                                and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"paged decode: cos and sin must be contiguous [{b}, {d}] {dtype}; got {tuple(cos.shape)}")
    idx = [index.slot_mapping, index.block_tables, index.context_lens, q_to_kv]
    if idx[0].shape != (b,) or q_to_kv.dtype != torch.int64 or q_to_kv.shape != (hq,) or not q_to_kv.is_contiguous():
        raise ValueError(f"paged decode: an index for B={b} and a contiguous int64 q_to_kv [{hq}]; got B="
                         f"{idx[0].shape[0]}, q_to_kv {q_to_kv.dtype} {tuple(q_to_kv.shape)}")
    out = torch.empty(b, hq, d, dtype=dtype)
    head = (q.data_ptr(), qs, k.data_ptr(), ks, v.data_ptr(), vs, None if cos is None else cos.data_ptr(),
            None if sin is None else sin.data_ptr(), idx[0].data_ptr(), idx[1].data_ptr(), idx[1].shape[1],
            idx[2].data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())
    tail = (nb, bs, idx[3].data_ptr(), hq, hkv, d, scale, out.data_ptr(), b)
    if kv_scales is not None:
        bad = getattr(lib, I8_KERNELS[dtype])(*head, kv_scales[0].data_ptr(), kv_scales[1].data_ptr(), *tail,
                                              torch.get_num_threads(), sliding_window or 0, float(soft_cap or 0.0))
    else:
        fn = lib.tpe_paged_decode_f32 if dtype == torch.float32 else lib.tpe_paged_decode_bf16
        bad = fn(*head, *tail, max(int(amx_min_batch), 0), torch.get_num_threads(), sliding_window or 0,
                 float(soft_cap or 0.0))
    if bad == 3 * b:
        raise ValueError(f"paged decode: q_to_kv {idx[3].tolist()} must map each of the {hq} query heads to a KV "
                         f"head in [0, {hkv}), at most {MAX_G} on one")
    if bad >= 0:
        i, what = bad % b, ("slot_mapping", "context_lens", "block_tables")[bad // b]
        valid = {"slot_mapping": f"[-1, {nb * bs})", "context_lens": f"[0, {idx[1].shape[1] * bs}]",
                 "block_tables": f"[0, {nb}) for the blocks a sequence's length covers"}[what]
        value = idx[1][i].tolist() if what == "block_tables" else int(idx[("slot_mapping", "context_lens").index(what)
                                                                                 * 2][i])
        raise IndexError(f"paged decode: {what}[{i}] = {value} is out of range; valid: {valid}")
    return out


class Rope:
    """One step's RoPE tables for :func:`bind`'s calls: ``cos``/``sin [B, D]`` made contiguous in
    ``dtype`` once (every layer of the step shares them) and their pointers.

    Raises:
        ValueError: tables that are not ``[B, D]``.
    """

    __slots__ = ("key", "cos", "sin", "cos_p", "sin_p")

    def __init__(self, rope: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype):
        cos, sin = (t.to(dtype).contiguous() for t in rope)
        if cos.dim() != 2 or cos.shape != sin.shape:
            raise ValueError(f"paged decode: cos and sin must be [B, D]; got {tuple(cos.shape)}, {tuple(sin.shape)}")
        self.key, self.cos, self.sin = rope, cos, sin
        self.cos_p, self.sin_p = cos.data_ptr(), sin.data_ptr()


def bind(k_cache: torch.Tensor, v_cache: torch.Tensor, q_to_kv: torch.Tensor, scale: float, amx_min_batch: int = 0,
         sliding_window: int = 0, soft_cap: float = 0.0, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
         dtype: torch.dtype | None = None):
    """:func:`decode` for one layer with everything but the step's tensors checked once: the caches
    ``[num_blocks, block_size, Hkv, D]`` contiguous in one dtype, ``q_to_kv [Hq]`` int64, the layer's
    ``sliding_window`` and ``soft_cap`` (0: none; else as :func:`decode` takes them). Returns
    ``run(qkv [B, (Hq + 2 Hkv) D], rope: Rope, index: PagedIndex) -> [B, Hq D]`` (``qkv``: the q/k/v
    GEMM's rows, query heads then key heads then value heads, unit stride, any row stride; RoPE
    applied to its q and k in place), which checks only what varies per call (the rows' layout, B);
    a slot, length or block id out of range raises :func:`decode`'s exact error (nothing is written).
    An int8 cache: ``kv_scales`` as :func:`decode` takes them and ``dtype`` the activations' (float32 or
    bfloat16).

    Raises:
        ValueError: a cache, dtype or head size :func:`decode` does not take, or a bad window or cap.
    """
    window, cap = sliding_window or None, soft_cap or None
    check_window_cap(window, cap)
    lib = cpu_library.load()
    nb, bs, hkv, d = k_cache.shape
    hq, int8 = q_to_kv.shape[0], kv_scales is not None
    dtype = dtype if int8 else k_cache.dtype
    if (lib is None or dtype not in DTYPES or d % 32 or d > MAX_D or v_cache.shape != k_cache.shape
            or v_cache.dtype != k_cache.dtype or k_cache.dtype != (torch.int8 if int8 else dtype)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or q_to_kv.dtype != torch.int64 or not q_to_kv.is_contiguous()):
        raise ValueError(f"paged decode: contiguous [blocks, block_size, Hkv, D] caches of float32 or bfloat16 (or "
                         f"int8 with scales) with D % 32 == 0 and <= {MAX_D}, int64 q_to_kv; got {k_cache.dtype} "
                         f"{tuple(k_cache.shape)}, {q_to_kv.dtype} q_to_kv")
    name = "tpe_paged_decode_f32" if dtype == torch.float32 else "tpe_paged_decode_bf16"
    fn = getattr(lib, name)
    kp, vp, mp, es, scale = k_cache.data_ptr(), v_cache.data_ptr(), q_to_kv.data_ptr(), dtype.itemsize, \
        float(scale)
    sp = None
    if int8:
        name, sp = I8_KERNELS[dtype], (kv_scales[0].data_ptr(), kv_scales[1].data_ptr())
        fn = getattr(lib, name)

    width, amx = (hq + 2 * hkv) * d, max(int(amx_min_batch), 0)
    window_arg, cap_arg = int(window or 0), float(cap or 0.0)

    def checked(qkv: torch.Tensor, rope: Rope, index: PagedIndex) -> torch.Tensor:
        t = qkv.view(qkv.shape[0], hq + 2 * hkv, d)
        return decode(t[:, :hq], t[:, hq:hq + hkv], t[:, hq + hkv:], rope.cos, rope.sin, k_cache, v_cache, q_to_kv,
                      scale, index, amx, window, cap, kv_scales).flatten(1)

    def run(qkv: torch.Tensor, rope: Rope, index: PagedIndex) -> torch.Tensor:
        b, rs = qkv.shape[0], qkv.stride(0)
        if (qkv.dtype != dtype or qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1
                or index.slot_mapping.shape[0] != b or rope.cos.shape[0] != b):
            return checked(qkv, rope, index)  # (its errors name what is wrong)
        out = torch.empty(b, hq * d, dtype=dtype)
        p = qkv.data_ptr()
        head = (p, rs, p + hq * d * es, rs, p + (hq + hkv) * d * es, rs, rope.cos_p, rope.sin_p,
                index.slot_mapping.data_ptr(), index.block_tables.data_ptr(), index.block_tables.shape[1],
                index.context_lens.data_ptr(), kp, vp)
        if int8:
            bad = fn(*head, *sp, nb, bs, mp, hq, hkv, d, scale, out.data_ptr(), b, torch.get_num_threads(),
                     window_arg, cap_arg)
        else:
            bad = fn(*head, nb, bs, mp, hq, hkv, d, scale, out.data_ptr(), b, amx, torch.get_num_threads(),
                     window_arg, cap_arg)
        if bad >= 0:  # nothing was written: the checked call raises the exact error
            checked(qkv, rope, index)
            raise RuntimeError(f"paged decode: the C kernel refused argument {bad}")
        return out
    # its call in a decode program (cpu_program): the constants of the arguments above
    run.c_spec = ("paged", name, hq, hkv, d, es, kp, vp, sp, nb, bs, mp, scale, amx, window_arg, cap_arg)
    return run


_decode = decode  # the measurement's own reference (not counted by a test that wraps decode)


def amx_available() -> bool:
    """Whether the bfloat16 kernel's AMX path (``cpu_paged.c``: the scores of a block's 16 keys for
    all of a KV head's query heads by tile multiplies) can run in this process: the library built
    with AMX (``-march=native`` on a CPU with AMX-BF16) and the OS lets the process use tile data.
    When not, :func:`decode` keeps its AVX-512 path whatever ``amx_min_batch``. The path also needs
    a block size that is a multiple of 16 and a head size up to 128 (else the call takes the AVX-512
    path). Both paths round as ``cpu_paged.c`` describes (the float32 sums run in other orders)."""
    return cpu_library.has("tpe_paged_amx") and bool(cpu_library.load().tpe_paged_amx())


def amx_min_batch(choice) -> int:
    """The ``amx_min_batch`` for :func:`decode` that :func:`choose_amx`'s ``choice`` names
    (``"amx from B >= 8"``: 8); 0 (never) for None or ``"avx512"``."""
    return 0 if choice is None or choice.name == "avx512" else int(choice.name.rsplit(" ", 1)[1])


def choose_amx(q_to_kv: torch.Tensor, hkv: int, head_dim: int, block_size: int,
               batches: tuple[int, ...] = (1, 8, 64), context: int = 192, layers: int = 8):
    """The measured choice of the bfloat16 kernel's path for one rank's layer shape (query head ``h``
    on KV head ``q_to_kv[h]`` of ``hkv``, ``q_to_kv [Hq]`` int64, heads of ``head_dim``, blocks of
    ``block_size``): the AVX-512 and AMX paths timed on decode steps of each of ``batches``
    sequences of ``context`` keys over ``layers`` separate caches (so rows stream from memory as in
    a step), by :func:`tpengine.backends.cpu.measured.timings` (cached per machine); AMX is then taken
    from the smallest measured batch from which it is faster at every larger one (``"amx from B
    >= 8"``), else never (``"avx512"``); :func:`amx_min_batch` reads the batch off it. Returns a
    :class:`~tpengine.backends.cpu.measured.Choice`, or None where the AMX path does not apply
    (unavailable, ``block_size % 16``, ``head_dim`` over 128 or not a multiple of 32); then the
    AVX-512 path stays."""
    from tpengine.backends.cpu.measured import Choice, timings, wins_from

    if block_size % 16 or head_dim % 32 or head_dim > 128 or not amx_available():
        return None
    g = torch.Generator().manual_seed(0)
    q_to_kv = q_to_kv.to(torch.int64).contiguous()
    hq = q_to_kv.shape[0]
    nbps = -(-context // block_size)
    calls = []
    for b in batches:
        nb = b * nbps + 1
        caches = [tuple(torch.randn(nb, block_size, hkv, head_dim, generator=g).to(torch.bfloat16) for _ in "kv")
                  for _ in range(layers)]
        tables = torch.randperm(nb - 1, generator=g)[: b * nbps].view(b, nbps).contiguous()
        index = paged_index(torch.full((b,), -1, dtype=torch.int64), tables, torch.full((b,), context,
                                                                                        dtype=torch.int64))
        q = torch.randn(b, hq, head_dim, generator=g).to(torch.bfloat16)
        kv = torch.randn(b, hkv, head_dim, generator=g).to(torch.bfloat16)

        def step(min_batch: int, caches=caches, index=index, q=q, kv=kv):
            for kc, vc in caches:
                _decode(q, kv, kv, None, None, kc, vc, q_to_kv, 0.125, index, amx_min_batch=min_batch)
        calls.append(step)

    def path(min_batch: int):
        return [lambda f=f: f(min_batch) for f in calls]
    key = (f"paged decode bf16 q_to_kv {q_to_kv.tolist()} hkv {hkv} d {head_dim} bs {block_size} ctx {context} "
           f"layers {layers} batches {'/'.join(map(str, batches))}")
    def amx_from(times: dict[str, list[float]]) -> int:
        """The first batch from which AMX wins at every larger one (0: none)."""
        return wins_from(times, list(batches), "amx", "avx512")
    times, how = timings(key, {"avx512": path(0), "amx": path(1)}, decide=amx_from)
    if times is None:  # a busy machine without cached timings: the AVX-512 path, unmeasured
        return Choice("avx512", how, {})
    start = amx_from(times)
    return Choice(f"amx from B >= {start}" if start else "avx512", how, times)
