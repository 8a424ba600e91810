"""Hang forensics (issue 38 D) on a tp=2 job with --dist-timeout-s 5: ``kill -USR1`` on a rank writes
its report and the job runs on; a SIGSTOPped rank makes rank 0 fail with one line that names that
rank, the step and the collective and the reports' folder, where the live rank's report (its ring of
steps and Python stacks) is, and end the stopped rank: the whole job is over within 15 s."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from launch import START_TIMEOUT, command, popen
from test_cli import write_jsonl
from test_orphans import SETTINGS, alive, rank_pids, tiny  # noqa: F401  (tiny: the module's model fixture)


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc is None or proc.poll() is None, f"the job ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_usr1_report_then_a_stopped_rank_is_named(tiny, tmp_path):  # noqa: F811
    # the session's cache (measured layouts already there: a cold one can keep rank 0 from its first
    # collective for more than the 5 s timeout on a busy machine)
    cache = Path(os.environ.get("TPENGINE_CACHE_DIR") or Path.home() / ".cache" / "tpengine")
    started = time.time()
    prompts = write_jsonl(tmp_path / "in.jsonl", [
        {"id": f"r{i}", "prompt_token_ids": [5, 6, 7, 10 + i], "max_tokens": 48, "temperature": 0,
         "ignore_eos": True} for i in range(60)])
    out, log = tmp_path / "out.jsonl", tmp_path / "stderr.txt"
    cmd = [*command("tpengine.run", nproc=2, real=True), "--prompts", str(prompts),
           "--model", str(tiny), *SETTINGS, "--dist-timeout-s", "5", "--out", str(out)]
    with open(log, "w") as err:
        proc = popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    ranks: dict[int, int] = {}
    try:
        wait_for(lambda: out.exists() and out.read_text().count("\n") >= 2, START_TIMEOUT, "the first records", proc)
        ranks = rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1], signal.SIGUSR1)  # a report, and the rank runs on
        reports = cache / "forensics"

        def new_reports() -> list[Path]:
            return [p for p in reports.glob("*/rank1.txt") if p.stat().st_mtime >= started]

        wait_for(new_reports, 30, "rank 1's SIGUSR1 report", proc)
        (usr1,) = new_reports()
        text = usr1.read_text()
        assert "reason: SIGUSR1 (the rank runs on)" in text and "Python stacks" in text
        assert " DECODE " in text or " PREFILL " in text  # the ring of steps
        done = out.read_text().count("\n")
        wait_for(lambda: out.read_text().count("\n") > done, 60, "records after the SIGUSR1", proc)

        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        # rank 0 names rank 1 and ends it (a stopped rank ignores the launcher's SIGTERM): the whole job
        # is over within 15 s
        proc.wait(15)
        assert time.monotonic() - stopped < 15 and not alive(ranks[0]) and not alive(ranks[1])
    finally:
        for pid in ranks.values():  # a stopped rank would keep torchrun waiting (30 s) before its SIGKILL
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(60)
    assert proc.returncode != 0
    lines = [x for x in log.read_text().splitlines() if x.startswith("[tpengine rank 0/2] failed:")]
    assert len(lines) == 1, log.read_text()[-3000:]
    line = lines[0]
    folder = usr1.parent
    assert (f"collective timed out: rank(s) 1 did not arrive (ended here: rank 1 pid {ranks[1]}); rank 0 at step "
            in line)
    assert any(f" in {c}" in line for c in ("all_reduce", "gather", "the step plan", "the token bitmask"))
    assert f"reports in {folder}" in line
    rank0 = (folder / "rank0.txt").read_text()
    assert "reason: failed in a collective" in rank0 and "Python stacks" in rank0
    assert (folder / "rank1.txt").read_text() == text  # the stopped rank wrote nothing more


def test_ring_reports_and_the_failure_line_in_process(tmp_path, monkeypatch):
    """The ring keeps the last steps and the innermost collective (``leave`` only on return), a
    failure outside a collective is not the ring's, and rank 0's line names the ranks whose report
    of a collective's failure is missing (a SIGUSR1 report does not count)."""
    from tpengine import forensics

    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    ring = forensics.Ring(size=4)
    ring.job_id = "job"
    monkeypatch.setattr(forensics, "RING", ring)
    assert forensics.collective_failure(RuntimeError("not in a collective")) is None
    for s in range(6):
        forensics.step(s, "DECODE", 1, 1)
    assert [r.step for r in ring.steps] == [2, 3, 4, 5]
    outer = forensics.enter("the step plan's header broadcast (control group)")
    forensics.leave(forensics.enter("all_reduce of the activations (default group)"))
    assert outer is None and ring.current == "the step plan's header broadcast (control group)"
    ring.rank, ring.world, ring.timeout_s = 0, 3, 0.4
    folder = tmp_path / "forensics" / "job"
    folder.mkdir(parents=True)
    (folder / "rank1.txt").write_text("tpengine forensics: rank 1/3\nwritten: now, reason: SIGUSR1\n")
    (folder / "rank2.txt").write_text(f"tpengine forensics: rank 2/3\nwritten: now, reason: {forensics.FAILED}: X\n")
    line = forensics.collective_failure(RuntimeError("Timed out waiting 400ms"))
    assert line.startswith("collective timed out: rank(s) 1 did not arrive; rank 0 at step 5 (DECODE, 1 tokens, "
                           "1 seqs) in the step plan's header broadcast (control group) for ")
    assert line.endswith(f"; reports in {folder} (RuntimeError: Timed out waiting 400ms)")
    report = (folder / "rank0.txt").read_text()
    assert f"reason: {forensics.FAILED}: RuntimeError: Timed out waiting 400ms" in report
    assert "  5 DECODE 1 1 " in report and "  1 DECODE" not in report
    assert "test_ring_reports_and_the_failure_line_in_process" in report  # this thread's stack


