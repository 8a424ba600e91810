"""Building and loading the CPU C kernels (tpengine/kernels/cpu_native.py): a CPU with AVX512-BF16
and a C compiler must get them (so the kernel tests cannot skip silently where they should run),
and a failing compiler leaves one clear line and the torch ops, never an error."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tpengine.kernels import cpu_native

PROBE = ("from tpengine.kernels import cpu_native; lib = cpu_native.load(); "
         "print('loaded' if lib is not None else 'unavailable')")


def has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def probe(tmp_path, **env):
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "TPENGINE_CACHE_DIR": str(tmp_path), **env})


@pytest.mark.skipif(not has_avx512_bf16() or not (shutil.which("cc") or shutil.which("gcc")),
                    reason="needs a CPU with AVX512-BF16 and a C compiler")
def test_builds_and_loads_where_supported(tmp_path):
    assert cpu_native.load() is not None, cpu_native.unavailable_reason()
    res = probe(tmp_path)  # a fresh process and an empty cache folder: compiles, then loads
    assert res.stdout.strip() == "loaded", res.stderr
    assert [p.name.startswith("cpu_kernels-") and p.suffix == ".so" for p in tmp_path.iterdir()] == [True]


def test_failing_compiler_falls_back_with_one_line(tmp_path):
    res = probe(tmp_path, CC="/bin/false")
    assert res.returncode == 0 and res.stdout.strip() == "unavailable"
    assert res.stderr == "tpengine: CPU C kernels unavailable, using torch ops: /bin/false failed: \n"
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind
