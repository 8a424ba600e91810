"""Build and load tpengine's CPU C kernels (``cpu_decode.c``, ``cpu_fused.c``; both include ``bf16.h``)
at run time.

The kernels are bfloat16 AVX512-BF16 code for the CPU path (decode attention in
:mod:`tpengine.backends.cpu.cpu_decode`; residual add + RMSNorm, RoPE and SiLU * up in
:mod:`tpengine.backends.cpu.cpu_fused`), called as torch ops (:mod:`tpengine.backends.cpu.cpu_ops`).
They are built with ``cc -O3 -march=native -fopenmp -shared``
(``$CC`` if set) into ``$TPENGINE_CACHE_DIR`` (default ``~/.cache/tpengine``), one library per
source, compiler and CPU, written atomically so concurrent ranks may build at once (once per
machine). OpenMP threads come from the libgomp torch has already loaded; each call passes
``torch.get_num_threads()``. When there is no compiler, the build fails, or the CPU lacks
AVX512-BF16, :func:`load` returns None (with one line on stderr) and every caller keeps its torch
ops: the kernels only ever make the CPU bfloat16 path faster, never required.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).parent / "csrc" / n for n in ("cpu_decode.c", "cpu_fused.c", "cpu_paged.c",
                                                         "cpu_gemv.c", "cpu_gemm.c", "cpu_qgemv.c", "cpu_shm.c",
                                                         "cpu_argmax.c"))
#: included by the sources: part of the cache key
HEADERS = (Path(__file__).parent / "csrc" / "bf16.h", Path(__file__).parent / "csrc" / "gemv.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why the library is unavailable, once a load was tried

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
#: C functions that return an int64: those that check their indices -1 or the position of the first bad
#: one; tpe_shm_all_reduce how far it got (cpu_shm.c)
RETURNS_INDEX = ("tpe_copy_rows", "tpe_decode_scores", "tpe_decode_pv", "tpe_paged_decode_f32",
                 "tpe_paged_decode_bf16", "tpe_qgemv_int8", "tpe_qgemv_int4", "tpe_shm_all_reduce",
                 "tpe_shm_all_reduce_add_rms_norm")
_PAGED = [_P, _I64, _P, _I64, _P, _I64, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _P, _I64, _I64, _I64, _F32, _P,
          _I64, _I32]
SIGNATURES = {  # C function -> argument types (all return void but tpe_fast and RETURNS_INDEX)
    "tpe_decode_scores": [_P, _P, _P, _P, _I64, _I64, _I32, _I64, _I32, _F32, _I32],
    "tpe_decode_pv": [_P, _P, _P, _P, _I64, _I64, _I32, _I64, _I32, _I32],
    "tpe_add_rms_norm": [_P, _P, _P, _P, _P, _I64, _I64, _F32, _I32],
    "tpe_rope": [_P, _I64, _I64, _I64, _P, _P, _I64, _I32],
    "tpe_silu_mul": [_P, _P, _I64, _I64, _I32],
    "tpe_add_rms_norm_f32": [_P, _P, _P, _P, _P, _I64, _I64, _F32, _I32],
    "tpe_silu_mul_f32": [_P, _P, _I64, _I64, _I32],
    "tpe_copy_rows": [_P, _P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I32],
    "tpe_causal_softmax": [_P, _I64, _I64, _F32, _I32],
    "tpe_paged_decode_f32": _PAGED,
    "tpe_paged_decode_bf16": _PAGED,
    "tpe_paged_set_amx": [_I32],
    **{f"tpe_{w}_argmax_{t}": [_P, _I64, _I64, _I64, _P, _I32] for w in ("row", "col") for t in ("f32", "bf16")},
    "tpe_gemv_bf16": [_P, _I64, _I64, _P, _I64, _P, _I32],
    "tpe_gemv_f32": [_P, _I64, _I64, _P, _I64, _P, _I32],
    "tpe_gemm_f32": [_P, _I64, _I64, _P, _I64, _P, _P, _I32],
    "tpe_qgemv_int8": [_P, _I64, _I64, _P, _P, _I64, _P, _I32, _I32],
    "tpe_qgemv_int4": [_P, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _P, _I32, _I32],
    "tpe_dequant_int4": [_P, _P, _P, _I64, _I64, _I64, _P, _I32, _I32],
    "tpe_shm_all_reduce": [_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _I64],
    "tpe_shm_all_reduce_add_rms_norm": [_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _F32,
                                        _I32],
}


def cpu_id() -> str:
    """The CPU's model and feature flags (part of the cache key: the build uses -march=native)."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({line for line in info if line.startswith(("model name", "flags"))}))


def cache_root() -> Path:
    """tpengine's cache folder: ``$TPENGINE_CACHE_DIR``, default ``~/.cache/tpengine``."""
    return Path(os.environ.get("TPENGINE_CACHE_DIR") or Path.home() / ".cache" / "tpengine")