def test_usr1_writes_a_report_unless_the_program_has_its_own_handler(tmp_path, monkeypatch):
    from tpengine import forensics

    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    ring = forensics.Ring()
    ring.job_id = "job"
    monkeypatch.setattr(forensics, "RING", ring)
    before = signal.getsignal(signal.SIGUSR1)
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        forensics.configure(0, 1, 5.0)
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs between bytecodes of the main thread
        report = tmp_path / "forensics" / "job" / "rank0.txt"
        wait_for(report.exists, 30, "the SIGUSR1 report")
        assert "reason: SIGUSR1 (the rank runs on)" in report.read_text()

        def own(*_):
            pass

        signal.signal(signal.SIGUSR1, own)
        forensics.configure(0, 1, 5.0)
        assert signal.getsignal(signal.SIGUSR1) is own
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_rank_stopped_after_the_last_collective_is_ended_at_exit():
    """A rank exits after a clean run while another rank of its job (same parent, same
    TORCHELASTIC_RUN_ID) is stopped: it waits the collective timeout (1 s) for that one, then SIGKILLs
    it (chaos: a SIGSTOP after the job's last collective would keep torchrun waiting forever). A rank
    that runs is waited for and never killed; one that is exiting itself (named tpengine-exit) is not
    waited for, and is ended at once when it is stopped."""
    import sys

    env = {**os.environ, "TORCHELASTIC_RUN_ID": f"forensics-exit-{os.getpid()}"}
    exiting = ("import time; from tpengine import forensics; forensics.RING.rank, forensics.RING.timeout_s = 0, 1.0; "
               "t = time.monotonic(); print(forensics.end_stopped_ranks(), round(time.monotonic() - t, 1))")
    for other in ("stopped", "running", "exiting", "exiting stopped"):
        # the peer says when it has started (and is named), then waits to be killed (finally)
        name = "from tpengine import forensics; forensics._set_name(forensics.EXITING); "
        code = (name if other.startswith("exiting") else "") + "import time; print('ready', flush=True); " \
            "time.sleep(600)"
        peer = subprocess.Popen([sys.executable, "-c", code], env={**env, "RANK": "1"}, stdout=subprocess.PIPE,
                                text=True)
        try:
            assert peer.stdout.readline() == "ready\n"
            if other.endswith("stopped"):
                os.kill(peer.pid, signal.SIGSTOP)
            out = subprocess.run([sys.executable, "-c", exiting], env={**env, "RANK": "0"}, capture_output=True,
                                 text=True, timeout=60, check=True).stdout.split()
            if other.endswith("stopped"):
                assert peer.wait(5) == -signal.SIGKILL
                assert out[:2] == ["{1:", f"{peer.pid}}}"], out
                assert float(out[2]) >= 1.0 if other == "stopped" else float(out[2]) < 0.5, out
            elif other == "running":
                assert peer.poll() is None and out[0] == "{}" and float(out[1]) >= 1.0, out
            else:
                assert peer.poll() is None and out[0] == "{}" and float(out[1]) < 0.5, out
        finally:
            peer.kill()
            peer.wait()
