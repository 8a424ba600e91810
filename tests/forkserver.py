"""The suite's fork server: the tests' launches of ``tpengine.run``, ``tpengine.serve`` and the
``tests/workers`` scripts start as forks of one process that has imported torch, transformers and
tpengine once, instead of each rank importing them again (seconds per process, the bulk of a small
job's wall time; measured in docs/notes/test-suite.md).

What runs is unchanged: the same module or script, as ``__main__``, with the launch's argv, working
directory, environment and stdio; several ranks get torchrun's variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``,
``OMP_NUM_THREADS=1``), each in a session of its own, as ``torchrun --standalone`` starts them. Only the
process creation differs, so tests about the launcher itself (a killed launcher, a killed or stopped
rank, torchrun's own report) launch for real: :func:`launch.command`'s ``real``.

Three roles, one file (the client imports nothing heavy):

- ``python tests/forkserver.py serve PATH``: the server. Imports, then accepts requests on the Unix
  socket ``PATH``; ends when its parent (pytest) does.
- ``python tests/forkserver.py client -- CMD...``: what a test launches instead of ``CMD`` (a real
  subprocess with a pid, stdio, an exit code and signals). It hands its stdio and ``CMD`` to the
  server, which forks a launcher for it; the client forwards the signals it gets to the launcher and
  exits with the job's code (killed by the same signal where the job was). Where the server refuses
  (a command form it does not know, or an environment that differs from the server's in a variable
  read at import time, e.g. ``TPENGINE_ISA``, ``ATEN_CPU_CAPABILITY``, ``TRITON_INTERPRET``) or is not
  running, the client ``exec``s ``CMD`` itself.
- the launcher (a fork of the server): forks the ranks, forwards signals to them, ends the others
  when one fails (torchrun's rule, exit 1), reports the exit code, and kills the job when its client
  goes away (a test's timeout, a killed pytest).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys

#: The environment variable holding the server's socket path (set by conftest for the session);
#: ``off`` or unset: every launch is real.
SOCKET_ENV = "TPENGINE_TEST_FORKSERVER"
#: Variables read only at run time by the launched code, so a launch may differ from the server's
#: environment in them. Any other difference (a variable torch, triton, transformers or tpengine
#: may read while importing) makes the launch real.
RUNTIME_KEYS = frozenset({
    "PYTEST_CURRENT_TEST", "OMP_NUM_THREADS", "TPENGINE_CACHE_DIR", "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
    "LRU_CACHE_CAPACITY", "TOKENIZERS_PARALLELISM", "CC", "COLUMNS", "LINES", SOCKET_ENV,
    "TPENGINE_TEST_LAUNCHER", "TORCHINDUCTOR_CACHE_DIR",
    # read at each measurement (measured.measure_budget_s); conftest sets it after launch has taken the
    # session's environment, so without it here every launch differed and ran for real
    "TPENGINE_MEASURE_BUDGET_S",
})
#: Signals the client passes on to the job (the launcher passes them to every rank).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
#: What the server imports before it forks: everything a launched rank would import on its start.
PRELOAD = (
    "torch", "transformers", "transformers.models.llama.modeling_llama",
    "transformers.models.mistral.modeling_mistral", "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3", "tpengine.entrypoints.run", "tpengine.entrypoints.serve",
    "tpengine.entrypoints.setup", "tpengine.engine.llm_engine", "tpengine.server.app", "tpengine.structured",
    "tpengine.distributed",
)
#: How long a failed job's other ranks get after SIGTERM before SIGKILL (seconds).
TERM_GRACE_S = 10.0


# ---- wire: one length-prefixed JSON message each way, stdio fds with the request -------------------

def _send(sock: socket.socket, obj: dict, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(obj).encode()
    payload = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [payload], list(fds))
    else:
        sock.sendall(payload)


def _recv(sock: socket.socket, with_fds: bool = False) -> tuple[dict | None, list[int]]:
    """One message (None at EOF) and the fds that came with it."""
    fds: list[int] = []
    if with_fds:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
    else:
        data = sock.recv(4)
    if not data:
        return None, fds
    while len(data) < 4:
        more = sock.recv(4 - len(data))
        if not more:
            return None, fds
        data += more
    (n,) = struct.unpack("!I", data[:4])
    body = data[4:]
    while len(body) < n:
        more = sock.recv(n - len(body))
        if not more:
            return None, fds
        body += more
    return json.loads(body[:n]), fds


# ---- the client -----------------------------------------------------------------------------------

def client(cmd: list[str]) -> None:
    """Run ``cmd`` through the server (or exec it where the server refuses or is not there)."""
    path = os.environ.get(SOCKET_ENV, "")
    env = {**os.environ, "TPENGINE_TEST_LAUNCHER": str(os.getpid())}
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        _send(sock, {"cmd": cmd, "env": env, "cwd": os.getcwd()}, (0, 1, 2))
        reply, _ = _recv(sock)
    except OSError:
        reply = None
    if reply is None or "refused" in reply:
        os.execve(cmd[0], cmd, os.environ)
    launcher = reply["pid"]

    def forward(signum, _frame):
        try:
            os.kill(launcher, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    reply, _ = _recv(sock)
    if reply is None:
        print(f"forkserver: the launcher of {cmd} ended without an exit code", file=sys.stderr)
        sys.exit(1)
    code = reply["exit"]
    if code < 0:  # the job died of a signal: so does this process (Popen's returncode -N)
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# ---- the server -----------------------------------------------------------------------------------

def parse(cmd: list[str]) -> dict | None:
    """``{"nproc", "torchrun", "module" | "script", "args"}`` for the command forms of
    :func:`launch.command` (``PY -m MOD ARGS``, ``TORCHRUN --standalone --nproc_per_node=N (-m MOD |
    SCRIPT) ARGS``); None for any other."""
    if len(cmd) >= 3 and os.path.normpath(cmd[0]) == os.path.normpath(sys.executable) and cmd[1] == "-m":
        return {"nproc": 1, "torchrun": False, "module": cmd[2], "args": cmd[3:]}
    if len(cmd) >= 4 and os.path.basename(cmd[0]) == "torchrun" and cmd[1] == "--standalone" \
            and cmd[2].startswith("--nproc_per_node="):
        nproc, rest = int(cmd[2].split("=", 1)[1]), cmd[3:]
        if rest[0] == "-m" and len(rest) >= 2:
            return {"nproc": nproc, "torchrun": True, "module": rest[1], "args": rest[2:]}
        if rest[0].endswith(".py"):
            return {"nproc": nproc, "torchrun": True, "script": rest[0], "args": rest[1:]}
    return None


def differences(env: dict[str, str], base: dict[str, str]) -> list[str]:
    """The variables outside :data:`RUNTIME_KEYS` in which ``env`` and ``base`` differ. ``PYTHONPATH``
    may differ by folders whose modules the server already finds (the repository root, which the
    benchmarks add): a launch's own copy of tpengine elsewhere must import it for real."""
    differ = [k for k in set(env) | set(base) if k not in RUNTIME_KEYS and env.get(k) != base.get(k)]
    if "PYTHONPATH" in differ and all(os.path.abspath(p) in _known_paths() for p in _paths(env)):
        differ.remove("PYTHONPATH")
    return sorted(differ)


