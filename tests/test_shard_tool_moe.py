"""tpengine-shard on mixture-of-experts models (issue 56): ``split --enable-expert-parallel`` writes each rank
only its whole experts (8 experts on 3 ranks: 3, 3, 2), ``split`` without it each expert's slice; ``verify``
checks them (and names a rank file holding another rank's expert); ``info`` gives each rank's bytes, equal to
what its file holds; the refusals; and end to end, a Mixtral GGUF converted, split for expert parallelism and
run by the engine at 2 ranks gives HF's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import SMOLLM2_DIR, make_tiny_model
from safetensors.torch import load_file
from test_convert_moe import make_moe_model, write_moe_gguf
from test_shard_tool import cli, original_tensors

from shard_tool.info import rank_bytes, weight_shapes
from tpengine.model.checkpoint import rank_file_name
from tpengine.model.plan import ShardPlan


def rank_files(out: Path, tp: int) -> list[dict[str, torch.Tensor]]:
    return [load_file(out / rank_file_name(r, tp)) for r in range(tp)]


def experts_in(tensors: dict) -> set[int]:
    return {int(n.split(".experts.")[1].split(".")[0]) for n in tensors if ".experts." in n}


def test_split_expert_parallel_verify_info(tmp_path: Path) -> None:
    """Mixtral at 3 ranks, expert parallel: rank r's file holds experts 0-2, 3-5 or 6-7 whole, under
    tpengine's names, each equal to the checkpoint's ``w1``/``w3``/``w2``; the router whole on every rank;
    verify passes, and names the expert when two rank files are swapped; info's bytes per rank are the
    files' tensor bytes."""
    from transformers import AutoConfig

    src = make_tiny_model(tmp_path, "mixtral", seed=3)
    out = tmp_path / "ep3"
    r = cli("split", src, "--tp", 3, "--out", out, "--enable-expert-parallel")
    assert r.exit_code == 0, r.output
    orig = original_tensors(src)
    files = rank_files(out, 3)
    ntensors = sorted(len(f) for f in files)
    assert r.output.strip() == (f"wrote 3 rank files ({ntensors[0]}-{ntensors[-1]} tensors each, float32) and "
                                f"manifest.json to {out}")
    plan = ShardPlan.from_dict(json.loads((out / "manifest.json").read_text())["plan"])
    assert plan.expert_parallel and [rp.experts for rp in plan.ranks] == [(0, 3), (3, 6), (6, 8)]
    for (lo, hi), got in zip(((0, 3), (3, 6), (6, 8)), files):
        assert experts_in(got) == set(range(lo, hi))
        for i in range(2):
            router = orig[f"model.layers.{i}.block_sparse_moe.gate.weight"]
            assert torch.equal(got[f"model.layers.{i}.mlp.gate.weight"], router)
            for e in range(lo, hi):
                for hf, ours in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                    want = orig[f"model.layers.{i}.block_sparse_moe.experts.{e}.{hf}.weight"]
                    assert torch.equal(got[f"model.layers.{i}.mlp.experts.{e}.{ours}.weight"], want)
        assert not any("block_sparse_moe" in n for n in got)

    r = cli("verify", out)
    assert r.exit_code == 0 and r.output.startswith("OK: "), r.output
    config = AutoConfig.from_pretrained(src)
    held = [sum(t.numel() * t.element_size() for t in f.values()) for f in files]
    assert rank_bytes(plan, weight_shapes(config), "float32") == held
    r = cli("info", src, "--tp", 3, "--enable-expert-parallel")
    assert r.exit_code == 0 and all(str(b) in r.output for b in held), r.output
    assert "experts whole per rank (expert parallel)" in r.output

    # rank 0's and rank 2's files (and their manifest entries) swapped: each holds the other's experts
    m = json.loads((out / "manifest.json").read_text())
    a, b = out / rank_file_name(0, 3), out / rank_file_name(2, 3)
    a.rename(tmp_path / "x")
    b.rename(a)
    (tmp_path / "x").rename(b)
    for e in m["shard_files"]:
        e["name"] = {a.name: b.name, b.name: a.name}.get(e["name"], e["name"])
    m["tensors"]["0"], m["tensors"]["2"] = m["tensors"]["2"], m["tensors"]["0"]
    (out / "manifest.json").write_text(json.dumps(m))
    r = cli("verify", out)
    assert r.exit_code == 1
    assert (f"error: {a.name}: tensor model.layers.0.mlp.experts.6.down_proj.weight is expert 6's, which the plan "
            "gives to rank 2") in r.output


