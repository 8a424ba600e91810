"""Which CPU weight layout each linear shape runs in, chosen by measurement on the machine that runs.

A CPU linear layer holds its weight in ONE of two layouts (never both: that would be a second copy):

* ``plain``: the row-major ``[out, in]`` tensor, multiplied by ``F.linear`` (MKL's sgemm in float32,
  torch's oneDNN/cpublas GEMM in half precision);
  or, for a bfloat16 weight at up to a few rows, tpengine's own GEMV kernel
  (:mod:`tpengine.kernels.cpu_gemv`) where it measured faster;
* ``packed``: oneDNN's blocked layout (:func:`tpengine.layers.linear.prepack`), multiplied by
  ``torch.ops.mkldnn._linear_pointwise``.

Which one is faster depends on the CPU, the dtype, the shape and the number of rows: on a 2-vCPU
AMD EPYC the packed float32 path was ~2x faster, on an Intel Sapphire Rapids MKL's float32 sgemm
wins at one row (docs/notes/kernels.md). So nothing is hard-coded: :func:`choose_layouts` times
both layouts for every distinct ``(out, in)`` shape of the model, at the row buckets
:data:`ROW_BUCKETS`, over as many distinct weights of that shape as the model has (up to
:data:`MEASURE_BYTES`), so the weights stream from memory as they do in a step rather than sitting
in a cache. A shape takes the layout with the smaller sum over the buckets of its time relative to
the faster one. Each shape is measured twice; when the two disagree by more than 1.5x at some
bucket (another process took the cores), the faster of each is used for this run and nothing is
cached. Otherwise the timings are cached per CPU model and flags, torch version, thread count and
dtype in ``$TPENGINE_CACHE_DIR`` (default ``~/.cache/tpengine``), so a machine measures once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tpengine.kernels import CPU_LINEAR_CHOICES, cpu_gemv, cpu_native
from tpengine.kernels.cpu_native import cache_root, cpu_id
from tpengine.kernels.measured import consistent, read_cache, time_us, write_cache

LAYOUTS = ("plain", "packed")
#: Rows per call the choice is measured at: one decoding sequence, a small batch, a full decode batch.
ROW_BUCKETS = (1, 8, 64)
#: The most weight bytes (per shape and layout) one measurement allocates; larger single weights
#: are not measured (they keep ``packed``, the layout that saves the per-call reorder).
MEASURE_BYTES = 256 << 20
CACHE_VERSION = 3


@dataclass(frozen=True)
class LayoutChoice:
    """The layout chosen for one weight shape: ``layout`` ("plain" or "packed"), ``how``
    ("measured", "cached", "forced" or "default" for an unmeasured one), the microseconds per
    call of each path at each of :data:`ROW_BUCKETS` (empty unless measured or cached), and for a
    plain bfloat16 weight ``gemv_rows``, the most rows the GEMV kernel takes (:func:`gemv_rows`)."""

    layout: str
    how: str
    times_us: dict[str, list]
    gemv_rows: int = 0

    def describe(self, shape: tuple[int, int]) -> str:
        """``"576->960 plain (plain 85/146/337 us, packed 128/126/439 us at 1/8/64 rows)"``."""
        out, inp = shape
        s = f"{inp}->{out} {self.layout}" + (f" (gemv up to {self.gemv_rows} rows)" if self.gemv_rows else "")
        if self.times_us:
            cols = ", ".join(f"{k} {'/'.join('-' if t is None else f'{t:.0f}' for t in v)} us"
                             for k, v in self.times_us.items())
            s += f" ({cols} at {'/'.join(map(str, ROW_BUCKETS))} rows)"
        return s


def gemv_rows(times_us: dict[str, list]) -> int:
    """The most rows up to which the plain layout runs :func:`tpengine.kernels.cpu_gemv.gemv` instead
    of ``F.linear``: the largest bucket up to which the GEMV was faster at every bucket (0: never;
    no ``"gemv"`` timings: never)."""
    rows = 0
    for n, g, p in zip(ROW_BUCKETS, times_us.get("gemv") or (), times_us["plain"]):
        if g is None or g >= p:
            break
        rows = n
    return rows


def pick(times_us: dict[str, list]) -> str:
    """The layout whose summed time relative to the faster layout, over the buckets, is smallest
    (``{"plain": [t1, t8, t64], "packed": [...], "gemv": [t1, t8, None]}``, the optional GEMV
    timings counting for the plain layout up to :func:`gemv_rows`); a tie keeps ``packed``."""
    g = gemv_rows(times_us)
    plain = [min(p, t) if n <= g else p for n, p, t in zip(ROW_BUCKETS, times_us["plain"],
                                                            times_us.get("gemv") or times_us["plain"])]
    layouts = {"plain": plain, "packed": times_us["packed"]}
    best = [min(ts) for ts in zip(*layouts.values())]
    score = {k: sum(t / b for t, b in zip(v, best)) for k, v in layouts.items()}
    return min(sorted(score), key=lambda k: (score[k], k != "packed"))


def measure(shape: tuple[int, int], count: int, dtype: torch.dtype) -> dict[str, list[float]] | None:
    """Microseconds per call of each layout for a weight ``shape = (out, in)`` in ``dtype`` at each
    of :data:`ROW_BUCKETS` rows, rotating over ``min(count, MEASURE_BYTES // bytes)`` distinct
    synthetic weights. None where packing is unavailable or one weight exceeds :data:`MEASURE_BYTES`."""
    from tpengine.layers.linear import prepack

    out, inp = shape
    nbytes = out * inp * torch.empty(0, dtype=dtype).element_size()
    if nbytes > MEASURE_BYTES:
        return None
    n = max(1, min(count, MEASURE_BYTES // nbytes))
    plain = [torch.full((out, inp), 0.01 * (i + 1), dtype=dtype) for i in range(n)]
    if prepack(plain[0]) is None:
        return None
    times: dict[str, list] = {"plain": [], "packed": []}
    for rows in ROW_BUCKETS:
        x = torch.full((rows, inp), 0.5, dtype=dtype)
        times["plain"].append(time_us([lambda w=w: F.linear(x, w) for w in plain]))
    if cpu_gemv.available(plain[0]):
        times["gemv"] = [time_us([lambda w=w: cpu_gemv.gemv(x, w) for w in plain])
                         if (x := torch.full((rows, inp), 0.5, dtype=dtype)).shape[0] <= cpu_gemv.MAX_ROWS else None
                         for rows in ROW_BUCKETS]
    packed = []
    for i in range(n):  # replace as we go: never both layouts of all the synthetic weights
        packed.append(prepack(plain[i]))
        plain[i] = None
    for rows in ROW_BUCKETS:
        x = torch.full((rows, inp), 0.5, dtype=dtype)
        times["packed"].append(time_us([lambda p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                         for p in packed]))
    return times


def cache_path(dtype: torch.dtype) -> Path:
    """The timings file for this CPU (model and flags), build of the C kernels
    (:func:`~tpengine.kernels.cpu_native.library_key`), torch version, thread count and ``dtype``."""
    key = "\0".join([str(CACHE_VERSION), cpu_id(), cpu_native.library_key(), torch.__version__,
                     str(torch.get_num_threads()), str(dtype)])
    return cache_root() / f"linear-layouts-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def choose_layouts(shapes: dict[tuple[int, int], int], dtype: torch.dtype, setting: str = "auto",
                   native: bool = True) -> dict[tuple[int, int], LayoutChoice]:
    """The layout of each weight shape ``(out, in)`` (``shapes`` maps it to how many layers of this
    rank have it) for CPU weights in ``dtype``: ``setting`` "plain" or "packed" forces it; "auto"
    measures (:func:`measure`) or reads the cached timings (:func:`cache_path`). ``native`` False
    (``EngineConfig.cpu_kernels`` off) leaves the GEMV kernel out of the choice.

    Raises:
        ValueError: ``setting`` not in :data:`CPU_LINEAR_CHOICES`.
    """
    if setting not in CPU_LINEAR_CHOICES:
        raise ValueError(f"invalid cpu_linear={setting!r}: must be one of {', '.join(CPU_LINEAR_CHOICES)}")
    if setting != "auto":
        return {s: LayoutChoice(setting, "forced", {}) for s in shapes}
    path = cache_path(dtype)
    cache = read_cache(path)
    chosen, wrote = {}, False
    for shape, count in sorted(shapes.items()):
        key = f"{shape[0]}x{shape[1]}x{min(count, 1 << 20)}"
        times = cache.get(key)
        how = "cached"
        if not (isinstance(times, dict) and all(len(times.get(k) or ()) == len(ROW_BUCKETS) for k in LAYOUTS)):
            times, how = measure(shape, count, dtype), "measured"
            again = None if times is None else measure(shape, count, dtype)
            if times is not None and again is not None:
                if consistent(times, again):
                    cache[key], wrote = times, True
                else:  # another process shared the cores: use the faster of the two, cache neither
                    how = "measured, noisy (not cached)"
                times = {k: [None if a is None else min(a, b) for a, b in zip(v, again[k])] for k, v in times.items()}
        if times is None:
            chosen[shape] = LayoutChoice("packed", "default", {})
        else:
            if not native:
                times = {k: v for k, v in times.items() if k != "gemv"}
            layout = pick(times)
            chosen[shape] = LayoutChoice(layout, how, times, gemv_rows(times) if layout == "plain" else 0)
    if wrote:
        write_cache(path, cache)
    return chosen


def summary(chosen: dict[tuple[int, int], LayoutChoice], dtype: torch.dtype) -> str:
    """The one line rank 0 logs: every shape's layout and the timings it was chosen on."""
    hows = sorted({c.how for c in chosen.values()})
    return (f"tpengine: CPU linear layouts ({str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
            f"{'/'.join(hows)}): " + "; ".join(c.describe(s) for s, c in sorted(chosen.items())))
