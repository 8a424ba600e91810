"""Hang forensics: each rank's ring of its last steps, and the report it writes when a collective
fails or times out, or on ``kill -USR1``.

Every rank keeps a small ring (:data:`RING`) of its last :data:`RING_SIZE` steps (step number,
kind, tokens, sequences, when it started) and the collective it is in right now (name, since
when): :func:`step` is called as each step plan arrives, :func:`enter` / :func:`leave` around
every collective (the control group's in :mod:`tpengine.distributed`, the activation
all-reduce / gather in :mod:`tpengine.comm` and the fused all-reduce + norm). ``leave`` is called
only when the collective returned, so after an exception the ring still names the collective it
came from.

A report (:func:`write_report`) is ``<cache>/forensics/<job id>/rank<k>.txt``: a header (rank,
pid, reason, the step and the collective), the ring, and every thread's Python stack
(``faulthandler``). ``<cache>`` is ``$TPENGINE_CACHE_DIR`` (default ``~/.cache/tpengine``); the job
id is torchrun's run id (the same on every rank), else ``pid<pid>``. When a rank fails inside a
collective, :func:`collective_failure` writes its report and, on rank 0, waits a little for the
other ranks' reports and names the ranks without one (those that did not arrive); every failing rank
ends those of them that are stopped on its host (:func:`end_local_ranks`: they would outlive the
job). ``kill -USR1``
writes the same report and the rank runs on (:func:`configure` installs the handler; it runs when
the rank's main thread next runs Python, at the latest when the collective it waits in returns or
times out). docs/notes/readme-details.md says how to read a report.

Nothing here imports torch, so it costs nothing to import; the per-collective bookkeeping is two
attribute writes and a clock read.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

RING_SIZE = 32
FAILED = "failed in a collective"  # the reason of a report written by collective_failure


@dataclass
class StepRecord:
    """One step as a rank saw it: ``step`` (rank 0's step counter), ``kind`` ("PREFILL", "DECODE",
    ...), ``tokens`` (N) and ``seqs`` (B) of its plan, ``started`` (wall clock, seconds)."""

    step: int
    kind: str
    tokens: int
    seqs: int
    started: float


class Ring:
    """This rank's last steps and the collective it is in (None: none)."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self.steps: deque[StepRecord] = deque(maxlen=size)
        self.current: str | None = None
        self.since = 0.0  # time.monotonic() when ``current`` was entered
        self.since_wall = 0.0  # the same instant, wall clock
        self.rank, self.world, self.timeout_s = 0, 1, 60.0
        self.job_id = os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{os.getpid()}"

    def last_step(self) -> StepRecord | None:
        return self.steps[-1] if self.steps else None


RING = Ring()


def step(number: int, kind: str, tokens: int, seqs: int) -> None:
    """A step plan arrived on this rank (every rank, every step)."""
    RING.steps.append(StepRecord(number, kind, tokens, seqs, time.time()))


def enter(name: str) -> str | None:
    """This rank enters collective ``name``; returns the one it was in (for :func:`leave`)."""
    prev = RING.current
    RING.current = name
    RING.since = time.monotonic()
    RING.since_wall = time.time()
    return prev


def leave(prev: str | None = None) -> None:
    """The collective returned: back to ``prev`` (what :func:`enter` returned)."""
    RING.current = prev


def cache_dir() -> Path:
    """tpengine's cache folder: ``$TPENGINE_CACHE_DIR``, default ``~/.cache/tpengine``."""
    return Path(os.environ.get("TPENGINE_CACHE_DIR") or Path.home() / ".cache" / "tpengine")


def folder() -> Path:
    """This job's report folder, ``<cache>/forensics/<job id>``."""
    return cache_dir() / "forensics" / RING.job_id


def _on_usr1(signum, frame) -> None:
    write_report("SIGUSR1 (the rank runs on)")


def configure(rank: int, world: int, timeout_s: float) -> None:
    """At engine start-up on every rank: note the rank, world size and collective timeout, and
    (from the main thread) make ``kill -USR1`` write a report without stopping the rank, unless
    the program set a SIGUSR1 handler of its own (the Python API inside someone's program)."""
    RING.rank, RING.world, RING.timeout_s = rank, world, timeout_s
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1") \
            and signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None, _on_usr1):
        signal.signal(signal.SIGUSR1, _on_usr1)


