"""The one way a test launches a process: the repository root, the launched processes' environment and
the command line for a module or a worker script at one or several ranks (``torchrun --standalone``).

Every test that starts ``tpengine.run``, ``tpengine.serve`` or a ``tests/workers`` script builds its
command here (:func:`command`), runs it with :func:`run` (waits) or :func:`popen` (in the background),
so the environment, the working directory and the timeouts are the same everywhere. The timeouts are
bounds against a hang, sized for a loaded machine (a second copy of the suite beside this one on two
cores), not expectations of speed.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import forkserver

# Without a GPU, Triton kernels run only under the interpreter, which must be switched on before
# anything imports triton (transformers may); set once for the whole session, before anything else
# (conftest imports this module first) and so in every launched process's environment.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
TORCHRUN = str(Path(PY).parent / "torchrun")
WORKERS = REPO / "tests" / "workers"

#: What every launched process gets on top of the test's environment as it is at the launch (so a
#: ``monkeypatch.setenv`` and conftest's ``TRITON_INTERPRET`` reach it): the hub offline (the tests never
#: download) and no tokenizer thread pool (its fork warning and its threads).
ENV_EXTRA = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
#: :data:`ENV_EXTRA` for the CLI job and server (:func:`cli`, the background launches): one OpenMP thread
#: per rank, as torchrun itself sets for several ranks, also at tp=1.
CLI_EXTRA = {**ENV_EXTRA, "OMP_NUM_THREADS": "1"}
#: The environment as the session started (before any test's ``monkeypatch``): the fork server's.
SESSION_ENV = {**os.environ}
#: The fork server (:mod:`forkserver`): its process and socket, started at the first launch that uses
#: it; ``TPENGINE_TEST_FORKSERVER=off`` makes every launch real.
_FORKSERVER: dict[str, object] = {}
#: The bound (seconds) on the fork server's imports; past it, launches are real.
FORKSERVER_START_TIMEOUT = 120


def environment(cli: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a launched process now: ``os.environ`` with :data:`ENV_EXTRA` (:data:`CLI_EXTRA`
    with ``cli``) and ``extra``."""
    return {**os.environ, **(CLI_EXTRA if cli else ENV_EXTRA), **extra}


#: The environment of a launch whose test checks what the engine does, not what it measured: a measuring
#: budget of 0 s (:func:`tpengine.backends.cpu.measured.measure_budget_s`), so each choice without cached
#: timings takes its default (the layouts packed where oneDNN packs the dtype, the quantized weights on
#: tpengine's kernels), the same at every load. conftest makes it the session's default (every launch and
#: in-process engine); a launch may still name it to say that its comparison depends on it. Measuring
#: instead costs a cold cache tens of seconds for SmolLM2's shapes, and again at every load where the two
#: passes disagree (a noisy choice is never cached).
NO_MEASURING = {"TPENGINE_MEASURE_BUDGET_S": "0"}
#: The environment of a launch (or a job's own ``"env"``) whose subject is a measured choice: no measuring
#: budget, every choice without cached timings measured (conftest's ``measuring`` fixture sets it for a
#: test and what it launches): the choosers' tests (test_measured, test_linear_layout, test_cpu_qgemv,
#: test_sampler, test_cpu_paged, ...) and test_engine's measured SmolLM2 jobs, each checked against HF.
MEASURING = {"TPENGINE_MEASURE_BUDGET_S": "inf"}


#: The bound (seconds) on a launched job that loads a model and runs its requests: test_engine's launches
#: run a dozen engines each, and on a busy machine every load measures its choices again.
JOB_TIMEOUT = 1200
#: The bound (seconds) on a background job's or server's start: torchrun, each rank's imports, the load,
#: the first records or the first ``/health`` answer.
START_TIMEOUT = 300


