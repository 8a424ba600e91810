"""Smoke tests of ``python -m benchmarks.bench_scale`` on tiny random models, and the synth-model
build: it writes the shapes, files and index it should, once, file by file."""

from __future__ import annotations

import json

import launch
import torch
from conftest import SMOLLM2_DIR
from typer.testing import CliRunner

import benchmarks


def test_synth_model_is_built_once_file_by_file(tmp_path):
    from safetensors import safe_open

    from benchmarks.synth_model import SHAPES, build_synth_model

    info = build_synth_model("tiny", tmp_path, SMOLLM2_DIR, layers_per_file=1)
    path = tmp_path / "synth-tiny"
    assert info["built"] and info["path"] == str(path) and info["files"] == 4  # embed, 2 x 1 layer, norm + head
    assert info["params"] == 1024 * 64 * 2 + 2 * (64 * 2 + 64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3) + 64
    assert info["weight_bytes"] == 2 * info["params"]
    config = json.loads((path / "config.json").read_text())
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim",
                                   "tie_word_embeddings", "dtype", "model_type")} == {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 512, "head_dim": 16,
        "tie_word_embeddings": False, "dtype": "bfloat16", "model_type": "llama"}
    assert (path / "tokenizer.json").read_bytes() == (SMOLLM2_DIR / "tokenizer.json").read_bytes()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    expected = SHAPES["tiny"].tensors()
    assert set(index["weight_map"]) == set(expected) and len(expected) == 2 + 2 * 9 + 1
    assert index["metadata"]["total_size"] == info["weight_bytes"]
    assert index["weight_map"]["model.embed_tokens.weight"] == "model-00001-of-00004.safetensors"
    assert index["weight_map"]["model.layers.1.mlp.down_proj.weight"] == "model-00003-of-00004.safetensors"
    assert index["weight_map"]["lm_head.weight"] == "model-00004-of-00004.safetensors"
    for fname in set(index["weight_map"].values()):
        with safe_open(str(path / fname), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                assert index["weight_map"][name] == fname and tuple(t.shape) == expected[name], name
                assert t.dtype == torch.bfloat16, name
                if name.endswith("norm.weight"):
                    assert bool((t == 1).all()), name
                else:
                    assert 0.015 < float(t.float().std()) < 0.025, name
    again = build_synth_model("tiny", tmp_path, SMOLLM2_DIR, layers_per_file=1)
    assert not again["built"] and again["files"] == 4 and again["build_s"] == 0.0


def test_bench_scale_smoke(tmp_path, monkeypatch):
    """The benchmark end to end (build, hf / tp1 / tp2 workers, table, JSON); its workers start through
    the suite's fork server, as test_bench's do (what they run is unchanged; this checks the records,
    not the figures: a forked worker's peak memory counts the pages it shares with the server)."""
    from benchmarks.bench_scale import app as scale_app

    real = benchmarks.launcher
    monkeypatch.setattr(benchmarks, "launcher", lambda tp, module: launch.forked(real(tp, module)))

    out = tmp_path / "scale.json"
    args = ["--shapes", "tiny", "--models-dir", str(tmp_path / "models"), "--tokenizer-dir", str(SMOLLM2_DIR),
            "--requests", "2", "--prompt-len", "8", "--output-len", "4", "--out", str(out)]
    r = CliRunner().invoke(scale_app, args, terminal_width=200)
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "tpengine tp=2" in r.output and "HF generate" in r.output and "built" in r.output
    res = json.loads(out.read_text())
    assert {"config", "machine", "shapes", "results", "total_s"} <= set(res)
    assert res["config"]["systems"] == ["hf", "tp1", "tp2"] and res["config"]["kv_cache_gb"] == 0.25
    assert res["shapes"]["tiny"]["built"] and res["shapes"]["tiny"]["build_peak_rss_bytes"] > 0
    rows = res["results"]["tiny"]
    assert set(rows) == {"hf", "tp1", "tp2"}
    for s, row in rows.items():
        assert row["status"] == "ok", (s, row)
        for key in ("load_s", "ttft_ms", "tpot_ms", "output_tok_s", "elapsed_s"):
            assert row[key] > 0, (s, key)
        assert row["output_tokens"] == 2 * 4 and row["prompt_tokens"] == 2 * 8
        assert [k["rank"] for k in row["ranks"]] == list(range(row["tp"]))
        for k in row["ranks"]:
            assert k["peak_rss_bytes"] >= k["load_peak_rss_bytes"] > 0 and k["weight_bytes"] > 0
            assert k["budget_bytes"] == k["weight_bytes"] + k["kv_bytes"] + 2**30
            assert k["within_budget"] == (k["peak_rss_bytes"] <= k["budget_bytes"])
    assert rows["hf"]["tp"] == 1 and rows["tp1"]["tp"] == 1 and rows["tp2"]["tp"] == 2
    # batch x tokens x (K, V) x layers x KV heads x head_dim x 2 bytes
    assert rows["hf"]["ranks"][0]["kv_bytes"] == 2 * (8 + 4) * 2 * 2 * 2 * 16 * 2
    assert rows["tp1"]["ranks"][0]["kv_bytes"] == 2**30 // 4  # --kv-cache-gb 0.25 per rank
    tp1_w, tp2_w = rows["tp1"]["ranks"][0]["weight_bytes"], rows["tp2"]["ranks"][0]["weight_bytes"]
    assert tp2_w < tp1_w  # each rank holds its shard


def test_bench_scale_rejects_bad_options(tmp_path):
    from benchmarks.bench_scale import app as scale_app

    cases = [(["--shapes", "tiny,gpt-5"], "--shapes 'gpt-5' is not one of tinyllama-1.1b, llama-2-7b, tiny"),
             (["--systems", "tp3"], "--systems 'tp3' is not one of hf, tp1, tp2"),
             (["--prompt-len", "500", "--output-len", "20"],
              "--prompt-len 500 + --output-len 20 exceeds --max-model-len 512"),
             (["--output-len", "1"], "--output-len 1 >= 2"),
             (["--kv-cache-gb", "0"], "--kv-cache-gb 0.0 must be > 0")]
    for args, message in cases:
        r = CliRunner().invoke(scale_app, ["--models-dir", str(tmp_path), *args], terminal_width=400)
        assert r.exit_code == 2, (args, r.output)
        assert message in " ".join(r.output.replace("│", " ").split()), (args, r.output)
    assert list(tmp_path.iterdir()) == []  # nothing built before the options are checked
