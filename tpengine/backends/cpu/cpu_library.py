"""Build and load tpengine's CPU C kernels (the sources in ``csrc/``; they include ``bf16.h``,
``gemv.h``, ``paged.h`` and ``amx.h``) at run time.

The kernels are the CPU path's fused element-wise ops, GEMV / GEMM, paged decode attention,
quantized GEMV, argmax and the shared-memory all-reduce, called as torch ops
(:mod:`tpengine.backends.cpu.cpu_ops`) or through ctypes. They are built with
``cc -O3 -march=native -fopenmp -shared`` (``$CC`` if set; ``-march=x86-64-v3`` under
``TPENGINE_ISA=avx2``, see :func:`march`) into ``$TPENGINE_CACHE_DIR`` (default
``~/.cache/tpengine``), one library per source, compiler, flags and CPU, written atomically so
concurrent ranks may build at once (once per machine); the sources compile side by side, one per
CPU, and link once (:func:`_compile`). OpenMP threads come from the libgomp torch
has already loaded; each call passes ``torch.get_num_threads()``.

Each kernel has vector paths chosen at build time from the compiler's target macros (``bf16.h``):
AVX-512 with AVX512-BF16 (AMX tiles in the paged kernel where the compiler targets them, still
checked at run time), else AVX2 + FMA. :func:`isa` names the path built. A kernel with no path for
the build's target is left out of the library: :func:`has` is False for it and its callers keep
their torch ops -- the one rule every caller follows (:func:`usable` takes the kernel names). When
there is no compiler or the build fails, :func:`load` returns None (with one line on stderr) and
every caller keeps its torch ops: the kernels only ever make the CPU path faster, never required.
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
import time
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).parent / "csrc" / n for n in ("cpu_decode.c", "cpu_fused.c", "cpu_paged.c",
                                                         "cpu_gemv.c", "cpu_gemm.c", "cpu_blocked.c", "cpu_qgemv.c",
                                                         "cpu_shm.c",
                                                         "cpu_argmax.c", "cpu_paged_i8.c", "cpu_program.c"))
#: included by the sources: part of the cache key
HEADERS = tuple(Path(__file__).parent / "csrc" / n for n in ("amx.h", "bf16.h", "gemv.h", "paged.h"))
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")  # and march()'s -march
#: ``TPENGINE_ISA`` -> the ``-march`` the kernels are built with. "avx2" builds the AVX2 + FMA paths
#: on any x86-64-v3 CPU (an AVX-512 machine too, to run and measure them); torch is capped the same
#: way with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``.
ISAS = {"native": "-march=native", "avx2": "-march=x86-64-v3"}

_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why the library is unavailable, once a load was tried
_have: frozenset[str] = frozenset()  # the C functions the loaded library exports
_isa: str | None = None  # its tpe_isa()

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
#: C functions that return an int64: those that check their indices -1 or the position of the first bad
#: one; tpe_shm_all_reduce how far it got (cpu_shm.c)
RETURNS_INDEX = ("tpe_copy_rows", "tpe_decode_scores", "tpe_decode_pv", "tpe_paged_decode_f32",
                 "tpe_paged_decode_bf16", "tpe_paged_decode_i8_f32", "tpe_paged_decode_i8_bf16", "tpe_qgemv_int8",
                 "tpe_qgemv_int4", "tpe_dequant_int4",
                 "tpe_int4_rows", "tpe_shm_all_reduce", "tpe_shm_all_reduce_add_rms_norm", "tpe_qgemv_int4_q8",
                 "tpe_qgemv_int8_q8", "tpe_moe_decode_bf16", "tpe_program_run")
_PAGED = [_P, _I64, _P, _I64, _P, _I64, _P, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _P, _I64, _I64, _I64, _F32, _P,
          _I64, _I64, _I32, _I64, _F32]
#: the int8-cache kernel (cpu_paged_i8.c): _PAGED with the two scale pointers after the caches, no amx_min_batch
_PAGED_I8 = [*_PAGED[:14], _P, _P, *_PAGED[14:23], *_PAGED[24:]]
SIGNATURES = {  # C function -> argument types (all return void but tpe_paged_amx, tpe_blocked_amx and RETURNS_INDEX)
    "tpe_decode_scores": [_P, _P, _P, _P, _I64, _I64, _I32, _I64, _I32, _F32, _I32],
    "tpe_decode_pv": [_P, _P, _P, _P, _I64, _I64, _I32, _I64, _I32, _I32],
    "tpe_add_rms_norm": [_P, _P, _P, _P, _P, _I64, _I64, _F32, _I32],
    "tpe_rope": [_P, _I64, _I64, _I64, _P, _P, _I64, _I32],
    "tpe_rope_f32": [_P, _I64, _I64, _I64, _P, _P, _I64, _I32],
    "tpe_silu_mul": [_P, _P, _I64, _I64, _I32],
    "tpe_add_rms_norm_f32": [_P, _P, _P, _P, _P, _I64, _I64, _F32, _I32],
    "tpe_add_rms_norm_w32": [_P, _P, _P, _P, _P, _I64, _I64, _F32, _I32],
    "tpe_soft_cap": [_P, _I64, _F32, _I32],
    "tpe_silu_mul_f32": [_P, _P, _I64, _I64, _I32],
    "tpe_gelu_tanh_mul": [_P, _P, _I64, _I64, _I32],
    "tpe_gelu_tanh_mul_f32": [_P, _P, _I64, _I64, _I32],
    **{f"tpe_head_rms_norm{t}": [_P, _I64, _I64, _I64, _I64, _P, _I64, _F32, _I32] for t in ("", "_f32")},
    "tpe_copy_rows": [_P, _P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I32],
    "tpe_causal_softmax": [_P, _I64, _I64, _F32, _I32],
    "tpe_paged_decode_f32": _PAGED,
    "tpe_paged_decode_bf16": _PAGED,
    "tpe_paged_decode_i8_f32": _PAGED_I8,
    "tpe_paged_decode_i8_bf16": _PAGED_I8,
    "tpe_paged_amx": [],
    **{f"tpe_{w}_argmax_{t}": [_P, _I64, _I64, _I64, _P, _I32] for w in ("row", "col") for t in ("f32", "bf16")},
    "tpe_gemv_bf16": [_P, _I64, _I64, _P, _I64, _P, _I32],
    "tpe_gemv_f32": [_P, _I64, _I64, _P, _I64, _P, _I32],
    "tpe_blocked_pack_bf16": [_P, _I64, _I64, _P, _I32],
    "tpe_blocked_gemm_bf16": [_P, _I64, _I64, _P, _I64, _P, _I32],
    "tpe_blocked_amx": [],
    "tpe_blocked_amx_rows": [_I64],
    "tpe_blocked_group_bf16": [_P, _I64, _I64, _P, _I64, _I64, _P, _I32],
    "tpe_blocked_moe_down_bf16": [_P, _I64, _P, _I64, _I64, _P, _P, _I32],
    "tpe_blocked_pack_f32": [_P, _I64, _I64, _P, _I32],
    "tpe_blocked_gemm_f32": [_P, _I64, _I64, _P, _I64, _P, _I32],
    "tpe_moe_decode_bf16": [_P, _I64, _P, _I64, _I64, _I32, _I32, _I64, _I64, _P, _P, _I64, _I32, _P, _I32],
    "tpe_gemm_f32": [_P, _I64, _I64, _P, _I64, _P, _P, _I32],
    "tpe_gemm_bf16": [_P, _I64, _I64, _P, _I64, _P, _P, _I32],
    "tpe_gemm_blocked_f32": [_P, _I64, _I64, _P, _I64, _P, _I32],
    "tpe_qgemv_int8": [_P, _I64, _I64, _P, _P, _I64, _P, _I32, _I32],
    "tpe_qgemv_int8_q8": [_P, _I64, _I64, _P, _P, _I64, _P, _I32, _I32],
    "tpe_qgemv_int4": [_P, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _I32, _I32],
    "tpe_qgemv_int4_q8": [_P, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _I32, _I32],
    "tpe_dequant_int4": [_P, _P, _P, _I64, _I64, _I64, _I64, _P, _I32, _I32],
    "tpe_int4_rows": [_P, _P, _P, _I64, _I64, _I64, _I64, _P, _I64, _P, _I32, _I32],
    "tpe_shm_all_reduce": [_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _I64],
    "tpe_program_run": [_P, _I64, _P, _I64],
    "tpe_shm_all_reduce_add_rms_norm": [_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _F32,
                                        _I32],
}


def march() -> str:
    """The ``-march`` flag of the build: ``-march=native`` unless ``$TPENGINE_ISA`` names another
    entry of :data:`ISAS` ("avx2": ``-march=x86-64-v3``). Raises RuntimeError for an unknown name."""
    name = os.environ.get("TPENGINE_ISA", "").strip().lower() or "native"
    if name not in ISAS:
        raise RuntimeError(f"TPENGINE_ISA={name!r}: expected one of {', '.join(ISAS)}")
    return ISAS[name]


def flags() -> tuple[str, ...]:
    """The compiler flags of the build (:data:`FLAGS` with :func:`march`'s). Raises RuntimeError
    for an unknown ``$TPENGINE_ISA``."""
    return (FLAGS[0], march(), *FLAGS[1:])


def cpu_id() -> str:
    """The CPU's model and feature flags (part of the cache key: a native build, and every timing, depend on it)."""
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
    and flags (``-march`` included: ``$TPENGINE_ISA``), the machine and the CPU (:func:`cpu_id`).
    Part of the name of the built library, and of the key of every timing measured on it (a changed
    kernel is measured again). Raises RuntimeError when no compiler is found (``cc`` None:
    :func:`_compiler`'s) or ``$TPENGINE_ISA`` is unknown."""
    cc = _compiler() if cc is None else cc
    parts = [p.read_bytes() for p in SOURCES + HEADERS] + [" ".join(cc + list(flags())).encode(),
                                                           platform.machine().encode(), cpu_id().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


#: Seconds the build may take (its compiles and its link together).
BUILD_TIMEOUT_S = 120


def _compile(cc: list[str], objects: Path, out: Path) -> None:
    """Build the library ``out`` from :data:`SOURCES`: each source compiled to an object file in the
    new folder ``objects``, as many at once as this process has CPUs, then one link. The code is what
    one ``cc FLAGS *.c -o out`` call makes (it too compiles each file on its own, one after another).
    Raises RuntimeError with the compiler's exit status and message (the first that failed), or when
    the build takes over :data:`BUILD_TIMEOUT_S`."""
    objects.mkdir()
    compile_flags = [f for f in flags() if f != "-shared"]
    jobs = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    pending, running, objs = list(SOURCES), [], []

    def check(proc: subprocess.Popen) -> None:
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cc)} failed (exit {proc.returncode}): {proc.stderr.read().strip()[-500:]}")

    try:
        while pending or running:
            while pending and len(running) < jobs:
                src = pending.pop(0)
                objs.append(objects / f"{src.stem}.o")
                running.append(subprocess.Popen([*cc, *compile_flags, "-c", str(src), "-o", str(objs[-1])],
                                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            for proc in [p for p in running if p.poll() is not None]:
                running.remove(proc)
                check(proc)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(cc)}: the build took over {BUILD_TIMEOUT_S} s")
            if running:
                time.sleep(0.01)
        link = subprocess.Popen([*cc, *flags(), *map(str, objs), "-o", str(out)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        running.append(link)
        try:
            link.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(cc)}: the build took over {BUILD_TIMEOUT_S} s") from None
        running.remove(link)
        check(link)
    finally:
        for proc in running:  # a failure or the deadline: no compiler outlives the build
            proc.kill()
            proc.wait()


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
        objects = folder / f".cpu_kernels-{key}-{os.getpid()}.o"
        try:
            _compile(cc, objects, tmp)
            os.replace(tmp, lib)  # atomic: a concurrent rank sees the whole file or none
            return lib
        finally:
            shutil.rmtree(objects, ignore_errors=True)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
    raise RuntimeError(f"no writable cache folder ({root}, or a private one in the temp folder)")


def _open(path: Path) -> tuple[ctypes.CDLL, frozenset[str], str]:
    """Load the library and declare the functions it exports (a build leaves out the kernels with
    no path for its target); return it, their names and its ``tpe_isa()``. Raises OSError,
    AttributeError (no ``tpe_isa``: not a library of these sources)."""
    lib = ctypes.CDLL(str(path))
    lib.tpe_isa.restype, lib.tpe_isa.argtypes = ctypes.c_char_p, []
    have = frozenset(name for name in SIGNATURES if hasattr(lib, name))
    for name in have:
        fn = getattr(lib, name)
        fn.argtypes = SIGNATURES[name]
        fn.restype = _I64 if name in RETURNS_INDEX else _I32 if name in ("tpe_paged_amx", "tpe_blocked_amx") else None
    return lib, have, lib.tpe_isa().decode()


def load() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use (and once more if a cached build does
    not load, e.g. a truncated file); None when unavailable (see :func:`unavailable_reason`, also
    printed once to stderr, with the rank under torchrun). Never raises. Call it before the first
    step, so the build is not timed as part of one."""
    global _lib, _reason, _have, _isa
    if _lib is None and _reason is None:
        try:
            try:
                lib, have, name = _open(_build())
            except OSError:
                lib, have, name = _open(_build(rebuild=True))
            _lib, _have, _isa = lib, have, name
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


def isa() -> str | None:
    """The vector path the loaded library was built with (C ``tpe_isa()``): "avx512bf16" (or
    "avx512bf16+amx": the paged kernel's AMX tiles compiled in, used only where the CPU and OS
    allow), "avx2" (AVX2 + FMA), or "generic" (portable C only); None when :func:`load` gives None.
    Never raises."""
    return _isa if load() is not None else None


def has(*names: str) -> bool:
    """Whether the library loads and exports every named C function (e.g. ``"tpe_gemv_bf16"``, a key
    of :data:`SIGNATURES`): a kernel with no path for the build's target (:func:`isa`) is left out,
    and its callers keep their torch ops. Never raises."""
    return load() is not None and all(n in _have for n in names)


def missing(*names: str) -> str | None:
    """None when :func:`has` the named C functions, else why not (a skip reason, an error's text):
    the library is unavailable and why, or which of them this build (:func:`isa`) left out.
    Never raises."""
    if load() is None:
        return f"needs the CPU C kernels: {_reason}"
    absent = [n for n in names if n not in _have]
    return f"this build ({_isa}) has no {', '.join(absent)}: no path for its target" if absent else None


def usable(*tensors: torch.Tensor, float32: bool = False, kernels: tuple[str, ...] = ()) -> bool:
    """Whether the C kernels may take these tensors: all bfloat16 (or, with ``float32``, all
    float32) on CPU, the library loads and exports every function in ``kernels`` (:func:`has`).
    (Whether to use them at all is the caller's ``cpu_kernels`` flag, from
    ``EngineConfig.cpu_kernels``.)"""
    dtype = tensors[0].dtype if tensors else torch.bfloat16
    ok = dtype == torch.bfloat16 or (float32 and dtype == torch.float32)
    return ok and all(t.dtype == dtype and t.is_cpu for t in tensors) and has(*kernels)