def _paths(env: dict[str, str]) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _known_paths() -> set[str]:
    return {os.path.abspath(p) for p in (os.getcwd(), *sys.path) if p}


def serve(path: str) -> None:
    """Import :data:`PRELOAD`, then fork a launcher per request until the parent process ends."""
    import gc
    import importlib

    base = dict(os.environ)  # the environment a launch must match (before the imports add to it)
    parent = os.getppid()
    gc.disable()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # an optional part missing: its launches import it themselves
            print(f"forkserver: preload {name}: {e}", file=sys.stderr)
    import torch

    added = {k: v for k, v in os.environ.items() if k not in base}  # what the imports set
    threads = torch.get_num_threads()
    gc.collect()
    gc.freeze()  # the imported objects stay shared with the forks (no copy-on-write of GC headers)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    srv.settimeout(1.0)
    print("forkserver: ready", file=sys.stderr, flush=True)
    while os.getppid() == parent:
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        fds: list[int] = []
        try:
            conn.settimeout(None)
            request, fds = _recv(conn, with_fds=True)
            job = parse(request["cmd"]) if request else None
            diff = differences(request["env"], base) if request else []
            if job is None or diff or len(fds) != 3:
                why = "command form" if job is None else "environment: " + ", ".join(diff) if diff else "stdio"
                _send(conn, {"refused": why})
                print(f"forkserver: real launch of {request and request['cmd'][:4]} ({why})", file=sys.stderr,
                      flush=True)
            else:
                job.update(env={**added, **request["env"]}, cwd=request["cwd"], threads=threads)
                middle = os.fork()
                if middle == 0:  # double fork: the launcher is nobody's zombie
                    srv.close()
                    if os.fork() == 0:
                        launcher(conn, fds, job)
                    os._exit(0)
                os.waitpid(middle, 0)
        except Exception as e:  # one bad request: its client gets EOF and launches for real
            print(f"forkserver: request failed: {e!r}", file=sys.stderr, flush=True)
        for fd in fds:
            os.close(fd)
        conn.close()
    srv.close()


