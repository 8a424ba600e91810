"""The "blocked" weight layouts (``cpu_blocked.c``, built by :mod:`tpengine.backends.cpu.cpu_library`):

* bfloat16 ``[n / 16, k / 2, 16, 2]``, the operand order of AVX512-BF16's ``vdpbf16ps`` (AVX512-BF16 builds; AVX2
  builds widen each 32-byte load of pairs to float32 by a shift and a mask and FMA them, the same stream), and
  AMX's B tile as it lies (32 values of k of 16 outputs: 16 lines of 64 bytes), so on a CPU with AMX-BF16 the
  same layout runs tile multiplies from a measured row count on (:func:`choose_amx`, :func:`set_amx_rows`);
* float32 ``[n / 16, k, 16]``: each step of k one 64-byte line of 16 rows' weights, one FMA with ``x[k]``
  broadcast (AVX-512 and AVX2 builds; the same FMA chain on both, so the same bits).

A third layout beside the plain row-major weight and oneDNN's packed one
(:mod:`tpengine.backends.cpu.linear_layout` measures all three per weight shape and keeps one): a
one-row GEMV on it reads the weight as a single stream with no horizontal sums, and it is ours, so a
mixture-of-experts block can run its routed experts' GEMVs in one call (bfloat16,
:mod:`tpengine.backends.cpu.cpu_moe`). The layer keeps it in ``packed`` (a 4-dimensional bfloat16 or a
3-dimensional float32 tensor there is this layout, :func:`is_blocked`; oneDNN's is 2-dimensional): one copy
of the weight, never beside the plain one.
"""

from __future__ import annotations

import torch

from tpengine.backends.cpu import cpu_library

#: the bfloat16 layout's kernels (AVX512-BF16 and AVX2 builds)
KERNELS = ("tpe_blocked_pack_bf16", "tpe_blocked_gemm_bf16", "tpe_blocked_group_bf16", "tpe_blocked_moe_down_bf16")
#: the float32 layout's kernels (AVX-512 and AVX2 builds)
KERNELS_F32 = ("tpe_blocked_pack_f32", "tpe_blocked_gemm_f32")
#: dtype -> (pack, GEMM) C functions
_FNS = {torch.bfloat16: KERNELS[:2], torch.float32: KERNELS_F32}
#: the bfloat16 GEMM's AMX path: whether it runs here, and the fewest rows that take it (process-wide)
AMX = ("tpe_blocked_amx", "tpe_blocked_amx_rows")
#: the row counts :func:`choose_amx` times both bfloat16 paths at. Below 8 rows both stream the weight once at
#: the memory's rate (one row: a tile multiply would compute 16 rows for one), a tie whose winner flips between
#: two measuring passes (docs/notes/kernels.md), so the choice would never be cached and be measured again, with
#: the layouts' timings keyed on it, at every start: fewer rows keep ``vdpbf16ps``.
AMX_ROWS = (8, 16, 32, 64)
#: the most bytes of synthetic weights per shape :func:`choose_amx` allocates (several copies of a small
#: shape, so that with the model's other shapes the weights stream from memory as in a step; few, so that the
#: choice takes a small part of a start's measuring budget, the vdpbf16ps path at 64 rows being slow)
AMX_MEASURE_BYTES = 4 << 20
_amx = {"rows": 0, "choice": None}


