"""Data parallelism x tensor parallelism (issue 40): ``--data-parallel-size D`` replicas of
``--tensor-parallel-size T`` ranks in one launch. Greedy float32 records at D=2 x T=1, D=1 x T=2 and
D=2 x T=2 (4 processes) equal D=1 x T=1's id for id, through the batch job, the ``LLM`` API and the
server; across two launches as two nodes; a killed rank of one replica ends the job and ``--resume``
completes every id once; the router's choices; the layout's one error."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
import urllib.request

import pytest
from conftest import make_tiny_model
from launch import START_TIMEOUT, cli, command, free_port, node_command, popen, torchrun
from test_cli import records, write_jsonl
from test_orphans import rank_pids

from tpengine.config import EngineConfig, parallel_sizes
from tpengine.engine.data_parallel import Router, merge_stats, request_cost
from tpengine.engine.stats import EngineStats
from tpengine.errors import UserError
from tpengine.sampling_params import SamplingParams

SETTINGS = ["--max-model-len", "128", "--num-kv-blocks", "256", "--block-size", "4", "--max-num-seqs", "4",
            "--dtype", "float32"]


def make_prompts(n: int = 12, seed: int = 0) -> list[dict]:
    """``n`` token-id prompts, every other one opening with the same 12-token document (prefix caching
    and the router's prefix key), with 1-12 output tokens each."""
    rng = random.Random(seed)
    doc = [rng.randrange(3, 1000) for _ in range(12)]
    return [{"ids": (doc if i % 2 else []) + [rng.randrange(3, 1000) for _ in range(rng.randrange(3, 20))],
             "max_tokens": rng.randrange(1, 13)} for i in range(n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny model, the prompts as a request file, and the reference records (tp=1, one replica)."""
    tmp = tmp_path_factory.mktemp("dp")
    model = make_tiny_model(tmp, name="tiny", hidden_size=96, num_attention_heads=6)
    prompts = make_prompts()
    lines = write_jsonl(tmp / "in.jsonl", [
        {"id": f"r{i}", "prompt_token_ids": p["ids"], "max_tokens": p["max_tokens"], "temperature": 0,
         "ignore_eos": True} for i, p in enumerate(prompts)])
    ref = tmp / "ref.jsonl"
    cli(["--prompts", lines, "--model", model, "--out", ref, *SETTINGS])
    return {"model": model, "prompts": prompts, "lines": lines, "ref": records(ref), "tmp": tmp}


def tokens(recs: dict) -> dict[str, list[int]]:
    return {rid: r["token_ids"] for rid, r in recs.items()}


# ---------------------------------------------------------------- the layout and the router
def test_parallel_sizes_and_the_one_error():
    assert parallel_sizes(4) == (1, 4)
    assert parallel_sizes(4, 2) == (2, 2)
    assert parallel_sizes(4, 2, 2) == (2, 2)
    assert parallel_sizes(2, 2) == (2, 1)
    assert EngineConfig(data_parallel_size=2).parallel_sizes(4) == (2, 2)
    with pytest.raises(UserError) as e:
        parallel_sizes(2, 3)
    assert str(e.value) == ("data_parallel_size=3 does not fit the world size 2 (torchrun's --nnodes x "
                            "--nproc_per_node): it must be data_parallel_size x tensor_parallel_size (1 x 2, 2 x 1), "
                            "or launch 3 rank(s) for these sizes")
    with pytest.raises(UserError) as e:
        parallel_sizes(4, 1, 2)
    assert str(e.value).startswith("data_parallel_size=1 x tensor_parallel_size=2 does not fit the world size 4 ")
    assert str(e.value).endswith("(1 x 4, 2 x 2, 4 x 1), or launch 2 rank(s) for these sizes")
    with pytest.raises(ValueError, match=r"^invalid data_parallel_size=0: must be an integer >= 1$"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match=r"^invalid tensor_parallel_size=0: must be an integer >= 1 or unset$"):
        EngineConfig(tensor_parallel_size=0)


def test_a_launch_whose_world_is_not_dp_x_tp_exits_2_before_loading(setup):
    r = cli(["--prompts", setup["lines"], "--model", setup["model"], "--data-parallel-size", "2"], check=False)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "error: data_parallel_size=2 does not fit the world size 1 (torchrun's --nnodes x --nproc_per_node): it must "
        "be data_parallel_size x tensor_parallel_size (1 x 1), or launch 2 rank(s) for these sizes")


def test_router_balances_outstanding_tokens_and_keeps_prefixes_together():
    greedy = SamplingParams(max_tokens=10)
    r = Router(2, block_size=4, max_model_len=100)
    assert request_cost(5, greedy, 100) == 15
    assert request_cost(5, SamplingParams(max_tokens=None, n=2), 100) == 5 + 2 * 95
    # no shared prefix: the least loaded replica (the lower index on a tie)
    assert [r.route(f"a{i}", [i, 1, 2], greedy) for i in range(4)] == [0, 1, 0, 1]
    assert r.load == [26, 26]
    r.finish("a0")
    assert r.load == [13, 26] and r.replica_of("a0") is None and r.replica_of("a1") == 1
    assert r.route("a2", [9], greedy) == 0  # a live id goes to its replica (whose engine refuses a duplicate)
    # a prompt whose first block a replica has seen goes there while its load stays within 2x the least + its cost
    doc = [7, 7, 7, 7]
    r = Router(2, block_size=4, max_model_len=100)
    picks = [r.route(f"d{i}", doc + [i], greedy) for i in range(6)]
    assert picks == [0, 0, 1, 1, 0, 1], picks  # cost 15 each: 0, 0 (15 <= 2*0+15), 1 (30 > 15), 1, 0, 1
    assert r.holders[hash(tuple(doc))] == [0, 1]
    r.finish("d0"), r.finish("d1"), r.finish("d4")  # replica 0 idle, replica 1 holds 3 requests
    assert r.route("x", [1, 2, 3, 4, 5], greedy) == 0


def test_merge_stats_sums_the_replicas():
    a = EngineStats(3, 1, 2, 10, 5, 0, 4, 8, 1, 2, cached_prompt_tokens=4, speculative=True,
                    spec_accepted_per_pos=(3, 1))
    b = EngineStats(2, 1, 1, 6, 2, 1, 6, 8, 0, 0, spec_accepted_per_pos=(2,))
    m = merge_stats([a, b])
    assert (m.steps, m.prompt_tokens, m.output_tokens, m.num_free_blocks, m.num_total_blocks, m.num_waiting) == \
        (5, 16, 7, 10, 16, 2)
    assert m.speculative and m.spec_accepted_per_pos == (5, 1) and m.prefix_cache_hit_rate == 0.25


# ---------------------------------------------------------------- the batch job
def test_job_records_equal_one_replica_at_every_layout(setup, tmp_path):
    """D=2 x T=1 and D=2 x T=2 (4 processes; D=1 x T=2: test_two_nodes_...): the records equal D=1 x T=1's
    id for id; the summary lists every rank's memory, and the loading line names the layout."""
    ref = tokens(setup["ref"])
    common = ["--prompts", setup["lines"], "--model", setup["model"], *SETTINGS]
    for nproc, flags, layout in (
            (2, ["--data-parallel-size", "2"], "dp 2 x tp 1"),
            (4, ["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--threads", "1"], "dp 2 x tp 2")):
        out, summary = tmp_path / f"out-{nproc}-{flags[0]}.jsonl", tmp_path / f"summary-{nproc}-{flags[0]}.json"
        r = cli([*common, *flags, "--out", out, "--summary-json", summary], tp=nproc)
        assert tokens(records(out)) == ref, flags
        assert len(json.loads(summary.read_text())["peak_rss_bytes"]) == nproc
        assert f"({layout}, dtype float32) ..." in r.stderr, r.stderr[-2000:]


def test_killed_rank_of_one_replica_ends_the_job_and_resume_completes(setup, tmp_path):
    n = 8
    lines = write_jsonl(tmp_path / "in.jsonl", [
        {"id": f"k{i}", "prompt_token_ids": [5, 6, 7, 10 + i], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        for i in range(n)])
    common = ["--prompts", lines, "--model", setup["model"], *SETTINGS, "--max-num-seqs", "1", "--dist-timeout-s", "10"]
    ref_out, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    cli([*common, "--out", ref_out])
    cmd = [*command("tpengine.run", nproc=2, real=True), *map(str, common),  # torchrun's report is read
           "--data-parallel-size", "2", "--out", str(out)]
    log = tmp_path / "job.log"
    proc = popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not (out.exists() and out.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.02)
        os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)  # replica 1's only rank
        assert proc.wait(30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # torchrun ends the other ranks as soon as one dies (rank 0 may not get to print its line first)
    assert "exitcode  : -9" in log.read_text(), log.read_text()[-3000:]
    assert 2 <= out.read_text().count("\n") < n
    cli([*common, "--data-parallel-size", "2", "--out", out, "--resume"], tp=2)
    assert tokens(records(out)) == tokens(records(ref_out))


def test_two_nodes_data_parallel_and_tensor_parallel(setup, tmp_path):
    """Two launches on 127.0.0.1 as two nodes (``--nnodes 2 --nproc_per_node 1``): D=2 x T=1 and D=1 x T=2."""
    ref = tokens(setup["ref"])
    for flags in (["--data-parallel-size", "2"], ["--tensor-parallel-size", "2"]):
        port, out = free_port(), tmp_path / f"out{flags[0]}.jsonl"
        args = ["--prompts", setup["lines"], "--model", setup["model"], *SETTINGS, *flags, "--out", out]
        procs = [popen(node_command("tpengine.run", args, node, port), stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
                 for node in (0, 1)]
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
        assert tokens(records(out)) == ref, flags


# ---------------------------------------------------------------- the LLM API
def test_llm_outputs_on_every_rank_in_prompt_order(setup, tmp_path):
    """Under torchrun at world size 2: LLM(data_parallel_size=2), closed, then LLM(data_parallel_size=1)
    (tp=2) in the same processes; at world size 4: D=2 x T=2, then D=4 x T=1. Every rank gets every
    output, in prompt order, equal to tp=1's."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(setup["prompts"]))
    torchrun("dp_llm.py", 2, [str(setup["model"]), str(prompts), str(tmp_path), "2", "1"])
    ref = [setup["ref"][f"r{i}"]["token_ids"] for i in range(len(setup["prompts"]))]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"2": ref, "1": ref}, rank
    # world size 4: D=2 x T=2, then D=4 x T=1
    torchrun("dp_llm.py", 4, [str(setup["model"]), str(prompts), str(tmp_path), "2", "4"], env={"OMP_NUM_THREADS": "1"})
    for rank in range(4):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"2": ref, "4": ref}, rank


# ---------------------------------------------------------------- the server
def start_server(setup, tmp_path, *extra: str, nproc: int = 2, dp: int = 2) -> tuple[subprocess.Popen, str, object]:
    """``torchrun --nproc_per_node {nproc} -m tpengine.serve --data-parallel-size {dp}`` on the tiny model,
    once /health answers: (launcher, base URL, log path)."""
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [*command("tpengine.serve", nproc=nproc, torchrun=True), "--port", str(port),
           "--model", str(setup["model"]), *SETTINGS, "--data-parallel-size", str(dp), *extra]
    proc = popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return proc, url, log
        except OSError:
            time.sleep(0.3)


def post(url: str, body: dict, timeout: float = 120):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def complete_all(setup, url: str) -> dict[str, str]:
    """Every prompt of ``setup`` as a concurrent greedy completion: {id: text}."""
    texts: dict[str, str] = {}

    def complete(i: int, p: dict) -> None:
        body = {"model": "tiny", "prompt": p["ids"], "max_tokens": p["max_tokens"], "temperature": 0.0,
                "ignore_eos": True}
        texts[f"r{i}"] = json.loads(post(url, body).read())["choices"][0]["text"]

    threads = [threading.Thread(target=complete, args=(i, p)) for i, p in enumerate(setup["prompts"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return texts


def settled_metrics(url: str, wants: list[str], timeout: float = 60) -> str:
    """``/metrics`` once it holds every line of ``wants``, or as it is after ``timeout`` seconds: the
    engine loop updates the metrics after the step whose outputs answered the requests, so a client may
    read them a moment before they settle (a loaded machine widens that moment)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        if all(w in metrics for w in wants) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


@pytest.mark.parametrize("dp", [1, 2])
def test_server_at_tp2_equals_one_replica(setup, tmp_path, dp):
    """D=1 x T=2 and D=2 x T=2 (4 processes): concurrent completions equal the batch job's texts at
    D=1 x T=1, the metrics count every one, and SIGTERM stops every rank with exit 0."""
    nproc = 2 * dp
    proc, url, log = start_server(setup, tmp_path, "--tensor-parallel-size", "2", "--threads", "1", nproc=nproc, dp=dp)
    try:
        assert complete_all(setup, url) == {rid: r["text"] for rid, r in setup["ref"].items()}
        done = 'tpengine:request_success_total{finished_reason="length",model_name="tiny"} 12.0'
        metrics = settled_metrics(url, [done])
        assert done in metrics, metrics
        assert f"(dp {dp} x tp 2" in log.read_text() if dp > 1 else "(tp 2" in log.read_text()
        os.kill(rank_pids(proc.pid)[0], signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert all(f"[tpengine rank {r}/{nproc}] server stopped (exit 0)" in text for r in range(nproc)), text[-3000:]


def test_server_routes_between_replicas(setup, tmp_path):
    """``--data-parallel-size 2`` at world size 2: concurrent completions equal the batch job's texts;
    /metrics has each replica's gauges and the totals, back to 0 after; SIGTERM with a stream in flight on
    each replica (``--drain-timeout-s 0``) aborts both, each ending properly, and every rank exits 0."""
    proc, url, log = start_server(setup, tmp_path, "--drain-timeout-s", "0")
    try:
        assert complete_all(setup, url) == {rid: r["text"] for rid, r in setup["ref"].items()}
        idle = [f'tpengine:replica_num_requests_running{{model_name="tiny",replica="{d}"}} 0.0' for d in (0, 1)]
        metrics = settled_metrics(url, [*idle, 'tpengine:num_requests_running{model_name="tiny"} 0.0'])
        for d in (0, 1):
            assert idle[d] in metrics, metrics
            assert f'tpengine:replica_kv_cache_usage_perc{{model_name="tiny",replica="{d}"}}' in metrics
        assert 'tpengine:num_requests_running{model_name="tiny"} 0.0' in metrics
        assert "(dp 2 x tp 1)" in log.read_text()
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 120, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        streams = [post(url, body), post(url, {**body, "prompt": [8, 9, 10]})]  # the least loaded: one each
        for st in streams:
            st.readline()
        os.kill(rank_pids(proc.pid)[0], signal.SIGTERM)  # as a process manager stops a server
        for st in streams:
            events = [json.loads(line[6:]) for line in st if line.startswith(b"data: {")]
            assert events[-1]["choices"][0]["finish_reason"] == "abort", events[-1]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert all(f"[tpengine rank {r}/2] server stopped (exit 0)" in text for r in (0, 1))


def test_server_whose_replica_rank_dies_answers_503_and_exits_non_zero(setup, tmp_path):
    """A stream on each replica; replica 1's rank killed: both streams end with a 503 error event and
    [DONE], /health is 503 (or the server is gone), and the launch exits non-zero."""
    proc, url, log = start_server(setup, tmp_path, "--dist-timeout-s", "10")
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 120, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        streams = [post(url, body), post(url, {**body, "prompt": [8, 9, 10]})]  # the least loaded: one each
        for s in streams:
            s.readline()
        os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)
        for s in streams:
            events = [line.decode() for line in s if line.startswith(b"data: ")]
            errors = [json.loads(e[6:])["error"] for e in events if '"error"' in e]
            assert events[-1] == "data: [DONE]\n" and [e["code"] for e in errors] == [503], events[-3:]
        assert proc.wait(30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "[tpengine rank 0] engine loop failed: " in log.read_text(), log.read_text()[-3000:]
