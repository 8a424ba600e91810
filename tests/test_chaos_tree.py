"""``make chaos``'s process tree (benchmarks/chaos.py ``Tree``): how it finds a launcher's ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from benchmarks.chaos import Tree


def test_a_rank_seen_before_its_exec_is_found_as_a_rank_after_it():
    """A process the launcher has forked but not yet exec'd still has the launcher's environment (no
    ``RANK``). chaos's third run lost a server trial to that: the restarted server's rank 0 was first seen
    so, stayed "child", never got the SIGTERM that stops the server, and the trial failed as a server that
    did not stop. Here the "rank" execs with ``RANK=0`` 1 s after it is first seen."""
    launcher = subprocess.Popen(["sh", "-c", "sh -c 'sleep 1; exec env RANK=0 sleep 30' & wait"],
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        tree = Tree(launcher.pid)
        while not any(role == "child" for role, _, _ in tree.live()) and time.monotonic() < deadline:
            time.sleep(0.02)
            tree.poll()
        assert tree.pid_of("rank0") is None  # seen, as a "child"
        while tree.pid_of("rank0") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        rank0 = tree.pid_of("rank0")
        assert rank0 is not None and sorted(r for r, _, _ in tree.live()) == ["launcher", "rank0"]
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