def available(weight: torch.Tensor) -> bool:
    """Whether a plain ``weight [n, k]`` can take the layout: on the CPU, ``n % 16 == 0``, and either bfloat16
    with ``k % 2 == 0`` and the library's bfloat16 kernels, or float32 with its float32 kernels (both in
    AVX-512 (bfloat16: with AVX512-BF16) and AVX2 builds)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[0] % 16:
        return False
    if weight.dtype == torch.bfloat16:
        return weight.shape[1] % 2 == 0 and cpu_library.has(*KERNELS)
    return weight.dtype == torch.float32 and cpu_library.has(*KERNELS_F32)


def is_blocked(t: torch.Tensor | None) -> bool:
    """Whether a layer's ``packed`` tensor is this layout (``[n / 16, k / 2, 16, 2]`` bfloat16 or
    ``[n / 16, k, 16]`` float32)."""
    if t is None:
        return False
    if t.dtype == torch.bfloat16:
        return t.dim() == 4 and tuple(t.shape[2:]) == (16, 2)
    return t.dtype == torch.float32 and t.dim() == 3 and t.shape[2] == 16


def shape(blocked: torch.Tensor) -> tuple[int, int]:
    """The plain weight's ``(n, k)``."""
    return blocked.shape[0] * 16, blocked.shape[1] * (2 if blocked.dtype == torch.bfloat16 else 1)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [n, k]`` (see :func:`available`) in the blocked layout, a new ``[n / 16, k / 2, 16, 2]``
    (bfloat16) or ``[n / 16, k, 16]`` (float32) tensor.

    Raises:
        ValueError: a weight :func:`available` refuses.
    """
    if not available(weight):
        raise ValueError(f"blocked layout: a CPU [n, k] weight with n % 16 == 0, bfloat16 (k even) or float32, "
                         f"an AVX-512 or AVX2 build; got {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}, build {cpu_library.isa()}")
    w = weight.detach().contiguous()
    n, k = w.shape
    bf16 = w.dtype == torch.bfloat16
    out = torch.empty(*((n // 16, k // 2, 16, 2) if bf16 else (n // 16, k, 16)), dtype=w.dtype)
    getattr(cpu_library.load(), _FNS[w.dtype][0])(w.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def unpack(blocked: torch.Tensor) -> torch.Tensor:
    """The plain ``[n, k]`` weight back (tests, and reading a weight out)."""
    n, k = shape(blocked)
    order = (0, 2, 1, 3) if blocked.dim() == 4 else (0, 2, 1)
    return blocked.permute(*order).reshape(n, k)


def rows(blocked: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[...]``, each in ``[0, n)``) of the plain weight, ``[..., k]``, gathered from the
    blocked tensor (row ``r`` is ``blocked[r // 16, :, r % 16]``, its pairs joined in bfloat16): a tied
    embedding's lookup when its table is held in this layout only (the LM head's), bit-equal to
    ``F.embedding`` on the plain weight."""
    got = blocked[ids.div(16, rounding_mode="floor"), :, ids.remainder(16)]  # [..., k / 2, 2] or [..., k]
    return got.reshape(*ids.shape, shape(blocked)[1])


def linear(x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """``x [rows, k] @ weight.T -> [rows, n]`` in the weight's dtype (float32 sums; bfloat16 rounded once),
    any ``rows``.

    Raises:
        ValueError: ``x`` not ``[rows, k]`` of the weight's dtype, or ``blocked`` not this layout.
    """
    if (not is_blocked(blocked) or x.dtype != blocked.dtype or x.dim() != 2
            or x.shape[1] != shape(blocked)[1]):
        raise ValueError(f"blocked linear: x [rows, k] of the weight's dtype against a [n/16, k/2, 16, 2] bfloat16 "
                         f"or [n/16, k, 16] float32 weight; got x {x.dtype} {tuple(x.shape)}, weight {blocked.dtype} "
                         f"{tuple(blocked.shape)}")
    return bind(blocked)(x.contiguous())


def bind(blocked: torch.Tensor):
    """``run(x [rows, k] contiguous, the weight's dtype) -> [rows, n]`` for this blocked weight (checks done
    once); ``run.c_spec``: its call in a decode program (:mod:`tpengine.backends.cpu.cpu_program`)."""
    name, dtype = _FNS[blocked.dtype][1], blocked.dtype
    fn, (n, k), wp = getattr(cpu_library.load(), name), shape(blocked), blocked.data_ptr()

    def run(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], n, dtype=dtype)
        if x.shape[0]:
            fn(x.data_ptr(), x.shape[0], k, wp, n, y.data_ptr(), torch.get_num_threads())
        return y
    run.c_spec = ("lin", name, k, wp, n)  # its call in a decode program (cpu_program)
    run.blocked = blocked  # the weight lives as long as the call that reads it through wp (not only the layer's)
    return run


