"""``make bench-long`` (:mod:`benchmarks.bench_long`): a tiny run of tpengine (chunked prefill) beside HF on a
tiny random model, the prompt shortened to the model's context; and the pure parts (the prompt length,
the rows planned, the summary's ratios, the converter's files picked from the sdist). No llama.cpp runs
here and nothing is downloaded."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import launch
import pytest
import typer
from conftest import make_tiny_model
from typer.testing import CliRunner

import benchmarks
from benchmarks import bench_long as bl


@pytest.fixture(autouse=True)
def forked_workers(monkeypatch):
    """The workers start through the suite's fork server (what they run is unchanged)."""
    real = benchmarks.launcher
    monkeypatch.setattr(benchmarks, "launcher", lambda tp, module: launch.forked(real(tp, module)))


def test_bench_long_smoke(tmp_path):
    """100 + 4 tokens do not fit the model's 64 positions: the prompt is 60 tokens, prefilled by
    tpengine in chunks of 16, one round beside HF; every figure positive, the ratio tpengine / HF."""
    model = make_tiny_model(tmp_path, "llama", seed=0, max_position_embeddings=64)
    out = tmp_path / "long.json"
    r = CliRunner().invoke(bl.app, ["--model", str(model), "--input-len", "100", "--output-len", "4", "--dtype",
                                    "float32", "--max-num-batched-tokens", "16", "--skip-llama-cpp",
                                    "--out", str(out)], terminal_width=200)
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "the prompt is 60 tokens" in r.output and "TTFT / HF" in r.output
    res = json.loads(out.read_text())
    c = res["config"]
    assert (c["input_len"], c["output_len"], c["max_num_batched_tokens"], c["rounds"]) == (60, 4, 16, 1)
    assert set(res["results"]) == {"tpengine-float32", "hf-float32"}
    assert res["notes"] == ["llama.cpp: skipped (--skip-llama-cpp)"]
    for key, row in res["results"].items():
        assert row["ttft_ms"] > 0 and row["tpot_ms"] > 0 and row["rounds"] == 1, key
        assert row["prefill_tok_s"] == round(60 / (row["ttft_ms"] / 1e3), 1) or row["prefill_tok_s"] > 0
    tpe, hf = res["results"]["tpengine-float32"], res["results"]["hf-float32"]
    assert tpe["ttft_vs_hf"] == round(tpe["ttft_ms"] / hf["ttft_ms"], 2) and "ttft_vs_llama_cpp" not in tpe
    assert len(res["load_avg"]["start"]) == 3 and res["total_s"] > 0


def test_prompt_length_rows_and_summary(tmp_path):
    assert bl.prompt_length(8192, 128, 8192)[0] == 8064
    assert "exceeds the model's context of 8192 tokens" in bl.prompt_length(8192, 128, 8192)[1]
    assert bl.prompt_length(100, 4, None) == (100, None) and bl.prompt_length(60, 4, 64) == (60, None)
    with pytest.raises(typer.BadParameter, match="context is 4 tokens"):
        bl.prompt_length(10, 4, 4)
    q4, f32 = tmp_path / "q4.gguf", tmp_path / "f32.gguf"
    systems, notes = bl.plan_systems(["float32", "bfloat16"], False, False, q4, {"float32": f32, "bfloat16": None},
                                     "sdpa")
    assert [s.key for s in systems] == ["tpengine-float32", "hf-float32", "llama.cpp-f32", "tpengine-bfloat16",
                                        "hf-bfloat16", "llama.cpp-q4_1"]
    assert notes == ["llama.cpp BF16: skipped (no converted GGUF)"]
    assert systems[2].gguf == f32 and systems[-1].gguf == q4 and systems[-1].dtype == ""
    systems, notes = bl.plan_systems(["float32"], True, False, None, {"float32": f32}, "sdpa")
    assert [s.key for s in systems] == ["tpengine-float32", "llama.cpp-f32"] and len(notes) == 2
    runs = {"tpengine-float32": [{"ttft_s": 2.0, "latency_s": 3.0}, {"ttft_s": 1.5, "latency_s": 2.9}],
            "llama.cpp-f32": [{"ttft_s": 3.0, "latency_s": 3.2}]}
    res = bl.summarize(runs, systems, 300, 5)
    assert res["tpengine-float32"] == {"ttft_ms": 1500.0, "prefill_tok_s": 200.0, "tpot_ms": 250.0, "rounds": 2,
                                       "ttft_vs_llama_cpp": 0.5}
    assert res["llama.cpp-f32"]["tpot_ms"] == 50.0 and "ttft_vs_hf" not in res["tpengine-float32"]


def test_converter_files_from_the_sdist(tmp_path):
    """Only vendor/llama.cpp's converter, its conversion package and gguf-py are taken from the sdist."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in ("p-1/vendor/llama.cpp/convert_hf_to_gguf.py", "p-1/vendor/llama.cpp/conversion/llama.py",
                     "p-1/vendor/llama.cpp/gguf-py/gguf/__init__.py", "p-1/vendor/llama.cpp/src/llama.cpp",
                     "p-1/llama_cpp/__init__.py", "p-1/vendor/llama.cpp/convert_lora_to_gguf.py"):
            data = name.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        got = [rel for _, rel in bl._vendor_members(tar)]
    assert got == ["convert_hf_to_gguf.py", "conversion/llama.py", "gguf-py/gguf/__init__.py"]
    assert bl.converter_dir(Path("/c")) == Path("/c/peers/llama.cpp-convert-0.3.36")