def _compiler() -> list[str]:
    """The C compiler command: ``$CC`` (split like a shell would, so ``CC="gcc -O2"`` works), else
    ``cc`` or ``gcc`` on PATH. Raises RuntimeError when there is none."""
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not cc[0]:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")
    return cc


def _usable_folder(folder: Path, private: bool) -> bool:
    """Create ``folder`` if needed; True if we may write it -- and, for the shared temp folder
    (``private``), only if it is ours and nobody else can write it, since we load code from it."""
    try:
        folder.mkdir(mode=0o700 if private else 0o777, parents=True, exist_ok=True)
        st = folder.stat()
    except OSError:
        return False
    if private and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def build_key(cc: list[str] | None = None) -> str:
    """The 16 hex digits naming a build: a hash of the sources, the headers, the compiler command
    and flags, the machine and the CPU (:func:`cpu_id`). Part of the name of the built library, and
    of the key of every timing measured on it (a changed kernel is measured again). Raises
    RuntimeError when no compiler is found (``cc`` None: :func:`_compiler`'s)."""
    cc = _compiler() if cc is None else cc
    parts = [p.read_bytes() for p in SOURCES + HEADERS] + [" ".join(cc + list(FLAGS)).encode(),
                                                           platform.machine().encode(), cpu_id().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _build(rebuild: bool = False) -> Path:
    """Compile the sources unless a build for them, this compiler and this CPU exists (``rebuild``:
    replace it); return the library's path. Tries ``$TPENGINE_CACHE_DIR`` (default
    ``~/.cache/tpengine``), then a private folder in the temp folder. Raises RuntimeError (no
    compiler, no writable folder, or the compiler's exit status and message on failure)."""
    cc = _compiler()
    key = build_key(cc)
    root = cache_root()
    for folder, private in ((root, False), (Path(tempfile.gettempdir()) / f"tpengine-{os.getuid()}", True)):
        lib = folder / f"cpu_kernels-{key}.so"
        if lib.exists() and not rebuild:
            return lib
        if not _usable_folder(folder, private):
            continue
        tmp = folder / f".cpu_kernels-{key}-{os.getpid()}.so"
        try:
            res = subprocess.run([*cc, *FLAGS, *map(str, SOURCES), "-o", str(tmp)], capture_output=True, text=True,
                                 timeout=120)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cc)} failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")
            os.replace(tmp, lib)  # atomic: a concurrent rank sees the whole file or none
            return lib
        finally:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
    raise RuntimeError(f"no writable cache folder ({root}, or a private one in the temp folder)")


def _open(path: Path) -> ctypes.CDLL:
    """Load the library and declare its functions. Raises OSError, AttributeError, RuntimeError."""
    lib = ctypes.CDLL(str(path))
    lib.tpe_fast.restype = _I32
    for name, args in SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, None
    for name in RETURNS_INDEX:
        getattr(lib, name).restype = _I64
    lib.tpe_paged_set_amx.restype = _I32
    if not lib.tpe_fast():
        raise RuntimeError("the CPU or compiler lacks AVX512-BF16")
    return lib


def load() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use (and once more if a cached build does
    not load, e.g. a truncated file); None when unavailable (see :func:`unavailable_reason`, also
    printed once to stderr, with the rank under torchrun). Never raises. Call it before the first
    step, so the build is not timed as part of one."""
    global _lib, _reason
    if _lib is None and _reason is None:
        try:
            try:
                _lib = _open(_build())
            except OSError:
                _lib = _open(_build(rebuild=True))
        except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as e:
            _reason = str(e)
            rank = f" (rank {os.environ['RANK']})" if "RANK" in os.environ else ""
            print(f"tpengine{rank}: CPU C kernels unavailable, using torch ops: {_reason}", file=sys.stderr)
    return _lib


def library_key() -> str:
    """:func:`build_key` of the library :func:`load` gives, or "unavailable": the part of a cached
    timing's key that names the kernels it timed. Never raises."""
    if load() is None:
        return "unavailable"
    try:
        return build_key()
    except RuntimeError:
        return "unavailable"


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None while it has not failed)."""
    return _reason


def usable(*tensors: torch.Tensor, float32: bool = False) -> bool:
    """Whether the C kernels may take these tensors: all bfloat16 (or, with ``float32``, all
    float32) on CPU, and the library loads. (Whether to use them at all is the caller's ``cpu_kernels``
    flag, from ``EngineConfig.cpu_kernels``.)"""
    dtype = tensors[0].dtype if tensors else torch.bfloat16
    ok = dtype == torch.bfloat16 or (float32 and dtype == torch.float32)
    return ok and all(t.dtype == dtype and t.is_cpu for t in tensors) and (_lib is not None or load() is not None)
