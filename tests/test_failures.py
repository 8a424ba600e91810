"""Failure rules through the real main job at several ranks (torchrun's environment and its rule of
ending the others once one fails, through the suite's fork server: tests/forkserver.py): C07 (one
rank fails -> every rank exits non-zero quickly, naming the rank and the exception), C19 (shards for
another tp or config -> clean failure before any collective), clean exit and an immediate second run."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import launch
import pytest
from conftest import make_tiny_model
from launch import WORKERS

from shard_tool.split import split_model

#: The collective timeout of this module's jobs, and the bound on a job that must fail quickly (well under it).
DIST_TIMEOUT_S, QUICK_S = 300, 120


def run_job(nproc: int, model: Path, prompts: Path, out: Path, config: Path | None = None,
            fault: str | None = None):
    """The main job under torchrun -> (the finished process, its wall seconds); ``fault`` "RANK:STEP"
    runs it through tests/workers/fault_run.py, which makes rank RANK raise at its STEP-th decode step."""
    target, args = ("tpengine.run", []) if fault is None else (WORKERS / "fault_run.py", [fault])
    args += ["--prompts", prompts, "--out", out, "--model", model, *(["--config", config] if config else [])]
    t0 = time.monotonic()
    r = launch.run(launch.command(target, args, nproc, torchrun=True), check=False)
    return r, time.monotonic() - t0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("failures")
    model = make_tiny_model(root, "llama", name="tiny")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": [5, 6, 7, 10 + i],
                                           "max_tokens": 8, "temperature": 0}) + "\n" for i in range(4)))
    cfg = root / "engine.toml"
    # a collective waits DIST_TIMEOUT_S: a job that ended only by that timeout would take longer than
    # QUICK_S, which leaves a loaded machine (a second suite beside this one) room for torchrun and the imports
    cfg.write_text(f"[engine]\nkv_cache_gb = 0.05\nmax_model_len = 128\ndist_timeout_s = {DIST_TIMEOUT_S}\n")
    shards = root / "tiny-tp2"
    split_model(model, 2, shards)
    return root, model, prompts, cfg, shards


def test_clean_exit_and_immediate_second_run(setup):
    root, model, prompts, cfg, _ = setup
    for attempt in range(2):  # no leftover port, process or lock
        out = root / f"ok-{attempt}.jsonl"
        r, _ = run_job(2, model, prompts, out, cfg)
        exited = time.time()
        assert r.returncode == 0, r.stderr[-3000:]
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert sorted(x["id"] for x in lines) == ["r0", "r1", "r2", "r3"]
        assert all(len(x["token_ids"]) == 8 for x in lines)
        assert exited - out.stat().st_mtime < 10  # every rank gone within 10 s of the last output


def test_c07_rank1_raises_at_decode_step_3(setup):
    root, model, prompts, cfg, _ = setup
    out = root / "fault.jsonl"
    r, elapsed = run_job(2, model, prompts, out, cfg, fault="1:3")
    assert r.returncode != 0
    assert elapsed < QUICK_S
    assert "[tpengine rank 1/2] failed: RuntimeError: injected fault on rank 1 at decode step 3" in r.stderr
    assert not out.exists() or out.read_text() == ""  # nothing claims success


def test_c07_truncated_shard_on_rank1(setup, tmp_path):
    root, _, prompts, cfg, shards = setup
    broken = tmp_path / "tiny-tp2"
    shutil.copytree(shards, broken)
    f = broken / "rank-01-of-02.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    out = tmp_path / "out.jsonl"
    r, elapsed = run_job(2, broken, prompts, out, cfg)
    assert r.returncode != 0
    assert elapsed < QUICK_S
    assert "[tpengine rank 1/2] failed: CheckpointMismatchError: rank 1:" in r.stderr
    assert "rank-01-of-02.safetensors" in r.stderr and "corrupt or truncated" in r.stderr
    assert not out.exists() or out.read_text() == ""


@pytest.mark.parametrize("nproc", [1, 4])
def test_c19_shards_for_tp2_launched_at_other_tp(setup, tmp_path, nproc):
    root, _, prompts, cfg, shards = setup
    r, elapsed = run_job(nproc, shards, prompts, tmp_path / "out.jsonl", cfg)
    assert r.returncode != 0
    assert elapsed < QUICK_S  # torchrun + imports; the check itself runs before any collective
    assert f"was made for tp=2 but this launch has tp={nproc}" in r.stderr
    assert "tpengine-shard split" in r.stderr


def test_c19_config_layer_mismatch(setup, tmp_path):
    root, _, prompts, cfg, shards = setup
    bad = tmp_path / "tiny-tp2"
    shutil.copytree(shards, bad)
    conf = json.loads((bad / "config.json").read_text())
    conf["num_hidden_layers"] = 3
    (bad / "config.json").write_text(json.dumps(conf))
    r, _ = run_job(2, bad, prompts, tmp_path / "out.jsonl", cfg)
    assert r.returncode != 0
    assert "was made for num_hidden_layers=2 but the model config has num_hidden_layers=3" in r.stderr


def test_shutdown_releases_the_process_group(setup, tmp_path):
    """After shutdown no rank keeps the default group (and gloo's worker threads) alive, even
    though loading the model imported torch.distributed.nn, whose functions bind the default
    group as an argument default. A live group reached interpreter finalization and aborted a
    rank about once in ten runs ("terminate called without an active exception")."""
    _, model, _, _, _ = setup
    launch.torchrun("shutdown_check.py", 2, [str(model), str(tmp_path / "r")], real=True)  # a process's threads
    for rank in range(2):
        got = json.loads((tmp_path / f"r-{rank}.json").read_text())
        assert got["gathered"] == [0, 1]
        assert got["group_alive"] is False
        assert got["threads_after"] == got["threads_before"]
