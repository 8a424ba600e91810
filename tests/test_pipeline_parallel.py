"""Pipeline parallelism (issue 57): ``--pipeline-parallel-size P`` stages of ``--tensor-parallel-size T``
ranks. The layer split (vLLM's rule, or ``--pp-layer-partition``); greedy float32 records at P=2 x T=2
(4 processes) and P=3 with an uneven split (3 processes) equal one process's id for id through the
batch job; through ``LLM`` at P=2 (2 processes), with tied embeddings, prompt logprobs, seeded sampling
and n-gram speculation, every rank gets tp=1's outputs; the server at P=2 answers as one process; two
launches as two nodes, one stage each, and a killed rank of the last stage ends both within seconds,
``--resume`` completing the job; the refusals name the feature."""

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
from conftest import SMOLLM2_DIR, make_tiny_model
from launch import START_TIMEOUT, cli, command, free_port, node_command, popen, torchrun
from test_cli import records, write_jsonl
from test_orphans import rank_pids

from tpengine import LLM, SamplingParams
from tpengine.config import EngineConfig, parallel_sizes
from tpengine.errors import UserError
from tpengine.model.plan import ShardPlan

SETTINGS = ["--max-model-len", "128", "--num-kv-blocks", "256", "--block-size", "4", "--max-num-seqs", "4",
            "--dtype", "float32"]
ENGINE = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 256, "block_size": 4, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Two tiny 5-layer models (untied; tied embeddings), the prompts as a request file, and the
    reference records (one process)."""
    tmp = tmp_path_factory.mktemp("pp")
    model = make_tiny_model(tmp, name="tiny", hidden_size=96, num_attention_heads=6, num_hidden_layers=5)
    tied = make_tiny_model(tmp, name="tied", hidden_size=96, num_attention_heads=6, num_hidden_layers=5,
                           tie_word_embeddings=True, seed=1)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(3, 20))] for _ in range(8)]
    lines = write_jsonl(tmp / "in.jsonl", [
        {"id": f"r{i}", "prompt_token_ids": p, "max_tokens": 1 + i % 12, "temperature": 0, "ignore_eos": True}
        for i, p in enumerate(prompts)])
    ref = tmp / "ref.jsonl"
    cli(["--prompts", lines, "--model", model, "--out", ref, *SETTINGS, "--threads", "1"])
    return {"model": model, "tied": tied, "prompts": prompts, "lines": lines, "ref": records(ref), "tmp": tmp}


def tokens(recs: dict) -> dict[str, list[int]]:
    return {rid: r["token_ids"] for rid, r in recs.items()}


def test_stages_split_the_layers_as_vllm_and_as_given():
    assert ShardPlan.split_layers(22, 3) == ((0, 7), (7, 15), (15, 22))  # vLLM: the extra layer before the last
    assert ShardPlan.split_layers(10, 4) == ((0, 2), (2, 5), (5, 8), (8, 10))
    assert ShardPlan.split_layers(5, 3, [1, 3, 1]) == ((0, 1), (1, 4), (4, 5))
    assert ShardPlan.split_layers(5, 1) == ()
    with pytest.raises(UserError, match=r"^pp_layer_partition='1,1,1' holds 3 layers, but the model has 5; the "
                                        r"counts must sum to 5$"):
        ShardPlan.split_layers(5, 3, [1, 1, 1])
    with pytest.raises(UserError, match=r"^pipeline_parallel_size=6 is more stages than the model's 5 layers; "
                                        r"use at most 5$"):
        ShardPlan.split_layers(5, 6)
    plan = ShardPlan.from_dict(json.loads(json.dumps(ShardPlan.build(_Config(), 2, pp_size=3).to_dict())))
    assert plan.pp_size == 3 and plan.stages == ((0, 2), (2, 4), (4, 5)) and plan.stage_layers(2, 5) == (4, 5)
    assert parallel_sizes(8, 1, None, 2) == (1, 4) and parallel_sizes(8, 2, 2, 2) == (2, 2)
    with pytest.raises(UserError) as e:
        parallel_sizes(6, 1, 2, 2)
    assert str(e.value) == (
        "data_parallel_size=1 x pipeline_parallel_size=2 x tensor_parallel_size=2 does not fit the world size 6 "
        "(torchrun's --nnodes x --nproc_per_node): it must be data_parallel_size x pipeline_parallel_size x "
        "tensor_parallel_size (1 x 2 x 3, 3 x 2 x 1), or launch 4 rank(s) for these sizes")


def test_split_plan_gives_micro_batches_of_whole_sequences_and_their_result_rows():
    """Three sequences (a 3-token prefill chunk asking prompt logprobs, a decode row, a decode row with two
    speculative tokens) in 2 micro-batches: each sub-plan's rows are its sequences' own, re-based, and the
    rows map back to the whole plan's result order (sampled, prompt, speculative)."""
    import torch

    from tpengine.engine.step import StepKind, StepPlan, split_plan

    t = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    plan = StepPlan(StepKind.PREFILL, step=7, input_ids=t(1, 2, 3, 4, 5, 6, 7), positions=t(0, 1, 2, 9, 4, 5, 6),
                    slot_mapping=t(0, 1, 2, 13, 20, 21, 22), block_tables=t(0, 3, 5).view(3, 1),
                    cu_seqlens_q=t(0, 3, 4, 7), cu_seqlens_k=t(0, 3, 10, 17), context_lens=t(3, 10, 7),
                    sample_idx=t(2, 3, 6), prompt_idx=t(0, 1), spec_idx=t(4, 5), greedy=True)
    (a, rows_a), (b, rows_b) = split_plan(plan, 2)
    assert a.input_ids.tolist() == [1, 2, 3, 4] and b.input_ids.tolist() == [5, 6, 7]
    assert a.cu_seqlens_q.tolist() == [0, 3, 4] and a.cu_seqlens_k.tolist() == [0, 3, 10]
    assert b.cu_seqlens_q.tolist() == [0, 3] and b.cu_seqlens_k.tolist() == [0, 7] and b.block_tables.tolist() == [[5]]
    assert (a.sample_idx.tolist(), a.prompt_idx.tolist(), a.spec_idx.tolist()) == ([2, 3], [0, 1], [])
    assert (b.sample_idx.tolist(), b.prompt_idx.tolist(), b.spec_idx.tolist()) == ([2], [], [0, 1])
    assert rows_a.tolist() == [0, 1, 3, 4] and rows_b.tolist() == [2, 5, 6] and a.step == b.step == 7 and b.greedy
    assert [r.tolist() for _, r in split_plan(plan, 1)] == [[0, 1, 2, 3, 4, 5, 6]]