def test_split_tensor_parallel_experts_reassemble(tmp_path: Path) -> None:
    """Qwen3-MoE at 2 ranks without expert parallelism: every rank holds every expert, gate/up by rows and
    down by columns of the expert's intermediate, which concatenate back to the checkpoint's; the dense
    layer (``mlp_only_layers``) split as any MLP; verify passes."""
    src = make_tiny_model(tmp_path, "qwen3_moe", seed=2, intermediate_size=96)
    out = tmp_path / "tp2"
    r = cli("split", src, "--tp", 2, "--out", out)
    assert r.exit_code == 0, r.output
    orig, files = original_tensors(src), rank_files(out, 2)
    assert sorted(files[0]) == sorted(files[1]) == sorted(orig)
    for name, t in orig.items():
        if ".experts." in name:
            dim = 1 if ".down_proj." in name else 0
            assert files[0][name].shape[dim] == 16 and torch.equal(torch.cat([f[name] for f in files], dim), t), name
    dense = "model.layers.1.mlp.gate_proj.weight"
    assert torch.equal(torch.cat([f[dense] for f in files], 0), orig[dense])
    r = cli("verify", out)
    assert r.exit_code == 0, r.output


def test_more_ranks_than_experts_is_one_error_line(tmp_path: Path) -> None:
    """More ranks than experts under expert parallelism: one error line, nothing written."""
    two = make_tiny_model(tmp_path, "mixtral", num_local_experts=2)
    r = cli("split", two, "--tp", 3, "--out", tmp_path / "o", "--enable-expert-parallel")
    assert r.exit_code == 2 and r.output.strip() == (
        "error: model_type 'mixtral': enable_expert_parallel puts whole experts on each of the 3 ranks, but the "
        "model has 2 experts per layer; use at most 2 ranks, or tensor parallelism for the experts (without "
        "--enable-expert-parallel)")
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(not (SMOLLM2_DIR / "tokenizer.json").is_file(), reason="needs the SmolLM2 tokenizer")
def test_gguf_to_expert_parallel_shards_equal_hf(tmp_path: Path) -> None:
    """A Mixtral GGUF converted (``convert``) runs at 2 ranks as HF runs the original, token for token in
    float32, and so does its ``split --enable-expert-parallel`` shard folder under ``--enable-expert-parallel``;
    its ``split --quantize int8 --enable-expert-parallel`` folder (verified) gives the tokens of
    ``--quantization int8`` on the full folder (one launch, four engines)."""
    from hf_reference import greedy
    from launch import run_engine_jobs

    src = make_moe_model(tmp_path, "mixtral")
    converted, shards = tmp_path / "converted", tmp_path / "converted-tp2"
    assert cli("convert", write_moe_gguf(src, tmp_path / "tiny.gguf"), converted).exit_code == 0
    assert cli("split", converted, "--tp", 2, "--out", shards, "--enable-expert-parallel").exit_code == 0
    int8 = tmp_path / "int8-tp2"
    r = cli("split", converted, "--tp", 2, "--out", int8, "--enable-expert-parallel", "--quantize", "int8")
    assert r.exit_code == 0, r.output
    assert cli("verify", int8).exit_code == 0
    table = json.loads((int8 / "manifest.json").read_text())["quantization"]["weights"]
    assert sum(".experts." in n for n in table) == 2 * 4 * 3  # every expert's three weights, per expert
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1001, (n,), generator=g).tolist() for n in (6, 19, 2)]
    want = greedy(src, prompts, 8, stop_at_eos=False, attn="eager", batched=False)
    sp = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    reqs = [[f"p{i}", p, sp] for i, p in enumerate(prompts)]
    base = {"dtype": "float32", "max_model_len": 64, "kv_cache_gb": 0.02, "cpu_linear": "plain"}
    jobs = [{"key": "converted", "config": {**base, "model": str(converted)}, "requests": reqs},
            {"key": "ep", "config": {**base, "model": str(shards), "enable_expert_parallel": True},
             "requests": reqs},
            {"key": "int8-shards", "config": {**base, "model": str(int8), "enable_expert_parallel": True},
             "requests": reqs},
            {"key": "int8-load", "config": {**base, "model": str(converted), "enable_expert_parallel": True,
                                            "quantization": "int8"}, "requests": reqs}]
    res = run_engine_jobs(tmp_path, 2, jobs)
    def tokens(key: str) -> list[list[int]]:
        got = {o["request_id"]: o["token_ids"] for o in res[key]["outputs"]}
        return [got[f"p{i}"] for i in range(len(prompts))]

    assert tokens("converted") == tokens("ep") == want
    assert tokens("int8-shards") == tokens("int8-load") and all(len(t) == 8 for t in tokens("int8-load"))

    # half the experts whole (EP) or half of every expert (TP): the same bytes on each rank, loaded from
    # rank files that hold only those experts
    assert res["ep"]["weight_bytes"] == res["converted"]["weight_bytes"]
