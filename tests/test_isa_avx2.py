"""The C kernels' AVX2 + FMA build, on a machine that would build another (issue 35): the kernel
checks of the other test files, run again in a fresh process under ``TPENGINE_ISA=avx2`` (the
library built with ``-march=x86-64-v3``), so a CI run on an AVX-512 machine covers both paths. The
files run are the kernel-level ones (the fused ops, argmax, GEMV, GEMM, the bfloat16 and float32 blocked layouts,
int8 and int4 GEMV, the int4 x int8 and int8 x int8 GEMVs (maddubs), int4 dequantization -- on torch's packed layout
here and on its AVX2 one, 32-row blocks, which an AVX2 CPU's torch packs --, paged decode attention, the
shared-memory all-reduce); kernels the AVX2 build leaves out skip there with that reason.
Skipped where the CPU cannot run AVX2 + FMA code, there is no C compiler, or this run is itself the
AVX2 build (``TPENGINE_ISA=avx2``, or a CPU without AVX-512, whose native build is the AVX2 path)."""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: the kernel checks re-run under the AVX2 build (the engine-level tests and the shared-memory all-reduce's
#: late-peer cases stay with the main run: they test no arithmetic)
CHECKS = ("tests/test_cpu_fused.py", "tests/test_cpu_library.py::test_isa_names_the_path_built",
          "tests/test_shm.py::test_all_reduce_equals_torch_sums[3--1-10000000]",
          "tests/test_linear_layout.py::test_measure_times_every_path_at_every_bucket",
          "tests/test_linear_layout.py::test_gemv_equals_float32_matmul_rounded_once",
          "tests/test_linear_layout.py::test_float32_gemv_equals_matmul", "tests/test_cpu_gemv.py",
          "tests/test_cpu_blocked.py::test_float32_blocked_gemm_is_the_product_up_to_the_sum_order",
          "tests/test_cpu_blocked.py::test_blocked_gemm_is_the_float32_product_rounded_once",
          "tests/test_cpu_blocked.py::test_rows_gathered_from_the_blocked_layout_are_the_plain_rows",
          "tests/test_cpu_blocked.py::test_blocked_refusals_name_the_value",
          "tests/test_cpu_blocked.py::test_amx_rows_setting_without_amx",
          "tests/test_linear_layout.py::test_float32_gemm_equals_matmul_and_each_row_is_batch_independent",
          "tests/test_cpu_gemm_blocked.py",
          "tests/test_linear_layout.py::test_bfloat16_gemm_is_the_float32_gemm_of_the_widened_operands_rounded_once",
          "tests/test_cpu_qgemv.py::test_few_rows_equal_the_dequantized_product",
          "tests/test_cpu_qgemv.py::test_int4_dequantize_is_the_stored_weight_transposed",
          "tests/test_cpu_qgemv.py::test_int4_kernels_read_the_other_layout",
          "tests/test_cpu_qgemv.py::test_int4_rows_are_the_torch_lookup_bit_for_bit",
          "tests/test_cpu_qgemv.py::test_int4_q8_is_the_product_of_the_int8_activations",
          "tests/test_cpu_qgemv.py::test_int4_q8_is_the_same_at_every_thread_count",
          "tests/test_cpu_qgemv.py::test_int8_q8_is_the_integer_product_of_the_int8_activations",
          "tests/test_cpu_paged.py::test_paged_decode_equals_rope_store_and_reference_attention",
          "tests/test_cpu_paged.py::test_paged_decode_bad_indices_raise_before_anything_is_written",
          "tests/test_cpu_paged.py::test_paged_decode_with_window_and_soft_cap_equals_the_reference",
          "tests/test_cpu_paged.py::test_work_items_of_whole_sequences_or_of_kv_heads_give_the_same_bits",
          "tests/test_kv_int8.py::test_paged_decode_over_int8_equals_the_reference_on_the_dequantized_cache",
          "tests/test_kv_int8.py::test_int8_pv_sums_stay_exact_past_the_int32_windows_and_split_spans_merge",
          "tests/test_sampler.py::test_row_max_equals_torch_max_with_ties_infinities_and_nan",
          "tests/test_sampler.py::test_col_max_equals_torch_max_over_rows_with_ties_infinities_and_nan")


def cpu_runs_avx2() -> bool:
    try:
        flags = set(" ".join(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                             if line.startswith("flags")).split())
    except OSError:
        return False
    return {"avx2", "fma", "f16c", "bmi2"} <= flags  # (x86-64-v3's vector part)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not cpu_runs_avx2(),
                    reason="the AVX2 build needs an x86-64 CPU with AVX2 + FMA")
@pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
@pytest.mark.skipif(os.environ.get("TPENGINE_ISA", "").lower() == "avx2", reason="this run is the AVX2 build")
def test_kernel_checks_pass_on_the_avx2_build(tmp_path):
    from tpengine.backends.cpu import cpu_library

    if cpu_library.isa() == "avx2":  # a CPU without AVX-512 (Zen 3): the whole run already checks these kernels
        pytest.skip("this run's own build is the AVX2 path (the CPU has no AVX-512): its kernel checks ran natively")
    env = {**os.environ, "TPENGINE_ISA": "avx2", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("PYTEST_ADDOPTS", None)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not per_engine",
                          *CHECKS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = res.stdout[-4000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    assert " passed" in res.stdout and " failed" not in res.stdout, tail


def test_tpengine_isa_caps_torch_too():
    """``TPENGINE_ISA=avx2`` caps torch as well as the kernels (issue 35, item 7): ``isa_env`` adds the three
    variables torch reads, keeps any the environment sets, adds nothing for "native" or without it; and a
    process that imports tpengine before torch runs torch's AVX2 kernels (its capability), which the
    benchmarks' machine line names."""
    from tpengine import TORCH_ISA_CAPS, isa_env

    caps = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert TORCH_ISA_CAPS == {"avx2": caps}
    assert isa_env({"TPENGINE_ISA": " AVX2 ", "X": "1"}) == {"TPENGINE_ISA": " AVX2 ", "X": "1", **caps}
    assert isa_env({"TPENGINE_ISA": "avx2", "ATEN_CPU_CAPABILITY": "default"})["ATEN_CPU_CAPABILITY"] == "default"
    assert isa_env({"TPENGINE_ISA": "native"}) == {"TPENGINE_ISA": "native"} and isa_env({}) == {}
    if platform.machine() not in ("x86_64", "AMD64") or not cpu_runs_avx2():
        return
    env = {k: v for k, v in os.environ.items() if k not in caps}
    env.update(TPENGINE_ISA="avx2", PYTHONPATH=str(ROOT))
    code = ("import tpengine, torch; from benchmarks.machine import machine_info, machine_line; "
            "print(torch.backends.cpu.get_cpu_capability()); print(machine_line(machine_info()))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    capability, line = res.stdout.splitlines()
    assert capability == "AVX2"
    assert line.endswith(", run as avx2 (TPENGINE_ISA; torch capability AVX2)"), line
