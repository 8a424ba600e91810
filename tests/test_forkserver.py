"""The suite's fork server (tests/forkserver.py) runs a launch as torchrun and python would: the same
environment, argv, working folder, stdio and exit code, torchrun's rule when a rank fails, signals passed
on, the job ended with its client, and a launch it cannot serve run for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import launch
import pytest
from launch import REPO, WORKERS
from test_orphans import alive, rank_pids

pytestmark = pytest.mark.skipif(not launch.forkserver_running(), reason="the fork server is off")

PROBE = WORKERS / "forkserver_probe.py"


def probe(tmp_path, nproc: int, action: str, real: bool = False, env: dict | None = None):
    cmd = launch.command(PROBE, [tmp_path / "p", action], nproc, real=real)
    return launch.run(cmd, env=env, check=False, timeout=120)


def seen(tmp_path, rank) -> dict:
    return json.loads((tmp_path / f"p-{rank}.json").read_text())


def test_ranks_see_what_torchruns_ranks_see(tmp_path):
    """At 2 ranks: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, OMP_NUM_THREADS (and
    torch's threads), argv, the working folder, sys.path[0] and ``__main__`` equal a real torchrun's;
    one run id for the job; every rank's stdout and stderr come back; exit 0."""
    (tmp_path / "real").mkdir()
    r = probe(tmp_path / "real", 2, "exit:0", real=True)
    real = {rank: seen(tmp_path / "real", rank) for rank in (0, 1)}
    f = probe(tmp_path, 2, "exit:0")
    assert (r.returncode, f.returncode) == (0, 0), f.stderr[-3000:]
    assert sorted(f.stdout.split()) == sorted("probe 0 out probe 1 out".split())
    assert "probe 0 err" in f.stderr and "probe 1 err" in f.stderr
    forked = {rank: seen(tmp_path, rank) for rank in (0, 1)}
    assert all(real[k]["exec_rank"] == str(k) and forked[k]["exec_rank"] is None for k in (0, 1))  # a fork
    for k in (0, 1):
        want = {**real[k], "argv": [str(tmp_path / "p"), "exit:0"], "exec_rank": None}
        assert {**forked[k], "env": {**forked[k]["env"], "TORCHELASTIC_RUN_ID": None}} == \
            {**want, "env": {**want["env"], "TORCHELASTIC_RUN_ID": None}}
        assert forked[k]["env"]["PYTEST_CURRENT_TEST"] and forked[k]["cwd"] == str(REPO)
    assert forked[0]["env"]["TORCHELASTIC_RUN_ID"] == forked[1]["env"]["TORCHELASTIC_RUN_ID"] is not None


def test_a_module_runs_as_python_m_with_its_exit_code(tmp_path):
    """``python -m MOD``: stdout and the exit code pass through (0, and argparse's 2)."""
    data = tmp_path / "d.json"
    data.write_text('{"b": 1, "a": [2]}')
    ok = launch.run(launch.command("json.tool", ["--sort-keys", data]), check=False)
    assert ok.args[1].endswith("forkserver.py") and ok.returncode == 0
    assert json.loads(ok.stdout) == {"a": [2], "b": 1}
    bad = launch.run(launch.command("json.tool", [tmp_path / "missing.json"]), check=False)
    assert bad.returncode == 2 and "missing.json" in bad.stderr


@pytest.mark.parametrize("real", [True, False], ids=["torchrun", "fork"])
def test_a_failed_rank_ends_the_job_with_exit_1(tmp_path, real):
    """Rank 1 raises while rank 0 sleeps: rank 0 is ended, the job exits 1 (torchrun's code), rank 1's
    traceback is in stderr."""
    t0 = time.monotonic()
    r = probe(tmp_path, 2, "fail-rank:1", real=real)
    assert r.returncode == 1 and "RuntimeError: rank 1 fails on purpose" in r.stderr, r.stderr[-3000:]
    assert time.monotonic() - t0 < 100


def test_a_signal_reaches_the_ranks_and_a_killed_client_ends_them(tmp_path):
    """SIGTERM to the launch reaches both ranks (they end, the job exits non-zero); SIGKILL of the launch
    (a test's timeout) ends its ranks."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        folder = tmp_path / sig.name
        folder.mkdir()
        proc = launch.popen(launch.command(PROBE, [folder / "p", "sleep"], 2), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not all((folder / f"p-{k}.json").is_file() for k in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1]
        proc.send_signal(sig)
        assert proc.wait(60) != 0
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in ranks.values()), sig.name


def test_an_import_time_variable_makes_the_launch_real(tmp_path):
    """A launch that sets a variable torch reads as it loads (``ATEN_CPU_CAPABILITY``) runs under
    torchrun itself: its ranks were exec'd with RANK in their environment."""
    r = probe(tmp_path, 2, "exit:0", env={"ATEN_CPU_CAPABILITY": "default"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert [seen(tmp_path, k)["exec_rank"] for k in (0, 1)] == ["0", "1"]
    assert forkserver_differences({**os.environ, "ATEN_CPU_CAPABILITY": "default"}) == ["ATEN_CPU_CAPABILITY"]


def forkserver_differences(env: dict) -> list[str]:
    import forkserver

    return forkserver.differences(env, {**os.environ})


def test_python_path_of_another_tree_is_a_difference(tmp_path, monkeypatch):
    """``PYTHONPATH`` may name folders the server already imports from (the repository root, its working
    folder, as the benchmarks set it), never another tree."""
    monkeypatch.chdir(REPO)
    assert forkserver_differences({**os.environ, "PYTHONPATH": str(REPO)}) == []
    assert forkserver_differences({**os.environ, "PYTHONPATH": str(tmp_path)}) == ["PYTHONPATH"]