def where() -> str:
    """``step S (KIND, N tokens, B seqs) in COLLECTIVE for T s``, what this rank is doing now."""
    last = RING.last_step()
    at = "before the first step" if last is None else \
        f"step {last.step} ({last.kind}, {last.tokens} tokens, {last.seqs} seqs)"
    if RING.current is None:
        return f"{at}, in no collective"
    return f"{at} in {RING.current} for {time.monotonic() - RING.since:.1f} s"


def write_report(reason: str) -> Path | None:
    """Write this rank's report (header, ring, every thread's stack) to ``folder()/rank<k>.txt``
    (replacing an earlier one); returns its path, or None when it cannot be written (the reason
    is then printed on stderr: a report never raises)."""
    path = folder() / f"rank{RING.rank}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "w") as fh:
            fh.write(f"tpengine forensics: rank {RING.rank}/{RING.world}, pid {os.getpid()}, "
                     f"job {RING.job_id}\n")
            fh.write(f"written: {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, reason: {reason}\n")
            fh.write(f"now: {where()}\n")
            if RING.current is not None:
                fh.write(f"collective entered: {time.strftime('%H:%M:%S', time.gmtime(RING.since_wall))} UTC, "
                         f"timeout {RING.timeout_s:.0f} s\n")
            fh.write(f"\nlast {len(RING.steps)} steps (oldest first): step kind tokens seqs started(UTC)\n")
            for r in RING.steps:
                stamp = time.strftime("%H:%M:%S", time.gmtime(r.started)) + f".{int(r.started % 1 * 1000):03d}"
                fh.write(f"  {r.step} {r.kind} {r.tokens} {r.seqs} {stamp}\n")
            fh.write("\nPython stacks (most recent call first):\n")
            fh.flush()
            faulthandler.dump_traceback(fh, all_threads=True)
        os.replace(tmp, path)
        return path
    except OSError as e:
        import sys

        print(f"[tpengine rank {RING.rank}/{RING.world}] cannot write the forensics report {path}: {e}",
              file=sys.stderr, flush=True)
        return None


def collective_failure(exc: BaseException) -> str | None:
    """Called with the exception that ends a rank. When the rank was inside a collective: write its
    report and return what its one error line says, else None (not a collective's failure; the
    stopped ranks of the job on this host are still ended, :func:`end_local_ranks`).

    Every rank then waits up to ``min(3, timeout / 2)`` s for the other ranks' reports of this job (a
    live rank times out at about the same moment) and SIGKILLs those without one that run on its host
    and are stopped (:func:`end_local_ranks`). Rank 0 names the ranks without one: ``collective timed out: rank(s) K
    did not arrive (ended here: rank K pid P); rank 0 at step S (...) in C for T s; reports in DIR
    (TYPE: MESSAGE)``. Other ranks return ``collective failed: rank R at step ...; reports in DIR (...)``.
    """
    if RING.current is None:  # not a collective's failure; a stopped peer would still outlive the job
        end_local_ranks(None)
        return None
    written = write_report(f"{FAILED}: {type(exc).__name__}: {exc}")
    here = where()
    cause = f"({type(exc).__name__}: {exc})"
    where_to = f"reports in {folder()}" if written else "no report written"
    # every rank waits up to min(3, timeout / 2) s for the others' reports (a live rank times out at
    # about the same moment) and ends the stopped ones on its host without one, which would outlive the
    # job (rank 0 may be the one stopped, so not only rank 0 does this)
    others = [r for r in range(RING.world) if r != RING.rank]
    deadline = time.monotonic() + min(3.0, RING.timeout_s / 2)

    def missing() -> list[int]:  # ranks without a report of a collective's failure (not a SIGUSR1 one)
        out = []
        for r in others:
            try:
                with open(folder() / f"rank{r}.txt") as fh:
                    fh.readline()
                    if FAILED in fh.readline():
                        continue
            except OSError:
                pass
            out.append(r)
        return out

    while (absent := missing()) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = end_local_ranks(absent)
    ended = f" (ended here: {', '.join(f'rank {r} pid {pid}' for r, pid in killed.items())})" if killed else ""
    if RING.rank != 0:
        return f"collective failed: rank {RING.rank} at {here}{ended}; {where_to} {cause}"
    who = f"rank(s) {', '.join(map(str, absent))} did not arrive" if absent else "every rank reported"
    return f"collective timed out: {who}{ended}; rank 0 at {here}; {where_to} {cause}"