def pp_llm_params(p: dict) -> SamplingParams:
    """The worker's ``SamplingParams`` of ``p`` (tests/workers/pp_llm.py)."""
    from tpengine.structured import StructuredOutputsParams

    if p.get("structured_outputs") is not None:
        p = {**p, "structured_outputs": StructuredOutputsParams(**p["structured_outputs"])}
    return SamplingParams(**p)


class _Config:
    """A tiny config for the plan alone (no transformers)."""

    model_type, num_attention_heads, num_key_value_heads, hidden_size = "llama", 6, 2, 96
    intermediate_size, vocab_size, num_hidden_layers = 100, 1001, 5


def test_the_features_that_do_not_run_in_stages_are_refused_by_name(setup):
    with pytest.raises(ValueError, match=r"^invalid pipeline_parallel_size=0: must be an integer >= 1$"):
        EngineConfig(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match=r"^invalid pp_layer_partition='2,x': must be 2 positive layer counts "
                                         r"separated by commas, one per stage \(pipeline_parallel_size=2\), "
                                         r"e.g. '4,4'$"):
        EngineConfig(pipeline_parallel_size=2, pp_layer_partition="2,x")
    with pytest.raises(ValueError, match=r"^invalid runner='pooling' with pipeline_parallel_size > 1: pooling does "
                                         r"not run across pipeline stages in this version$"):
        EngineConfig(pipeline_parallel_size=2, runner="pooling")
    with pytest.raises(ValueError, match=r"^invalid speculative_config with method 'draft_model' and "
                                         r"pipeline_parallel_size > 1: a draft model does not run across pipeline "
                                         r"stages in this version \(ngram does\)$"):
        EngineConfig(pipeline_parallel_size=2, speculative_config={"method": "draft_model", "model": "x",
                                                                    "num_speculative_tokens": 2})
    r = cli(["--prompts", setup["lines"], "--model", setup["model"], "--pipeline-parallel-size", "2"], check=False)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "error: data_parallel_size=1 x pipeline_parallel_size=2 does not fit the world size 1 (torchrun's --nnodes "
        "x --nproc_per_node): it must be data_parallel_size x pipeline_parallel_size x tensor_parallel_size "
        "(none), or launch 2 rank(s) for these sizes")


