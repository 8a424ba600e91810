"""Building and loading the CPU C kernels (tpengine/backends/cpu/cpu_library.py): an x86-64 CPU and a
C compiler must get them (so the kernel tests cannot skip silently where they should run), built
for the vector path the compiler targets (AVX512-BF16, AVX2 + FMA, or portable C; ``TPENGINE_ISA``),
and a failing compiler leaves one clear line and the torch ops, never an error."""

import os
import platform
import shutil
import subprocess
import sys

import pytest

from tpengine.backends.cpu import cpu_library

PROBE = ("from tpengine.backends.cpu import cpu_library; lib = cpu_library.load(); "
         "print('loaded' if lib is not None else 'unavailable')")


def probe(tmp_path, **env):
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "TPENGINE_CACHE_DIR": str(tmp_path), **env})


def compiler_macros() -> str:
    """The target macros of the compiler load() builds with ($CC, else cc or gcc) under the build's
    -march (``$TPENGINE_ISA``): "" when it cannot say."""
    try:
        cc = cpu_library._compiler()
        res = subprocess.run([*cc, cpu_library.march(), "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True,
                             text=True, timeout=60)
    except (RuntimeError, OSError, subprocess.SubprocessError):
        return ""
    return res.stdout if res.returncode == 0 else ""


def expected_isa(macros: str) -> str:
    """What tpe_isa() names for these macros (csrc/bf16.h, cpu_decode.c)."""
    has = lambda m: f"#define {m} " in macros  # noqa: E731
    if has("__AVX512BF16__") and has("__AVX512F__"):
        return "avx512bf16+amx" if has("__AMX_TILE__") and has("__AMX_BF16__") else "avx512bf16"
    return "avx2" if has("__AVX2__") and has("__FMA__") else "generic"


supported = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64")
                               or not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
                               reason="needs an x86-64 CPU and a C compiler")


@supported
def test_isa_names_the_path_built():
    """isa() is the path the compiler's target macros select, every kernel with an AVX2 path is in an
    AVX2 build, and the AVX-512-only ones are in an AVX-512 build only (their callers keep torch)."""
    assert cpu_library.isa() == expected_isa(compiler_macros()), cpu_library.unavailable_reason()
    vector = ("tpe_add_rms_norm", "tpe_add_rms_norm_f32", "tpe_rope", "tpe_silu_mul", "tpe_silu_mul_f32",
              "tpe_gelu_tanh_mul", "tpe_gelu_tanh_mul_f32",
              "tpe_causal_softmax", "tpe_gemv_bf16", "tpe_gemv_f32", "tpe_shm_all_reduce",
              "tpe_shm_all_reduce_add_rms_norm", "tpe_qgemv_int8", "tpe_qgemv_int4", "tpe_dequant_int4",
              "tpe_int4_rows", "tpe_paged_decode_f32", "tpe_paged_decode_bf16", "tpe_gemm_f32")
    portable = ("tpe_copy_rows", "tpe_row_argmax_f32", "tpe_row_argmax_bf16", "tpe_col_argmax_f32",
                "tpe_col_argmax_bf16")
    avx512 = ("tpe_paged_amx", "tpe_decode_scores", "tpe_decode_pv")
    assert cpu_library.has(*portable)
    assert cpu_library.has(*vector) == (cpu_library.isa() != "generic")
    assert cpu_library.has(*avx512) == cpu_library.isa().startswith("avx512")
    if not cpu_library.has(*avx512):
        assert cpu_library.missing("tpe_decode_pv") == (f"this build ({cpu_library.isa()}) has no tpe_decode_pv: "
                                                        "no path for its target")


def test_isa_setting_is_part_of_the_build_key(monkeypatch):
    monkeypatch.delenv("TPENGINE_ISA", raising=False)
    native = cpu_library.build_key(["gcc"])
    assert cpu_library.flags() == ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
    monkeypatch.setenv("TPENGINE_ISA", "AVX2")
    assert cpu_library.march() == "-march=x86-64-v3" and cpu_library.build_key(["gcc"]) != native
    monkeypatch.setenv("TPENGINE_ISA", "native")
    assert cpu_library.build_key(["gcc"]) == native


def test_unknown_isa_falls_back_with_one_line(tmp_path):
    res = probe(tmp_path, TPENGINE_ISA="avx9")
    assert res.returncode == 0 and res.stdout.strip() == "unavailable"
    assert res.stderr == ("tpengine: CPU C kernels unavailable, using torch ops: TPENGINE_ISA='avx9': expected one "
                          "of native, avx2\n")


@supported
def test_builds_and_loads_where_supported(tmp_path):
    assert cpu_library.load() is not None, cpu_library.unavailable_reason()
    res = probe(tmp_path)  # a fresh process and an empty cache folder: compiles, then loads
    assert res.stdout.strip() == "loaded", res.stderr
    assert [p.name.startswith("cpu_kernels-") and p.suffix == ".so" for p in tmp_path.iterdir()] == [True]
    # the library's name carries its build key, which the cached timings' keys use
    assert cpu_library.library_key() == cpu_library.build_key() and len(cpu_library.build_key()) == 16
    assert cpu_library.build_key(["gcc", "-O2"]) != cpu_library.build_key(["gcc"])


def test_failing_compiler_falls_back_with_one_line(tmp_path):
    res = probe(tmp_path, CC="/bin/false")
    assert res.returncode == 0 and res.stdout.strip() == "unavailable"
    assert res.stderr == "tpengine: CPU C kernels unavailable, using torch ops: /bin/false failed (exit 1): \n"
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind


@supported
def test_compiler_with_flags_and_a_corrupt_cached_build(tmp_path, monkeypatch):
    """``CC`` may carry flags; a cached library that does not load (truncated) is rebuilt once. One
    build: the truncated library is written where a ``CC="gcc -O2"`` build goes (its name holds that
    compiler's build key; the probe's environment sets no ``TPENGINE_ISA``), so the rebuild is the
    build with flags (an empty cache's first build: test_builds_and_loads_where_supported)."""
    monkeypatch.delenv("TPENGINE_ISA", raising=False)
    lib = tmp_path / f"cpu_kernels-{cpu_library.build_key(['gcc', '-O2'])}.so"
    lib.write_bytes(b"")
    res = probe(tmp_path, CC="gcc -O2")
    assert res.stdout.strip() == "loaded" and res.stderr == ""
    assert list(tmp_path.iterdir()) == [lib] and lib.stat().st_size > 0  # rebuilt in place, not beside it


@supported
def test_unusable_cache_folder_falls_back_to_a_private_temp_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    (tmp_path / "tmp").mkdir()
    res = probe(tmp_path, TPENGINE_CACHE_DIR=str(blocker / "cache"), TMPDIR=str(tmp_path / "tmp"))
    assert res.stdout.strip() == "loaded", res.stderr
    (private,) = (tmp_path / "tmp").iterdir()
    assert private.stat().st_mode & 0o777 == 0o700 and len(list(private.glob("cpu_kernels-*.so"))) == 1