def launcher(conn: socket.socket, fds: list[int], job: dict) -> None:
    """The job's launcher (never returns): fork its ranks, wait, report, as torchrun does."""
    try:
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        os.setpgid(0, 0)
        os.chdir(job["cwd"])
        _send(conn, {"pid": os.getpid()})
        ranks: dict[int, int] = {}  # pid -> rank
        pending: list[int] = []

        def forward(signum, _frame):
            pending.append(signum)

        for sig in FORWARDED:
            signal.signal(sig, forward)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        port = _free_port() if job["torchrun"] else 0
        run_id = f"forkserver-{os.getpid()}"
        for rank in range(job["nproc"]):
            pid = os.fork()
            if pid == 0:
                conn.close()
                run_rank(job, rank, port, run_id)
            ranks[pid] = rank
        record = ranks_file(job["env"]["TPENGINE_TEST_LAUNCHER"], os.path.dirname(job["env"][SOCKET_ENV]))
        with open(record + ".part", "w") as f:
            json.dump({rank: pid for pid, rank in ranks.items()}, f)
        os.replace(record + ".part", record)
        code = _wait(conn, ranks, pending, job)
        os.unlink(record)
        _send(conn, {"exit": code})
    except BaseException:  # the launcher's own fault: say so, never hang the client
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code if code >= 0 else 1)


def ranks_file(client: int | str, folder: str | None = None) -> str:
    """Where the launcher of ``client`` (the pid a test holds) records ``{rank: pid}`` while its job
    runs: a fork's ``/proc/PID/environ`` is the server's, so the ranks cannot be found by ``RANK``
    there. ``folder``: the server's (default: this process's :data:`SOCKET_ENV`'s)."""
    return os.path.join(folder or os.path.dirname(os.environ.get(SOCKET_ENV, "")), f"ranks-{client}.json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(conn: socket.socket, ranks: dict[int, int], pending: list[int], job: dict) -> int:
    """Wait for every rank; the job's exit code (a single process's own, signals negative; several
    ranks: 0, or 1 once one failed, the others then ended as torchrun ends them)."""
    import time

    codes: dict[int, int] = {}
    alive = dict(ranks)
    deadline = None
    while alive:
        while pending:
            sig = pending.pop(0)
            for pid in alive:
                _kill(pid, sig)
        readable, _, _ = select.select([conn], [], [], 0.05)
        if readable and not conn.recv(1):  # the client is gone: so is its job
            for pid in alive:
                _kill(pid, signal.SIGKILL)
            deadline = 0.0
        while alive:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            rank = alive.pop(pid, None)
            if rank is None:
                continue
            codes[rank] = os.waitstatus_to_exitcode(status)
            if codes[rank] != 0 and job["torchrun"] and deadline is None:
                print(f"forkserver: rank {rank} exited with {codes[rank]}; ending the others", file=sys.stderr,
                      flush=True)
                for other in alive:
                    _kill(other, signal.SIGTERM)
                deadline = time.monotonic() + TERM_GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            for pid in alive:
                _kill(pid, signal.SIGKILL)
    if not job["torchrun"]:
        return codes[0]
    return 0 if all(c == 0 for c in codes.values()) else 1


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def run_rank(job: dict, rank: int, port: int, run_id: str) -> None:
    """One rank (never returns): torchrun's environment, the module or script as ``__main__``, then
    the interpreter's own ending (threads joined, atexit handlers) and its exit code."""
    import atexit
    import runpy
    import threading

    import torch

    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    env = dict(job["env"])
    if job["torchrun"]:
        os.setsid()  # torchrun starts each worker in a session of its own
        n = job["nproc"]
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                   GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(n),
                   ROLE_NAME="default", MASTER_ADDR="localhost", MASTER_PORT=str(port),
                   TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
        if n > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]) if env.get("OMP_NUM_THREADS", "").isdigit()
                          else job["threads"])
    import gc

    gc.enable()
    code = 0
    try:
        script = job.get("script")
        sys.path[0] = job["cwd"] if script is None else os.path.dirname(os.path.abspath(script))
        sys.path[1:1] = [p for p in _paths(env) if p not in sys.path]  # as PYTHONPATH at a start
        if script is None:
            sys.modules.pop(job["module"], None)  # ``-m`` runs it as __main__ only (runpy's warning)
            sys.argv = ["-m", *job["args"]]
            runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *job["args"]]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    elif sys.argv[1:3] == ["client", "--"]:
        client(sys.argv[3:])
    else:
        sys.exit("usage: forkserver.py serve PATH | client -- CMD...")
