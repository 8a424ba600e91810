"""Benchmarks and evaluations of tpengine; not part of the installed package.

``TPENGINE_ISA=avx2`` runs every benchmark, its workers and Hugging Face's included, as the AVX2 + FMA
machine class (:data:`tpengine.TORCH_ISA_CAPS`).

Run from the repository root: ``python -m benchmarks.bench`` (``make bench``), ``python -m
benchmarks.humaneval`` (``make humaneval``), ``python -m benchmarks.bench_scale`` (``make
bench-scale``). Their worker subprocesses get the repository root on ``PYTHONPATH``
(:func:`subprocess_env`), so ``-m benchmarks.<worker>`` resolves from any working directory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tpengine import isa_env  # first: with TPENGINE_ISA it caps torch before any benchmark imports it

REPO_ROOT = Path(__file__).resolve().parent.parent


def subprocess_env(**extra: str) -> dict[str, str]:
    """``os.environ`` plus the repository root prepended to ``PYTHONPATH``, offline HF and
    ``TOKENIZERS_PARALLELISM=false``, and torch capped as ``TPENGINE_ISA`` says
    (:func:`tpengine.isa_env`: every worker, HF's included, runs as the same machine class), no
    measuring budget (``TPENGINE_MEASURE_BUDGET_S=inf`` unless the environment sets one: a benchmark's
    workers run long enough to earn every measurement back; :mod:`benchmarks.startup` passes the
    user's default), updated by ``extra``: the environment of every worker."""
    path = os.environ.get("PYTHONPATH", "")
    env = {**isa_env(), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TPENGINE_MEASURE_BUDGET_S": os.environ.get("TPENGINE_MEASURE_BUDGET_S", "inf"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), path) if p)}
    env.update(extra)
    return env


def launcher(tp: int, module: str) -> list[str]:
    """The command prefix every benchmark starts a worker, job or server with: ``python -m module`` at
    ``tp`` 1, ``torchrun --standalone --nproc_per_node tp -m module`` above (its arguments follow)."""
    if tp == 1:
        return [sys.executable, "-m", module]
    return [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={tp}", "-m", module]


def emit(console, table, result: dict, out: Path | None) -> None:
    """Print ``table`` (a rich renderable) on ``console`` and, with ``out``, write ``result`` there
    as JSON (saying so)."""
    console.print(table)
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {out}")