def forkserver_running() -> bool:
    """Start the fork server once a session (waits for its imports); whether it runs. Stopped when
    the session ends (and by itself when this process does)."""
    if os.environ.get(forkserver.SOCKET_ENV) == "off" or SESSION_ENV.get(forkserver.SOCKET_ENV) == "off":
        return False
    if "proc" not in _FORKSERVER:
        folder = tempfile.mkdtemp(prefix="tpengine-forkserver-")
        path = os.path.join(folder, "socket")
        env = {k: v for k, v in {**SESSION_ENV, **ENV_EXTRA}.items() if k not in forkserver.RUNTIME_KEYS}
        log = open(os.path.join(folder, "log"), "w")
        proc = subprocess.Popen([PY, str(Path(forkserver.__file__)), "serve", path], cwd=REPO, env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        _FORKSERVER.update(proc=proc, path=path, folder=folder)
        atexit.register(_stop_forkserver)
        deadline = time.monotonic() + FORKSERVER_START_TIMEOUT
        while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.path.exists(path):
            os.environ[forkserver.SOCKET_ENV] = path
    return forkserver.SOCKET_ENV in os.environ and _FORKSERVER["proc"].poll() is None


def _stop_forkserver() -> None:
    proc = _FORKSERVER.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    if not os.environ.get("TPENGINE_TEST_FORKSERVER_KEEP"):
        shutil.rmtree(_FORKSERVER.get("folder", ""), ignore_errors=True)


def command(target: str | Path, args=(), nproc: int = 1, torchrun: bool | None = None,
            real: bool = False) -> list[str]:
    """The command line of ``target`` with ``args`` (each turned into a string).

    ``target``: a module (``"tpengine.run"``) or a script's path (a worker: :data:`WORKERS`). At
    ``nproc`` 1 a module runs as ``python -m`` and a script under ``torchrun`` (the workers read
    torchrun's ``RANK``); ``torchrun`` forces one or the other. Several ranks always run under
    ``torchrun --standalone --nproc_per_node nproc``. The command starts through the fork server
    (:mod:`forkserver`: the same code, forked from a process that imported it once) unless ``real``:
    tests of the launcher itself (killed launchers or ranks, torchrun's report) need torchrun.

    Raises:
        ValueError: ``nproc`` below 1, or several ranks without torchrun.
    """
    is_script = isinstance(target, Path) or str(target).endswith(".py")
    if torchrun is None:
        torchrun = nproc > 1 or is_script
    if nproc < 1 or (nproc > 1 and not torchrun):
        raise ValueError(f"command: nproc={nproc} with torchrun={torchrun}; valid: nproc >= 1, torchrun for nproc > 1")
    what = [str(target)] if is_script else ["-m", str(target)]
    head = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}"] if torchrun else [PY]
    cmd = [*head, *what, *map(str, args)]
    return cmd if real else forked(cmd)


def forked(cmd: list[str]) -> list[str]:
    """``cmd`` (``python -m MOD ...`` or ``torchrun --standalone --nproc_per_node=N ...``, or a prefix
    of one, its arguments to follow) started through the fork server: :mod:`forkserver`'s client
    (``cmd`` itself where the server does not run)."""
    if not forkserver_running():
        return cmd
    return [PY, str(Path(forkserver.__file__)), "client", "--", *cmd]


def node_command(target: str | Path, args, node_rank: int, port: int, nnodes: int = 2) -> list[str]:
    """:func:`command` for node ``node_rank`` of ``nnodes`` single-rank torchrun nodes meeting at
    ``127.0.0.1:port`` (a multi-node job on one machine)."""
    what = [str(target)] if isinstance(target, Path) or str(target).endswith(".py") else ["-m", str(target)]
    return [TORCHRUN, f"--nnodes={nnodes}", "--nproc_per_node=1", f"--node_rank={node_rank}",
            "--master_addr=127.0.0.1", f"--master_port={port}", *what, *map(str, args)]


def run(cmd: list[str], timeout: float = JOB_TIMEOUT, env: dict | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` from :data:`REPO` with :func:`environment` updated by ``env``, output captured as text;
    with ``check`` assert exit 0 (the message: the end of stderr)."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                       env={**environment(), **(env or {})})
    if check:
        assert r.returncode == 0, r.stderr[-6000:]
    return r


def popen(cmd: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
    """Start ``cmd`` in the background from :data:`REPO` with the environment ``env`` (default
    ``environment(cli=True)``; ``kwargs``: Popen's, e.g. ``stdout``, ``stderr``)."""
    return subprocess.Popen(cmd, cwd=REPO, env=environment(cli=True) if env is None else env, **kwargs)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a server or a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(args, tp: int = 1, timeout: float = JOB_TIMEOUT, check: bool = True,
        real: bool = False) -> subprocess.CompletedProcess:
    """The main job ``tpengine.run`` with ``args`` at ``tp`` ranks (``python -m`` at 1) and :data:`CLI_EXTRA`
    (``real``: :func:`command`'s)."""
    return run(command("tpengine.run", args, tp, real=real), timeout=timeout, env=CLI_EXTRA, check=check)


def torchrun(script: str, nproc: int, args: list[str], timeout: float = JOB_TIMEOUT, env: dict | None = None,
             check: bool = True, real: bool = False) -> subprocess.CompletedProcess:
    """Run ``tests/workers/<script>`` under ``torchrun --standalone --nproc_per_node nproc`` (``real``:
    :func:`command`'s)."""
    return run(command(WORKERS / script, args, nproc, real=real), timeout=timeout, env=env, check=check)


def run_engine_jobs(tmp_path: Path, nproc: int, jobs: list[dict], tag: str = "", env: dict | None = None) -> dict:
    """Run LLMEngine jobs (see tests/workers/engine_generate.py) at ``nproc`` ranks; rank 0's results.
    ``env`` is added to the workers' environment (e.g. ``TRITON_INTERPRET``, :data:`NO_MEASURING`); a
    job's own ``"env"`` holds while that job runs."""
    jobs_file, out = tmp_path / f"engine-jobs{tag}-{nproc}.json", tmp_path / f"engine-out{tag}-{nproc}.json"
    jobs_file.write_text(json.dumps(jobs))
    torchrun("engine_generate.py", nproc, [str(out), str(jobs_file)], env=env)
    return json.loads(out.read_text())
