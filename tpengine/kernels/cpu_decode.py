"""bfloat16 decode attention on CPU through a small C kernel (``cpu_decode.c``), built at run time.

Why: one decode step attends one query token per sequence over contiguous ``[B * Hkv, L, D]``
keys and values (see :mod:`tpengine.kernels.kv_mirror`). ``torch.bmm`` does that as B * Hkv
matrices of ``G x D @ D x L`` (G query heads per KV head) and pays oneDNN's per-matrix overhead:
at 64 sequences x 3 KV heads x ~200 tokens (SmolLM2-135M) it reads K and V at ~20 GB/s where a
plain read streams at ~45 GB/s, and the two bmms were ~16 of a ~55 ms step. The kernel computes
the same two products with AVX512-BF16 dot products (``vdpbf16ps``) and reads only the visible
keys of each sequence (not the mirror's masked tail). The float32 softmax between them stays
``torch.softmax``, so the arithmetic is the torch path's: scores rounded to bfloat16 then scaled
in float32, probabilities rounded to bfloat16, ``p @ V`` accumulated in float32 -- up to the order
of the float32 sums (a rare one-ulp difference in a bfloat16 result).

Build: ``cc -O3 -march=native -fopenmp -shared`` (``$CC`` if set) into
``$TPENGINE_CACHE_DIR`` (default ``~/.cache/tpengine``), one file per source, compiler and CPU,
written atomically so concurrent ranks may build at once (~1 s). OpenMP threads come from the
libgomp torch has loaded; each call uses ``torch.get_num_threads()`` of them. When there is no
compiler, the build fails, or the CPU lacks AVX512-BF16 (the portable C path is no faster than
``torch.bmm``), :func:`available` is False and callers keep ``torch.bmm``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ENABLED = True  # set from EngineConfig.cpu_decode_kernel by the model runner
MAX_G, MAX_D = 8, 256  # the C code's stack buffers: query heads per KV head, head size
SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why the kernel is unavailable, once a load was tried


def _cpu_id() -> str:
    """The CPU's model and feature flags (part of the cache key: the build uses -march=native)."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({line for line in info if line.startswith(("model name", "flags"))}))


def _build() -> Path:
    """Compile ``cpu_decode.c`` unless a build for this source, compiler and CPU exists; return the
    library's path. Raises RuntimeError (no compiler, or the compiler's message on failure)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, cc.encode(), " ".join(FLAGS).encode(), platform.machine().encode(),
                                     _cpu_id().encode()])).hexdigest()[:16]
    root = Path(os.environ.get("TPENGINE_CACHE_DIR") or Path.home() / ".cache" / "tpengine")
    for folder in (root, Path(tempfile.gettempdir()) / f"tpengine-{os.getuid()}"):
        lib = folder / f"cpu_decode-{key}.so"
        if lib.exists():
            return lib
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        tmp = folder / f".cpu_decode-{key}-{os.getpid()}.so"
        res = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-500:]}")
        os.replace(tmp, lib)  # atomic: a concurrent rank sees the whole file or none
        return lib
    raise RuntimeError(f"no writable cache folder ({root} or the temp folder)")


def load() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None when unavailable (see
    :func:`unavailable_reason`). Never raises."""
    global _lib, _reason
    if _lib is None and _reason is None:
        try:
            lib = ctypes.CDLL(str(_build()))
            ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            lib.tpe_fast.restype = i32
            lib.tpe_decode_scores.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i32, i64, i32, ctypes.c_float, i32]
            lib.tpe_decode_scores.restype = None
            lib.tpe_decode_pv.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i32, i64, i32, i32]
            lib.tpe_decode_pv.restype = None
            if not lib.tpe_fast():
                raise RuntimeError("the CPU or compiler lacks AVX512-BF16 (the portable path is no faster than bmm)")
            _lib = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _reason = str(e)
            print(f"tpengine: C decode-attention kernel unavailable, using torch.bmm: {_reason}", file=sys.stderr)
    return _lib


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None while it has not failed)."""
    return _reason


def available(q: torch.Tensor, g: int, d: int) -> bool:
    """Whether :func:`decode_attention` can take this step: :data:`ENABLED`, a CPU bfloat16 query,
    ``g <= 8`` query heads per KV head, ``d <= 256``, and the library loads."""
    return (ENABLED and q.device.type == "cpu" and q.dtype == torch.bfloat16 and g <= MAX_G and d <= MAX_D
            and load() is not None)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """``softmax(q @ k^T * scale, masked) @ v`` for one query token per sequence, bfloat16 on CPU.

    Shapes: ``q [B, Hkv, G, D]``, ``k`` and ``v [B, Hkv, L, D]`` contiguous (``L`` >= every
    length), ``context_lens [B]`` int64: sequence ``b`` sees keys ``< context_lens[b]`` (a
    length-0 padding row sees key 0). Returns ``[B, Hkv, G, D]`` bfloat16. Raises ValueError on
    a shape, dtype or layout mismatch; RuntimeError if the library is unavailable (check
    :func:`available` first).
    """
    lib = load()
    if lib is None:
        raise RuntimeError(f"C decode-attention kernel unavailable: {_reason}")
    b, hkv, g, d = q.shape
    if (k.shape != v.shape or k.shape[:2] != (b, hkv) or k.shape[3] != d or context_lens.shape != (b,)
            or g > MAX_G or d > MAX_D):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, context_lens "
                         f"{tuple(context_lens.shape)}: expected [B, Hkv, G<={MAX_G}, D<={MAX_D}], "
                         "[B, Hkv, L, D] x2, [B]")
    if not all(t.dtype == torch.bfloat16 and t.is_contiguous() and t.device.type == "cpu" for t in (k, v)):
        raise ValueError("k and v must be contiguous bfloat16 CPU tensors")
    cap = k.shape[2]
    if context_lens.numel() and int(context_lens.max()) > cap:
        raise ValueError(f"context length {int(context_lens.max())} exceeds the {cap} keys given")
    q = q.to(torch.bfloat16).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    nt, rows = torch.get_num_threads(), b * hkv
    scores = torch.empty(b, hkv, g, cap, dtype=torch.float32)
    lib.tpe_decode_scores(q.data_ptr(), k.data_ptr(), lens.data_ptr(), scores.data_ptr(), rows, hkv, g, cap, d,
                          scale, nt)
    p = torch.softmax(scores, dim=-1).to(torch.bfloat16)
    out = torch.empty(b, hkv, g, d, dtype=torch.bfloat16)
    lib.tpe_decode_pv(p.data_ptr(), v.data_ptr(), lens.data_ptr(), out.data_ptr(), rows, hkv, g, cap, d, nt)
    return out
