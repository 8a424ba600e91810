"""Building and loading the CPU C kernels (tpengine/backends/cpu/cpu_library.py): a CPU with AVX512-BF16
and a C compiler must get them (so the kernel tests cannot skip silently where they should run),
and a failing compiler leaves one clear line and the torch ops, never an error."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tpengine.backends.cpu import cpu_library

PROBE = ("from tpengine.backends.cpu import cpu_library; lib = cpu_library.load(); "
         "print('loaded' if lib is not None else 'unavailable')")


def has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def probe(tmp_path, **env):
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "TPENGINE_CACHE_DIR": str(tmp_path), **env})


def compiler_targets_avx512_bf16() -> bool:
    """Whether the compiler load() builds with ($CC, else cc or gcc) defines __AVX512BF16__ under
    -march=native: False for a compiler too old for it, or one told -mno-avx512bf16 (docs/notes/avx2.md
    runs the suite so, as an AVX2-only machine)."""
    try:
        cc = cpu_library._compiler()
        res = subprocess.run([*cc, "-march=native", "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True,
                             text=True, timeout=60)
    except (RuntimeError, OSError, subprocess.SubprocessError):
        return False
    return res.returncode == 0 and "__AVX512BF16__" in res.stdout


supported = pytest.mark.skipif(not has_avx512_bf16() or not (shutil.which("cc") or shutil.which("gcc"))
                               or not compiler_targets_avx512_bf16(),
                               reason="needs a CPU with AVX512-BF16 and a C compiler that targets it")


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
def test_compiler_with_flags_and_a_corrupt_cached_build(tmp_path):
    """``CC`` may carry flags; a cached library that does not load (truncated) is rebuilt once."""
    assert probe(tmp_path, CC="gcc -O2").stdout.strip() == "loaded"
    (lib,) = tmp_path.iterdir()
    lib.write_bytes(b"")
    res = probe(tmp_path, CC="gcc -O2")
    assert res.stdout.strip() == "loaded" and res.stderr == ""
    assert lib.stat().st_size > 0


@supported
def test_unusable_cache_folder_falls_back_to_a_private_temp_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    (tmp_path / "tmp").mkdir()
    res = probe(tmp_path, TPENGINE_CACHE_DIR=str(blocker / "cache"), TMPDIR=str(tmp_path / "tmp"))
    assert res.stdout.strip() == "loaded", res.stderr
    (private,) = (tmp_path / "tmp").iterdir()
    assert private.stat().st_mode & 0o777 == 0o700 and len(list(private.glob("cpu_kernels-*.so"))) == 1
