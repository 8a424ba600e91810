"""Smoke test of ``python -m benchmarks.bench`` on a tiny random model with tiny sizes: HF, tp=1 and
tp=2 (torchrun) all run, the JSON has every key and every number is positive."""

from __future__ import annotations

import json

from conftest import make_tiny_model
from typer.testing import CliRunner

from benchmarks.bench import app


def test_bench_smoke(tmp_path):
    model = make_tiny_model(tmp_path, "llama", seed=0)
    out = tmp_path / "bench.json"
    args = ["--model", str(model), "--num-prompts", "3", "--input-len", "5", "--output-len", "4",
            "--latency-input-len", "6", "--latency-output-len", "3", "--dtype", "bfloat16", "--out", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "tpengine tp=2" in r.output and "HF generate" in r.output
    res = json.loads(out.read_text())
    assert {"config", "machine", "results", "runs", "total_s"} <= set(res)
    assert res["machine"]["cores"] >= 1 and res["config"]["tp"] == [1, 2]
    rows = res["results"]["bfloat16"]
    assert set(rows) == {"hf", "tp1", "tp2"}
    for s, row in rows.items():
        for key in ("output_tok_s", "total_tok_s", "elapsed_s", "ttft_ms", "tpot_ms"):
            assert row[key] > 0, (s, key)
        assert all(t >= 1 for t in row["threads"])
        if s != "hf":
            assert row["vs_hf"] > 0 and row["tpot_vs_hf"] > 0
    assert rows["hf"]["attn"] == "eager"  # --hf-attn auto: the faster one in bfloat16
    assert len(rows["tp2"]["threads"]) == 2 and rows["tp2"]["tp_efficiency"] > 0
    runs = res["runs"]["bfloat16"]["tp1"]["throughput"]
    assert runs[0]["output_tokens"] == 3 * 4 and runs[0]["prompt_tokens"] == 3 * 5


def test_bench_rejects_bad_options_before_starting_workers(tmp_path):
    model = make_tiny_model(tmp_path, "llama", seed=0)  # 4 attention heads
    cases = [(["--hf-attn", "flash"], "--hf-attn 'flash' is not one of auto, sdpa, eager"),
             (["--dtype", "fp8"], "--dtype 'fp8' is not one of auto, float32, bfloat16, float16"),
             (["--tp", "5"], "--tp 5: tp_size=5 is invalid for this model: it has num_attention_heads=4, "
                             "so tp_size must be between 1 and 4"),
             (["--tp", "0"], "--tp 0: tp_size=0 is invalid for this model"),
             (["--model", str(tmp_path / "nothing")], "cannot read its config.json")]
    for args, message in cases:
        r = CliRunner().invoke(app, ["--model", str(model), *args], terminal_width=400)
        assert r.exit_code == 2, (args, r.output)
        assert message in " ".join(r.output.replace("│", " ").split()), (args, r.output)  # unwrap rich's box
