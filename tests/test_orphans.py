"""No orphans (issue 38 A): ``kill -9`` of the torchrun launcher of a tp=2 batch job or server ends
every rank within 5 s (``die_with_launcher``: PR_SET_PDEATHSIG plus a parent-pid watchdog), what the
job wrote to --out stays whole, and ``--resume`` then completes every id exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import forkserver
import pytest
from conftest import make_tiny_model
from launch import START_TIMEOUT, cli, command, free_port, popen
from test_cli import records, write_jsonl

SETTINGS = ["--max-model-len", "128", "--kv-cache-gb", "0.01", "--max-num-seqs", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("orphans"), name="tiny")


def rank_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's ranks: its children that carry torchrun's ``RANK``, or those the
    fork server recorded for it (:func:`forkserver.ranks_file`)."""
    record = Path(forkserver.ranks_file(launcher))
    if os.environ.get(forkserver.SOCKET_ENV, "off") != "off" and record.is_file():
        return {int(rank): pid for rank, pid in json.loads(record.read_text()).items()}
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        rank = next((int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            ranks[rank] = int(entry.name)
    return ranks


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except (OSError, IndexError):
        return False


def kill_launcher_and_check_ranks(proc: subprocess.Popen, world: int = 2) -> None:
    """``kill -9`` the launcher ``proc``; assert each of its ``world`` ranks is gone within 5 s."""
    ranks = rank_pids(proc.pid)
    assert sorted(ranks) == list(range(world)), ranks
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = time.monotonic()
    while any(alive(p) for p in ranks.values()) and time.monotonic() - killed < 5:
        time.sleep(0.05)
    left = {r: p for r, p in ranks.items() if alive(p)}
    for p in left.values():  # leave nothing behind for the next test, then fail
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks still alive 5 s after the launcher was killed: {left}"


def test_killed_launcher_of_a_job_leaves_no_rank_and_resume_completes(tiny, tmp_path):
    n = 16
    prompts = write_jsonl(tmp_path / "in.jsonl", [
        {"id": f"r{i}", "prompt_token_ids": [5, 6, 7, 10 + i], "max_tokens": 32, "temperature": 0,
         "ignore_eos": True} for i in range(n)])
    out = tmp_path / "out.jsonl"
    common = ["--prompts", prompts, "--model", tiny, *SETTINGS]
    cmd = [*command("tpengine.run", nproc=2, real=True), *map(str, common), "--out", str(out)]
    proc = popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not (out.exists() and out.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            assert proc.poll() is None, "the job ended before its launcher could be killed"
            time.sleep(0.02)
        kill_launcher_and_check_ranks(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    written = out.read_text()
    whole = written[: written.rfind("\n") + 1]
    assert 2 <= whole.count("\n") < n, "the job was not killed mid-run"
    assert all(json.loads(line)["finish_reason"] == "length" for line in whole.splitlines())  # whole records
    cli([*common, "--out", out, "--resume"], tp=2)
    got = records(out)  # asserts no id was written twice
    assert sorted(got) == sorted(f"r{i}" for i in range(n))
    assert all(len(r["token_ids"]) == 32 for r in got.values())


def test_killed_launcher_of_a_server_leaves_no_rank(tiny, tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [*command("tpengine.serve", nproc=2, real=True), "--port", str(port),
           "--model", str(tiny), *SETTINGS]
    with open(log, "w") as err:
        proc = popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up: " + log.read_text()[-3000:]
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.3)
        kill_launcher_and_check_ranks(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_no_guard_outside_torchrun(monkeypatch):
    """A plain ``tpengine run`` (tp=1, its parent a shell) is never tied to its parent."""
    from tpengine.entrypoints.setup import die_with_launcher

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert die_with_launcher() is False
