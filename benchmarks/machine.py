"""What machine a benchmark ran on: CPU model, the instruction-set flags that pick tpengine's CPU
paths, cores, memory, library versions (for every benchmark's JSON and caption)."""

from __future__ import annotations

import os
import platform

import torch

#: The /proc/cpuinfo flags the CPU paths depend on -> the name printed for them: AMX (bfloat16
#: tiles: oneDNN's bfloat16 GEMMs), AVX512-BF16 (tpengine's C kernels), AVX-512 (foundation).
CPU_FLAGS = {"amx_tile": "AMX", "avx512_bf16": "AVX512-BF16", "avx512f": "AVX-512"}


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask), else ``os.cpu_count()``."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def read_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str | None, set[str]]:
    """``(model name, flags)`` of the first processor in ``path`` (Linux's cpuinfo format:
    ``model name : ...`` and ``flags : a b c``); ``(None, set())`` when it cannot be read."""
    model, flags = None, set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model is not None and flags:
                    break
    except OSError:
        pass
    return model, flags


def cpu_flags(flags: set[str]) -> dict[str, bool]:
    """``{name: present}`` for each of :data:`CPU_FLAGS` (e.g. ``{"AMX": True, "AVX512-BF16": True,
    "AVX-512": True}``)."""
    return {name: flag in flags for flag, name in CPU_FLAGS.items()}


def flags_text(present: dict[str, bool]) -> str:
    """``"AMX yes, AVX512-BF16 yes, AVX-512 yes"`` (or ``no``) of a :func:`cpu_flags` dict."""
    return ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in present.items())


def machine_info() -> dict:
    """CPU model, its :func:`cpu_flags`, cores, memory (GiB) and library versions, for the record."""
    import transformers

    model, flags = read_cpuinfo()
    mem = None
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return {"cpu": model or platform.processor() or platform.machine(), "cpu_flags": cpu_flags(flags),
            "cores": cpu_cores(), "memory_gib": mem, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa": isa if (isa := os.environ.get("TPENGINE_ISA", "").strip().lower()) not in ("", "native") else None,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def machine_line(info: dict) -> str:
    """One line naming the machine of :func:`machine_info`: CPU model, flags, cores, torch (and, when
    ``TPENGINE_ISA`` ran it as another class, that: the kernels' ISA and torch's capability)."""
    flags = flags_text(info["cpu_flags"]) if "cpu_flags" in info else "flags unknown"
    line = f"{info['cpu']} ({flags}), {info['cores']} cores, torch {info['torch']}"
    if info.get("isa"):
        line += f", run as {info['isa']} (TPENGINE_ISA; torch capability {info.get('cpu_capability')})"
    return line


if __name__ == "__main__":  # python -m benchmarks.machine: the line (make bench prints it first)
    print(f"machine: {machine_line(machine_info())}")
