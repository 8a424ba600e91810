"""Launch a worker script under torchrun (gloo, CPU) from a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def torchrun(script: str, nproc: int, args: list[str], timeout: float = 600, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run ``tests/workers/<script>`` with ``torchrun --standalone --nproc_per_node nproc``."""
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(REPO / "tests" / "workers" / script), *args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env)
    if check:
        assert r.returncode == 0, r.stderr[-6000:]
    return r


def run_engine_jobs(tmp_path: Path, nproc: int, jobs: list[dict], tag: str = "", env: dict | None = None) -> dict:
    """Run LLMEngine jobs (see tests/workers/engine_generate.py) at ``nproc`` ranks; rank 0's results.
    ``env`` is added to the workers' environment (e.g. ``TRITON_INTERPRET``)."""
    jobs_file, out = tmp_path / f"engine-jobs{tag}-{nproc}.json", tmp_path / f"engine-out{tag}-{nproc}.json"
    jobs_file.write_text(json.dumps(jobs))
    torchrun("engine_generate.py", nproc, [str(out), str(jobs_file)], env=env)
    return json.loads(out.read_text())