def amx_available() -> bool:
    """Whether the bfloat16 GEMM's AMX path (``cpu_blocked.c``: 2 x 2 tiles of 16 rows x 16 outputs, the B
    tiles loaded straight from the blocked weight) can run in this process: an AVX512-BF16 build with
    AMX-BF16 (``-march=native`` on a CPU that has it) and the OS lets the process use tile data. Never
    raises."""
    return cpu_library.has(*AMX) and bool(cpu_library.load().tpe_blocked_amx())


def set_amx_rows(rows: int) -> None:
    """The bfloat16 blocked GEMM (every call in this process: :func:`linear`, :func:`bind`'s ``run``, a decode
    program's op) takes its AMX path from ``rows`` rows on (0: never; ignored where :func:`amx_available`
    is False). Those rows are the float32 sum of the same products, rounded once as the ``vdpbf16ps``
    path's, but the tile multiply's float32 sums round otherwise: an output may differ from the
    ``vdpbf16ps`` path's (and so from the row multiplied alone) by one bfloat16 step (docs/notes/kernels.md,
    "An AMX GEMM on the bfloat16 blocked layout")."""
    rows = max(int(rows), 0)
    if cpu_library.has(*AMX):
        cpu_library.load().tpe_blocked_amx_rows(rows)
    _amx["rows"] = rows if amx_available() else 0


def amx_rows() -> int:
    """The row count from which the bfloat16 blocked GEMM runs AMX in this process (0: never)."""
    return _amx["rows"]


def amx_choice():
    """The last :func:`choose_amx` :class:`~tpengine.backends.cpu.measured.Choice` in this process (None: not
    made), for the load's log."""
    return _amx["choice"]


def choose_amx(shapes: list[tuple[int, int]] | tuple = ((576, 576),)):
    """Measure, on the bfloat16 weight ``shapes`` (``(n, k)``, n % 16 == 0, k even; each as several synthetic
    copies, up to :data:`AMX_MEASURE_BYTES`, so they stream from memory), the blocked GEMM's ``vdpbf16ps``
    and AMX paths at each of :data:`AMX_ROWS` rows (a call over every copy of every shape, the current
    threads), by :func:`tpengine.backends.cpu.measured.timings` (cached per machine); AMX is taken from the
    smallest row count from which it is faster at every larger one (``"amx from 8 rows"``), else never
    (``"vdpbf16ps"``), and set for the process (:func:`set_amx_rows`). Returns the
    :class:`~tpengine.backends.cpu.measured.Choice`, or None where the AMX path does not run here (then
    nothing is set). A busy machine without cached timings keeps ``vdpbf16ps`` (unmeasured)."""
    from tpengine.backends.cpu.measured import Choice, timings, wins_from

    shapes = sorted({(int(n), int(k)) for n, k in shapes if n % 16 == 0 and k % 2 == 0})
    if not shapes or not amx_available():
        return None
    weights = []
    for n, k in shapes:
        copies = max(1, min(8, AMX_MEASURE_BYTES // (2 * n * k)))
        weights += [(pack(torch.full((n, k), 0.01 * (i + 1), dtype=torch.bfloat16)), k) for i in range(copies)]
    lib = cpu_library.load()
    xs = {k: torch.full((AMX_ROWS[-1], k), 0.5, dtype=torch.bfloat16) for _, k in shapes}

    def step(min_rows: int, rows: int) -> None:
        lib.tpe_blocked_amx_rows(min_rows)
        for b, k in weights:
            bind(b)(xs[k][:rows])

    cands = {name: [lambda r=r, m=m: step(m, r) for r in AMX_ROWS] for name, m in (("vdpbf16ps", 0), ("amx", 1))}

    def amx_from(times: dict[str, list[float]]) -> int:
        """The first row count from which AMX wins at every larger one (0: none)."""
        return wins_from(times, list(AMX_ROWS), "amx", "vdpbf16ps")
    key = (f"blocked bf16 amx {' '.join(f'{n}x{k}' for n, k in shapes)} rows {'/'.join(map(str, AMX_ROWS))}")
    try:
        times, how = timings(key, cands, passes=3, decide=amx_from)
    finally:
        lib.tpe_blocked_amx_rows(_amx["rows"])
    start = amx_from(times) if times is not None else 0
    choice = Choice(f"amx from {start} rows" if start else "vdpbf16ps", how, times or {})
    set_amx_rows(start)
    _amx["choice"] = choice
    return choice