def local_ranks() -> dict[int, tuple[int, str]]:
    """``rank -> (pid, state, name)`` of this job's other ranks on this host: the processes whose parent
    is this rank's parent (torchrun starts every local rank as a child of its agent) and whose
    environment holds this job's ``TORCHELASTIC_RUN_ID``; ``state`` is ``/proc``'s one-letter state
    ("T": stopped), ``name`` its ``comm`` (:data:`EXITING` once it is in :func:`end_stopped_ranks`).
    Empty outside torchrun or without ``/proc`` (not Linux); never raises."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if not job or not os.path.isdir("/proc"):
        return {}
    parent, found = os.getppid(), {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:  # "pid (comm) state ppid ...": comm may hold spaces
                head, tail = fh.read().rsplit(")", 1)
            state, ppid = tail.split()[:2]
            name = head.split("(", 1)[1]
            if int(ppid) != parent:
                continue
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                env = dict(x.split(b"=", 1) for x in fh.read().split(b"\0") if b"=" in x)
        except (OSError, ValueError, IndexError):
            continue
        if env.get(b"TORCHELASTIC_RUN_ID") == job.encode() and env.get(b"RANK", b"").isdigit():
            found[int(env[b"RANK"])] = (int(entry.name), state, name)
    return found


def end_local_ranks(ranks: list[int] | None) -> dict[int, int]:
    """SIGKILL those of ``ranks`` (None: every other rank) that run on this host (:func:`local_ranks`) and are stopped
    (SIGSTOP, a debugger): such a rank cannot act on the launcher's SIGTERM, so torchrun would wait
    its 30 s grace before ending it, and it would outlive the job. A rank that runs is left to end
    itself or to the launcher (it may be writing its own failure line). Returns ``rank -> pid`` of
    those signalled; never raises."""
    local = local_ranks() if ranks is None or ranks else {}
    killed = {}
    for r in local if ranks is None else ranks:
        if r in local and local[r][1] in ("T", "t"):
            try:
                os.kill(local[r][0], signal.SIGKILL)
                killed[r] = local[r][0]
            except OSError:
                pass
    return killed


#: The process name (``comm``) of a rank in :func:`end_stopped_ranks`: it has left its last collective.
EXITING = "tpengine-exit"


def end_stopped_ranks(poll_s: float = 0.01) -> dict[int, int]:
    """At this rank's exit after a clean run: name this process :data:`EXITING`, wait up to the
    collective timeout for this job's other ranks on this host (:func:`local_ranks`) to exit or to reach
    this point themselves, then SIGKILL every one of them that is stopped (:func:`end_local_ranks`). A
    rank stopped (SIGSTOP) after the job's last collective fails no collective, so no peer would end it,
    and torchrun would wait for it forever; a rank that runs is never killed, and exiting ranks never
    wait for each other (each is :data:`EXITING`; one stopped while it waits here is ended at once).
    Returns ``rank -> pid`` of those signalled; never raises."""
    _set_name(EXITING)
    deadline = time.monotonic() + RING.timeout_s
    while any(name != EXITING for _, _, name in local_ranks().values()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return end_local_ranks(None)


def _set_name(name: str) -> None:
    """This process's ``comm`` (Linux ``prctl(PR_SET_NAME)``, 15 bytes); nothing elsewhere."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


_EXIT_GUARD: dict[str, bool] = {}


def end_stopped_ranks_at_exit() -> None:
    """Register :func:`end_stopped_ranks` to run when this process exits (once per process), under
    torchrun only (the entry points' clean shutdown calls this)."""
    if "set" not in _EXIT_GUARD and os.environ.get("TORCHELASTIC_RUN_ID"):
        _EXIT_GUARD["set"] = True
        atexit.register(end_stopped_ranks)
