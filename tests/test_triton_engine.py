"""The engine with ``attention_backend="triton"`` gives the same greedy tokens as the torch
reference backend, on tiny random Llama and Qwen3 models at tp 1 and 2, and on a Gemma 2 (a sliding
window of 8 on every other layer, attention and final soft caps, its four norms) in the chunked job.

Without CUDA the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``, set here
before triton is imported and passed to the torchrun workers), in float32. Prompts of 5, 17 and
33 tokens with block size 16 give one-, two- and three-block contexts; the "join" job
(max_num_seqs 2, the first request stops after 3 tokens) prefills the third prompt between decode
steps of the second, so decode batches change size; the "chunked" job prefills it in chunks of
16 beside the second one's decodes (the prefill kernel over a cached prefix). Also on CPU: the
CUDA-graph runner's padded static buffers, run eagerly inside the engine, give the same tokens.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from conftest import make_tiny_model
from launch import run_engine_jobs

from tpengine.backends.cuda.graphs import CUDAGraphRunner, graph_batch_sizes
from tpengine.config import EngineConfig

INTERP = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}
LENGTHS = (5, 17, 33)
MODELS = ("llama", "qwen3")
FAMILY_JOBS = {"gemma2": ("chunked",)}  # another family through the kernels' window and cap, one job
BACKENDS = ("torch", "triton")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 1001, (n,), generator=g).tolist() for n in LENGTHS]


def requests(max_tokens=(8, 8, 8)) -> list:
    return [[f"p{i}", p, {"temperature": 0.0, "max_tokens": m, "ignore_eos": True}]
            for i, (p, m) in enumerate(zip(prompts(), max_tokens))]


def cfg(model_dir, backend: str, **kw) -> dict:
    return {"model": str(model_dir), "attention_backend": backend, "dtype": "float32", "max_model_len": 64,
            "block_size": 16, "max_num_batched_tokens": 256, "num_kv_blocks": 32, **kw}


JOBS = {  # name -> (extra config, request max_tokens)
    "together": ({}, (8, 8, 8)),
    "join": ({"max_num_seqs": 2}, (3, 8, 8)),
    # chunked prefill: p2's 33 tokens in chunks of <= 16 after a cached part, with p1's decodes in
    # the same (mixed) steps as one-token prefills
    "chunked": ({"max_num_seqs": 2, "max_num_batched_tokens": 16}, (3, 8, 8)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-engine-models")
    return {"llama": make_tiny_model(root, "llama", seed=5, name="llama"),
            "qwen3": make_tiny_model(root, "qwen3", seed=5, name="qwen3", head_dim=32, random_biases=True),
            "gemma2": make_tiny_model(root, "gemma2", seed=5, name="gemma2", random_biases=True)}


@pytest.fixture(scope="module")
def results(models, tmp_path_factory):
    """{tp: {"model/backend/job": {request_id: token_ids}}}, one torchrun launch per tp."""
    tmp = tmp_path_factory.mktemp("triton-engine-runs")
    runs = [(m, j) for m in MODELS for j in JOBS] + [(m, j) for m, js in FAMILY_JOBS.items() for j in js]
    jobs = [{"key": f"{m}/{b}/{j}", "config": cfg(models[m], b, **JOBS[j][0]), "requests": requests(JOBS[j][1])}
            for m, j in runs for b in BACKENDS]
    out = {}
    for tp in (1, 2):
        r = run_engine_jobs(tmp, tp, jobs, tag="triton", env=INTERP)
        out[tp] = {k: {o["request_id"]: o["token_ids"] for o in v["outputs"]} for k, v in r.items()}
        assert r["llama/triton/join"]["stats"]["prefill_steps"] >= 2  # p2 prefilled between decodes
        assert r["llama/triton/chunked"]["stats"]["prefill_steps"] >= 4  # 5 + 17 + 33 tokens in chunks of 16
    return out


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("model,job", [(m, j) for m in MODELS for j in JOBS]
                         + [(m, j) for m, js in FAMILY_JOBS.items() for j in js])
def test_triton_engine_equals_torch(results, model, tp, job):
    r = results[tp]
    want, got = r[f"{model}/torch/{job}"], r[f"{model}/triton/{job}"]
    assert sorted(want) == ["p0", "p1", "p2"]
    assert [len(want[f"p{i}"]) for i in range(3)] == list(JOBS[job][1])
    assert got == want


def test_graph_runner_padding_in_engine(models, results):
    """tp=1, in process: decode steps go through CUDAGraphRunner's static buffers, padded to the
    bucket sizes (3 sequences -> 4 rows), run eagerly; tokens equal the torch backend's."""
    from tpengine.engine.llm_engine import LLMEngine
    from tpengine.sampling_params import SamplingParams

    for job, (extra, max_tokens) in JOBS.items():
        engine = LLMEngine(EngineConfig(**cfg(models["llama"], "triton", **extra)))
        try:
            r = engine.runner
            r.graphs = CUDAGraphRunner(r.model, r.backend, engine.config.max_num_seqs, 4, r.shard_plan.hidden_size,
                                       r.dtype, r.tp.device, use_graphs=False)
            sizes, run = [], r.graphs.run
            r.graphs.run = lambda ids, *t, sizes=sizes, run=run: sizes.append(len(ids)) or run(ids, *t)
            outs = engine.generate([(rid, ids, SamplingParams(**p)) for rid, ids, p in requests(max_tokens)])
        finally:
            engine.shutdown()
        assert {o.request_id: o.token_ids for o in outs} == results[1][f"llama/torch/{job}"]
        assert 3 in sizes if job == "together" else {1, 2} <= set(sizes)


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def test_auto_dtype():
    import torch

    c = EngineConfig()
    assert c.dtype == "auto"
    assert c.torch_dtype("cpu") is torch.float32 and c.torch_dtype(torch.device("cuda", 0)) is torch.bfloat16
    assert EngineConfig(dtype="float16").torch_dtype("cuda") is torch.float16
    assert EngineConfig(dtype="float32").torch_dtype("cuda") is torch.float32
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="fp8")