def test_job_records_equal_one_process_at_pp2_x_tp2_and_pp3_uneven(setup, tmp_path):
    """P=2 x T=2 (4 processes: the stages' TP groups all-reduce in shared memory) and P=3 split 1,3,1:
    the records equal one process's id for id; the loading line names the layout."""
    ref = tokens(setup["ref"])
    common = ["--prompts", setup["lines"], "--model", setup["model"], *SETTINGS, "--threads", "1"]
    for nproc, flags, layout in (
            (4, ["--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"], "pp 2 x tp 2"),
            (3, ["--pipeline-parallel-size", "3", "--pp-layer-partition", "1,3,1"], "pp 3 x tp 1")):
        out, summary = tmp_path / f"out-{nproc}.jsonl", tmp_path / f"summary-{nproc}.json"
        r = cli([*common, *flags, "--out", out, "--summary-json", summary], tp=nproc)
        assert tokens(records(out)) == ref, flags
        assert len(json.loads(summary.read_text())["peak_rss_bytes"]) == nproc
        assert f"({layout}, dtype float32) ..." in r.stderr, r.stderr[-2000:]


def test_llm_at_pp2_equals_one_process(setup, tmp_path):
    """Under torchrun at world size 2, LLM(pipeline_parallel_size=2) on the untied model (greedy with top-2
    logprobs and prompt logprobs: the logits rows cross the stages; seeded sampling; n-gram speculation),
    on the tied one (the embedding on both ends) and, with SmolLM2's tokenizer, on a model of its vocabulary
    (choice and regex outputs: the driver's bitmask reaches the last stage), and on Gemma 3 with a sliding
    layer alone in stage 0 and a full one in stage 1 (the stages agree the driver keeps every block): every
    rank's outputs equal tp=1's in this process; then the first of them at PP=2 x TP=2 (4 processes)."""
    prompts = setup["prompts"][:4]
    params = [dict(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1),
              dict(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True),
              dict(temperature=0.0, max_tokens=10, ignore_eos=True),
              dict(temperature=0.0, max_tokens=10, ignore_eos=True)]
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    jobs = [{"model": str(setup["model"]), "engine": ENGINE, "prompts": prompts, "params": params},
            {"model": str(setup["model"]), "engine": {**ENGINE, "speculative_config": ngram},
             "prompts": [p * 2 for p in prompts], "params": params[2:] * 2},
            {"model": str(setup["tied"]), "engine": ENGINE, "prompts": prompts, "params": params}]
    if SMOLLM2_DIR.is_dir():  # structured outputs (the tokenizer's vocabulary): the bitmask reaches the last stage
        choice = {"choice": ["yes", "no", "maybe"]}
        jobs.append({"model": str(make_tiny_model(tmp_path, name="tiny49k", vocab_size=49152, num_hidden_layers=3)),
                     "engine": ENGINE, "prompts": prompts,
                     "params": [{"temperature": 0.0, "max_tokens": 6, "structured_outputs": choice},
                                {"temperature": 0.0, "max_tokens": 8, "structured_outputs": {"regex": "[0-9]{3}x"}},
                                *params[2:]]})
    # Gemma 3 split 1,1: stage 0 holds only a sliding layer, stage 1 a full one; the driver keeps every block
    gemma = make_tiny_model(tmp_path, "gemma3_text", name="gemma3", num_hidden_layers=2)
    long = [[3 + (7 * i + j) % 200 for j in range(30)] for i in range(2)]
    jobs.append({"model": str(gemma), "engine": ENGINE, "pp": {"pp_layer_partition": "1,1"}, "prompts": long,
                 "params": [dict(temperature=0.0, max_tokens=12, ignore_eos=True)] * 2})
    want = []
    for job in jobs:
        with LLM(job["model"], **job["engine"]) as llm:
            outs = llm.generate(job["prompts"], [pp_llm_params(p) for p in job["params"]])
        want.append([o.outputs[0] for o in outs] + [outs[0].prompt_logprobs])
    pp_jobs = [{**job, "engine": {**job["engine"], "pipeline_parallel_size": 2, **job.get("pp", {})}} for job in jobs]
    (tmp_path / "jobs.json").write_text(json.dumps(pp_jobs))
    torchrun("pp_llm.py", 2, [str(tmp_path / "jobs.json"), str(tmp_path)], env={"OMP_NUM_THREADS": "1"})
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for job, w, g in zip(jobs, want, got):
            assert [o["ids"] for o in g] == [c.token_ids for c in w[:-1]], (rank, job["model"])
            if not job["params"][0].get("logprobs"):
                continue
            first = {int(k): v for k, v in g[0]["logprobs"][0].items()}
            assert first == pytest.approx({k: v.logprob for k, v in w[0].logprobs[0].items()}, abs=1e-5)
            prompt = [None if d is None else {int(k): v for k, v in d.items()} for d in g[0]["prompt_logprobs"]]
            assert prompt[1:] == [pytest.approx({k: v.logprob for k, v in d.items()}, abs=1e-5) for d in w[-1][1:]]
    # PP=2 x TP=2 (4 processes): the first job's greedy ids and logprobs on every rank equal tp=1's
    grid = [{**jobs[0], "engine": {**jobs[0]["engine"], "pipeline_parallel_size": 2, "tensor_parallel_size": 2}}]
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid.json").write_text(json.dumps(grid))
    torchrun("pp_llm.py", 4, [str(tmp_path / "grid.json"), str(tmp_path / "grid")], env={"OMP_NUM_THREADS": "1"})
    for rank in range(4):
        g = json.loads((tmp_path / "grid" / f"rank{rank}.json").read_text())[0]
        assert [o["ids"] for o in g] == [c.token_ids for c in want[0][:-1]], rank
        first = {int(k): v for k, v in g[0]["logprobs"][0].items()}
        assert first == pytest.approx({k: v.logprob for k, v in want[0][0].logprobs[0].items()}, abs=1e-5)


def test_server_at_pp2_answers_as_one_process_and_stops_every_rank(setup, tmp_path):
    """``tpengine serve`` at P=2 (2 processes): concurrent completions equal the batch job's texts at one
    process; SIGTERM stops every rank with exit 0."""
    port, log = free_port(), tmp_path / "server.log"
    cmd = [*command("tpengine.serve", nproc=2, torchrun=True), "--port", str(port), "--model", str(setup["model"]),
           *SETTINGS, "--pipeline-parallel-size", "2", "--threads", "1"]
    proc = popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.3)
        texts: dict[str, str] = {}

        def complete(i: int) -> None:
            body = {"model": "tiny", "prompt": setup["prompts"][i], "max_tokens": 1 + i % 12, "temperature": 0.0,
                    "ignore_eos": True}
            req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            texts[f"r{i}"] = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["text"]

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert texts == {f"r{i}": setup["ref"][f"r{i}"]["text"] for i in range(4)}
        assert "(pp 2 x tp 1)" in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]


def test_two_nodes_one_stage_each_a_killed_stage_ends_both_and_resume_completes(setup, tmp_path):
    """Two launches on 127.0.0.1 as two nodes (``--nnodes 2 --nproc_per_node 1``), one stage each, one
    sequence a step; SIGKILL of stage 1's rank once two records are out: both launches end within seconds
    (the driver's transfer to the dead stage fails, well before ``dist_timeout_s``) with every rank gone;
    ``--resume`` at P=2 (one launch) completes every id once, and every record, the two nodes' too, equals
    one process's."""
    common = ["--prompts", setup["lines"], "--model", setup["model"], *SETTINGS, "--max-num-seqs", "1",
              "--dist-timeout-s", "30", "--pipeline-parallel-size", "2", "--threads", "1"]
    out, port = tmp_path / "out.jsonl", free_port()
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    procs = [popen(node_command("tpengine.run", [*common, "--out", out], node, port), stdout=subprocess.DEVNULL,
                   stderr=open(logs[node], "w")) for node in (0, 1)]
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not (out.exists() and out.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
            time.sleep(0.01)
        pids = [pid for p in procs for pid in rank_pids(p.pid).values()]
        os.kill(rank_pids(procs[1].pid)[1], signal.SIGKILL)  # stage 1's only rank
        killed = time.monotonic()
        assert all(p.wait(30) != 0 for p in procs)
        assert time.monotonic() - killed < 20, "the job outlived the dead stage by dist_timeout_s"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert len(pids) == 2 and all(not os.path.exists(f"/proc/{pid}") for pid in pids)
    assert 2 <= out.read_text().count("\n") < len(setup["ref"])
    cli([*common, "--out", out, "--resume"], tp=2)
    assert tokens(records(out)) == tokens(setup["ref"]) and out.read_text().count("\n") == len(setup["ref"])


def test_shard_tool_splits_stages_and_a_stage_loads_only_its_tensors(setup, tmp_path):
    """``split --pp 2 --tp 2`` writes 4 files, each only its stage's tensors (the tied model: the embedding in
    both stages' files); ``verify`` passes and names a tensor of the wrong stage; ``info --pp`` shows each
    rank's bytes; a stage's model loaded from its file equals the one sliced from the full folder; a
    launch of another layout is refused naming the fix."""
    import torch
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from shard_tool.cli import app
    from shard_tool.verify import verify_dir
    from tpengine.distributed import TPInfo
    from tpengine.model.checkpoint import sha256_file
    from tpengine.model.loader import load_model
    from tpengine.model.shard_folder import CheckpointMismatchError
    from tpengine.model.spec import ModelSpec

    out = tmp_path / "tied-pp2-tp2"
    r = CliRunner().invoke(app, ["split", str(setup["tied"]), "--pp", "2", "--tp", "2", "--out", str(out)])
    assert r.exit_code == 0 and r.output.startswith("wrote 4 rank files (2 stages x 2 ranks) "), r.output
    assert verify_dir(out) == []
    m = json.loads((out / "manifest.json").read_text())
    assert m["pp_size"] == 2 and m["plan"]["stages"] == [[0, 3], [3, 5]]
    assert [(f["name"], f["stage"], f["rank"]) for f in m["shard_files"]] == [
        (f"rank-0{e}-of-04.safetensors", e // 2, e % 2) for e in range(4)]
    names = {e: set(m["tensors"][str(e)]) for e in range(4)}
    assert names[0] == names[1] and names[2] == names[3]
    assert {n.split(".")[2] for n in names[0] if n.startswith("model.layers.")} == {"0", "1", "2"}
    assert {n.split(".")[2] for n in names[2] if n.startswith("model.layers.")} == {"3", "4"}
    assert "model.embed_tokens.weight" in names[0] & names[2]  # tied: the head's weight on the last stage
    assert "model.norm.weight" in names[2] - names[0] and not any("lm_head" in n for n in names[2])
    info = CliRunner().invoke(app, ["info", str(setup["tied"]), "--tp", "2", "--pp", "2"]).output
    rows = [line.split() for line in info.splitlines() if line.split()[:2] in (["0", "0"], ["1", "1"])]
    assert rows[0][:5] == ["0", "0", "0", "0:3", "embedding"] and rows[1][:4] == ["1", "1", "3", "3:5"]
    assert int(rows[0][-2]) == sum(load_file(out / "rank-00-of-04.safetensors")[n].numel() * 4 for n in names[0])
    for e in (1, 2):  # a stage's model from its file equals the one sliced from the full folder
        tp = TPInfo(e % 2, 2, 0, torch.device("cpu"), pp_rank=e // 2, pp_size=2)
        split = load_model(ModelSpec.from_config(out, ModelSpec.read_config(out), tp), tp, cpu_kernels=False).module
        full = load_model(ModelSpec.from_config(setup["tied"], ModelSpec.read_config(setup["tied"]), tp), tp,
                          cpu_kernels=False).module
        a, b = dict(split.named_parameters()), dict(full.named_parameters())
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert len(split.model.layers) == (3 if e < 2 else 2) and (split.lm_head is None) == (e < 2)
    with pytest.raises(CheckpointMismatchError, match=r"was split into 2 pipeline stages of 3,2 layers, but this "
                                                      r"launch has pipeline_parallel_size=1; launch with "
                                                      r"--pipeline-parallel-size 2 --pp-layer-partition 3,2, or "
                                                      r"re-shard with: tpengine-shard split <full HF model folder> "
                                                      r"--tp 2 --out <new folder>$"):
        ModelSpec.from_config(out, ModelSpec.read_config(out), TPInfo(0, 2, 0, torch.device("cpu")))
    bad = load_file(out / "rank-02-of-04.safetensors")
    bad["model.layers.0.input_layernorm.weight"] = bad["model.layers.3.input_layernorm.weight"].clone()
    save_file(bad, out / "rank-02-of-04.safetensors")
    m["shard_files"][2]["sha256"] = sha256_file(out / "rank-02-of-04.safetensors")  # a consistent manifest
    listed = m["tensors"]["2"]
    listed["model.layers.0.input_layernorm.weight"] = listed["model.layers.3.input_layernorm.weight"]
    (out / "manifest.json").write_text(json.dumps(m))
    assert "rank-02-of-04.safetensors: tensor model.layers.0.input_layernorm.weight is not stage 1's (layers " \
           "(3, 5))" in verify_dir(out)
