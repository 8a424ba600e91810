"""Smoke tests of ``python -m benchmarks.bench`` and the other benchmarks on tiny random models with
tiny sizes: HF, tp=1 and tp=2 (torchrun) all run, the JSON has every key and every number is
positive (``benchmarks.bench_scale``: tests/test_bench_scale.py)."""

from __future__ import annotations

import json

import launch
import pytest
from conftest import SMOLLM2_DIR, QuietContention, make_tiny_model
from typer.testing import CliRunner

import benchmarks
from benchmarks import roofline
from benchmarks.bench import app, parse_system


@pytest.fixture(autouse=True)
def forked_workers(monkeypatch):
    """The benchmarks' workers, jobs and servers start through the suite's fork server (what they run
    is unchanged; these tests check the benchmarks' records, not their timings); the roofline's triad
    over arrays of 1 MiB for 0.05 s, each GEMM timed 0.01 s."""
    real = benchmarks.launcher
    monkeypatch.setattr(benchmarks, "launcher", lambda tp, module: launch.forked(real(tp, module)))
    monkeypatch.setattr(roofline, "TRIAD_MIB", 1)
    monkeypatch.setattr(roofline, "TRIAD_WINDOW_S", 0.05)
    monkeypatch.setattr(roofline, "GEMM_WINDOW_S", 0.01)


def check_limits(res: dict, dtype: str) -> None:
    """Every row of ``res`` (a bench JSON) has its roofline figures from the run's measured roofline:
    the triad of the row's layout (tp processes of cores / tp threads), the floor from its
    precision's bytes, and the FLOP fraction where it has a throughput."""
    from transformers import AutoConfig

    lim, cores = res["roofline"], res["config"]["cores"]
    assert lim["triad_mib"] == 1 and lim["gemm"]["float32"]["gflop_s"] > 0 and lim["gemm"]["bfloat16"]["gflop_s"] > 0
    assert [(b["procs"], b["threads"]) for b in lim["bandwidth"]] == [(t, max(1, cores // t)) for t in (1, 2)]
    assert all(b["gb_s"] > 0 for b in lim["bandwidth"]) and lim["load_avg"] >= 0
    t = roofline.model_tensors(AutoConfig.from_pretrained(res["config"]["model"]))
    ctx = roofline.mean_context(res["config"]["latency_input_len"], res["config"]["latency_output_len"])
    for s, row in res["results"][dtype].items():
        tp, quant = (1, None) if s == "hf" else parse_system(s)
        p = roofline.tpengine_precision(dtype, quant)  # HF holds its weights as tpengine's float rows
        assert row["floor_bytes"] == roofline.decode_bytes(t, p, ctx), s
        floor_ms = row["floor_bytes"] / roofline.bandwidth_of(lim, tp, max(1, cores // tp)) / 1e6
        assert row["floor_ms"] == float(f"{floor_ms:.4g}"), s
        assert row["tpot_vs_floor"] == round(row["tpot_ms"] / floor_ms, 2), s
        if "total_tok_s" in row:
            flops = 2 * roofline.matmul_params(t) * row["total_tok_s"] / roofline.gemm_of(lim, p.compute) / 1e9
            assert row["flops_fraction"] == float(f"{flops:.4g}"), s
        else:
            assert "flops_fraction" not in row, s


def test_bench_smoke(tmp_path):
    model = make_tiny_model(tmp_path, "llama", seed=0)
    out = tmp_path / "bench.json"
    args = ["--model", str(model), "--num-prompts", "3", "--input-len", "5", "--output-len", "4",
            "--latency-input-len", "6", "--latency-output-len", "3", "--dtype", "bfloat16", "--quantization", "none",
            "--rounds", "1", "--out", str(out)]
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
    # --hf-attn auto in one round: HF runs sdpa, then eager, on the measured workloads; the best is shown
    hf_runs = res["runs"]["bfloat16"]["hf"]
    for kind in ("throughput", "latency"):
        assert [x["attn_implementation"] for x in hf_runs[kind]] == ["sdpa", "eager"], kind
    best = max(hf_runs["throughput"], key=lambda x: x["output_tokens"] / x["elapsed_s"])
    assert rows["hf"]["attn"] == best["attn_implementation"] and rows["hf"]["attn_latency"] in ("sdpa", "eager")
    assert len(rows["tp2"]["threads"]) == 2 and rows["tp2"]["tp_efficiency"] > 0
    for s in ("tp1", "tp2"):  # the engine's measured choices, as rank 0 logged them, echoed and kept
        got = res["runs"]["bfloat16"][s]["choices"]
        assert any(c.startswith("tpengine: CPU linear layouts (bfloat16") for c in got), (s, got)
        assert f"bfloat16 {s}: tpengine: CPU linear layouts (bfloat16" in r.output
    assert res["runs"]["bfloat16"]["hf"]["choices"] == []
    runs = res["runs"]["bfloat16"]["tp1"]["throughput"]
    assert runs[0]["output_tokens"] == 3 * 4 and runs[0]["prompt_tokens"] == 3 * 5
    check_limits(res, "bfloat16")
    assert "TPOT / floor" in r.output and "roofline: triad " in r.output


def test_latency_only_rows_have_no_throughput_figures():
    """By default (no --quantized-throughput) the quantized rows run latency only: their rows carry
    TPOT, TPOT vs HF and vs float weights, and no tok/s, vs HF or TP efficiency; the table shows -."""
    from benchmarks.bench_report import render_table, summarize

    lat = [{"latency_s": 1.0, "ttft_s": 0.1}]
    tput = [{"output_tokens": 100, "prompt_tokens": 50, "elapsed_s": 2.0}]
    runs = {"bfloat16": {"hf": {"threads": [2], "throughput": tput, "latency": [{"latency_s": 2.0, "ttft_s": 0.2}]},
                         "tp1": {"threads": [2], "throughput": tput, "latency": lat, "weight_bytes": [100]},
                         "tp2": {"threads": [1, 1], "throughput": tput, "latency": lat, "weight_bytes": [50, 50]},
                         "tp1-int8": {"threads": [2], "throughput": [], "latency": lat, "weight_bytes": [50]},
                         "tp2-int8": {"threads": [1, 1], "throughput": [], "latency": lat, "weight_bytes": [25, 25]}}}
    rows = summarize(runs, latency_output_len=10)["bfloat16"]
    assert rows["tp1"]["output_tok_s"] == 50.0 and rows["tp1"]["vs_hf"] == 1.0 and rows["tp2"]["tp_efficiency"] == 1.0
    for s in ("tp1-int8", "tp2-int8"):
        assert not {"output_tok_s", "vs_hf", "tp_efficiency"} & set(rows[s]), s
        assert rows[s]["tpot_ms"] == 100.0 and rows[s]["tpot_vs_hf"] == 0.5 and rows[s]["tpot_vs_float"] == 1.0
        assert rows[s]["weights_vs_float"] == 0.5
    result = {"config": {"model": "m", "num_prompts": 1, "input_len": 1, "output_len": 1, "latency_input_len": 1,
                         "latency_output_len": 10, "rounds": 1},
              "machine": {"cpu": "cpu", "cores": 2, "torch": "t", "transformers": "x"},
              "results": {"bfloat16": rows}, "total_s": 1.0}
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render_table(result))
    line = next(ln for ln in console.export_text().splitlines() if "tp=1 int8" in ln)
    assert [c.strip() for c in line.split("│")[5:8]] == ["-", "-", "-"]  # tok/s, vs HF, TP eff.


def test_bench_quantized_rows(tmp_path, measuring):
    """int8 and int4 rows at tp 1 and 2 in the bfloat16 group (none in float32: ``dtype_systems``),
    each with its weight bytes per rank, TP efficiency against the same weights' tp=1, and TPOT /
    weight bytes against the same tp's float weights; the output names the CPU and its flags. The
    workers measure their choices (``measuring``, as a benchmark's do): the suite's end-to-end run of the
    quantized kernels' measured choice (test_quantized's jobs take the defaults)."""
    from transformers import AutoConfig

    from benchmarks.bench import dtype_systems
    from benchmarks.machine import CPU_FLAGS, read_cpuinfo

    quant = ["tp1-int8", "tp2-int8"]
    assert dtype_systems("float32", True, [1, 2], quant) == ["hf", "tp1", "tp2"]
    assert dtype_systems("bfloat16", False, [1, 2], quant) == ["tp1", "tp2", "tp1-int8", "tp2-int8"]

    model = make_tiny_model(tmp_path, "llama", seed=0, intermediate_size=128)  # int4 groups of 32 at tp 2
    out = tmp_path / "bench.json"
    args = ["--model", str(model), "--num-prompts", "2", "--input-len", "5", "--output-len", "3",
            "--latency-input-len", "6", "--latency-output-len", "3", "--dtype", "bfloat16",
            "--no-hf", "--rounds", "1", "--quantized-throughput", "--no-roofline", "--out", str(out)]
    r = CliRunner().invoke(app, args, terminal_width=200)
    assert r.exit_code == 0, r.output + repr(r.exception)
    res = json.loads(out.read_text())
    assert list(res["results"]) == ["bfloat16"]
    rows = res["results"]["bfloat16"]
    assert list(rows) == ["tp1", "tp2", "tp1-int8", "tp2-int8", "tp1-int4", "tp2-int4"]
    assert res["config"]["quantization"] == ["int8", "int4"] and res["config"]["rounds"] == 1
    for s in ("tp1-int8", "tp2-int8", "tp1-int4", "tp2-int4"):
        tp = int(s[2])
        assert len(rows[s]["weight_bytes"]) == tp and all(b > 0 for b in rows[s]["weight_bytes"])
        assert 0 < rows[s]["weights_vs_float"] < 1, s  # quantized linears are smaller than bfloat16 ones
        assert rows[s]["tpot_vs_float"] > 0
    assert sum(rows["tp2"]["weight_bytes"]) > max(rows["tp2"]["weight_bytes"])  # split over the ranks
    assert rows["tp2-int8"]["tp_efficiency"] > 0 and "tp_efficiency" not in rows["tp1-int8"]
    assert "tpengine tp=2 int4" in r.output
    # --no-roofline: nothing measured, no row's limits (test_bench_smoke and test_roofline check them)
    assert res["roofline"] is None and not any("floor_ms" in row for row in rows.values())
    assert "roofline: triad" not in r.output
    # the roofline's byte counts are the engine's: every weight as tp=1 holds it, per precision
    tensors = roofline.model_tensors(AutoConfig.from_pretrained(str(model)))
    for q in (None, "int8", "int4"):
        held = rows["tp1" + (f"-{q}" if q else "")]["weight_bytes"]
        assert held == [roofline.weight_bytes(tensors, roofline.tpengine_precision("bfloat16", q))], q
    cpu, flags = read_cpuinfo()
    present = {name: flag in flags for flag, name in CPU_FLAGS.items()}
    assert res["machine"]["cpu_flags"] == present and res["machine"]["cpu"] == cpu
    line = ", ".join(f"{n} {'yes' if on else 'no'}" for n, on in present.items())
    assert f"machine: {cpu} ({line}), " in r.output


def test_bench_rejects_bad_options_before_starting_workers(tmp_path):
    model = make_tiny_model(tmp_path, "llama", seed=0)  # 4 attention heads
    cases = [(["--hf-attn", "flash"], "--hf-attn 'flash' is not one of auto, sdpa, eager"),
             (["--dtype", "fp8"], "--dtype 'fp8' is not one of auto, float32, bfloat16, float16"),
             (["--tp", "5"], "--tp 5: tp_size=5 is invalid for this model: it has num_attention_heads=4, "
                             "so tp_size must be between 1 and 4"),
             (["--tp", "0"], "--tp 0: tp_size=0 is invalid for this model"),
             (["--quantization", "fp8"], "--quantization 'fp8' is not one of int8, int4, none"),
             (["--quantization", "int4"], "--tp 1 --quantization int4: --quantization int4 (group size 32): "
                                          "mlp.down_proj has 100 input features, not a multiple of 32"),
             (["--model", str(tmp_path / "nothing")], "cannot read its config.json")]
    for args, message in cases:
        r = CliRunner().invoke(app, ["--model", str(model), *args], terminal_width=400)
        assert r.exit_code == 2, (args, r.output)
        assert message in " ".join(r.output.replace("│", " ").split()), (args, r.output)  # unwrap rich's box


def test_startup_smoke(tmp_path):
    """benchmarks.startup runs both whole jobs (HF and tpengine.entrypoints.run) on a tiny model, tpengine
    with a fresh cache of choices (the C kernel builds copied from the suite's cache), and reports the
    best of each, their ratio and where tpengine's time went."""
    from benchmarks.startup import app as startup_app

    model = make_tiny_model(tmp_path, "llama", seed=0, vocab_size=49152, max_position_embeddings=512)
    out = tmp_path / "startup.json"
    r = CliRunner().invoke(startup_app, ["--model", str(model), "--dtype", "float32", "--cache", "choices",
                                         "--rounds", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    (row,) = json.loads(out.read_text())
    assert row["model"] == str(model) and row["dtype"] == "float32" and len(row["hf_all_s"]) == 1
    (state,) = row["tpengine"].values()
    assert list(row["tpengine"]) == ["choices"] and len(state["all_s"]) == 1
    assert row["hf_s"] > 0 and state["s"] > 0 and state["ratio"] == round(state["s"] / row["hf_s"], 3)
    b = state["breakdown"]
    assert b["to_load_s"] > 0 and b["load_s"] > 0 and b["rest_s"] > 0
    assert abs(b["to_load_s"] + b["load_s"] + b["rest_s"] - state["s"]) < 0.05
    assert "tpengine / HF" in r.output
    r = CliRunner().invoke(startup_app, ["--cache", "hot"])
    assert r.exit_code == 2 and "valid: warm, choices, cold" in r.output


def test_prefix_cache_smoke(tmp_path):
    """benchmarks.prefix_cache on 4 x (64-token shared document + 4-token question): with block_size 16
    the first request computes all 68 tokens, the other 3 find the document's 4 full blocks cached
    (64 tokens each), so the hit rate is 3 * 64 / (4 * 68); without caching every token is computed."""
    from benchmarks.prefix_cache import app as prefix_app

    model = make_tiny_model(tmp_path, "llama", seed=0)
    out = tmp_path / "prefix.json"
    args = ["--model", str(model), "--num-prompts", "4", "--doc-len", "64", "--question-len", "4",
            "--output-len", "4", "--threads", "1", "--out", str(out)]
    r = CliRunner().invoke(prefix_app, args, terminal_width=200)
    assert r.exit_code == 0, r.output + repr(r.exception)
    for label in ("HF generate", "tpengine tp=1, cache on", "tpengine tp=1, cache off"):
        assert label in r.output, label
    res = json.loads(out.read_text())
    assert {"config", "machine", "results", "runs", "total_s"} <= set(res)
    rows = res["results"]
    assert set(rows) == {"hf", "tp1-cache", "tp1-nocache"}
    for s, row in rows.items():
        assert row["output_tokens"] == 4 * 4, s
        for key in ("output_tok_s", "ttft_mean_ms", "ttft_p50_ms", "elapsed_s"):
            assert row[key] > 0, (s, key)
        (run,) = res["runs"][s]["throughput"]
        assert run["prompt_tokens"] == 4 * 68 and len(run["ttft_s"]) == 4, s
    assert rows["tp1-cache"]["hit_rate"] == round(3 * 64 / (4 * 68), 4)
    assert rows["tp1-cache"]["cached_prompt_tokens"] == 3 * 64
    assert rows["tp1-nocache"]["hit_rate"] == 0.0 and rows["tp1-nocache"]["cached_prompt_tokens"] == 0
    assert rows["hf"]["hit_rate"] is None and "vs_no_cache" not in rows["hf"]
    assert rows["tp1-cache"]["vs_no_cache"] > 0 and "vs_no_cache" not in rows["tp1-nocache"]
    on = res["runs"]["tp1-cache"]["throughput"][0]["stats"]
    off = res["runs"]["tp1-nocache"]["throughput"][0]["stats"]
    # on: the first prompt alone (the others wait for its blocks), then the 3 questions; 3 decodes each
    assert (on["prefill_steps"], on["computed_tokens"]) == (2, 68 + 3 * 4 + 4 * 3)
    assert (off["prefill_steps"], off["computed_tokens"]) == (1, 4 * 68 + 4 * 3)


def test_chunked_prefill_smoke(tmp_path):
    """benchmarks.chunked_prefill: 4 running requests (32 in, 16 out) and a 256-token prompt, without
    chunking and with chunks of 64 and 128 tokens; the step and token counts are the scheduler's."""
    from benchmarks.chunked_prefill import app as chunked_app

    model = make_tiny_model(tmp_path, "llama", seed=0, max_position_embeddings=512)
    out = tmp_path / "chunked.json"
    args = ["--model", str(model), "--running-output-len", "16", "--start-after", "4", "--long-len", "256",
            "--chunk", "128,64", "--threads", "1", "--out", str(out)]
    r = CliRunner().invoke(chunked_app, args, terminal_width=200)
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "no chunking" in r.output and "chunked 64" in r.output and "chunked 128" in r.output
    res = json.loads(out.read_text())
    assert {"config", "machine", "results", "suggested_default", "runs", "total_s"} <= set(res)
    rows = res["results"]
    assert set(rows) == {"no-chunk", "chunk-64", "chunk-128"} and res["config"]["chunks"] == [64, 128]
    assert {k: (v["max_num_batched_tokens"], v["enable_chunked_prefill"]) for k, v in rows.items()} == {
        "no-chunk": (8192, False), "chunk-64": (64, True), "chunk-128": (128, True)}
    # no-chunk: 1 prefill of the 4, 3 decodes, the long prompt alone, 12 decodes. chunked: the long prompt
    # is too long for one step, so every chunk rides beside the 4 decodes: chunk-128 124, 124, 8;
    # chunk-64: the 4 prompts in 2 steps, then 60, 60, 60, 60, 16.
    assert {k: (v["steps"], v["prefill_steps"]) for k, v in rows.items()} == {
        "no-chunk": (17, 2), "chunk-128": (16, 4), "chunk-64": (17, 7)}
    for name, row in rows.items():
        assert row["computed_tokens"] == 4 * 32 + 4 * 15 + 256 and row["gaps"] == 4 * 15, name
        for key in ("worst_gap_ms", "p50_gap_ms", "long_ttft_ms", "decode_tok_s", "max_step_ms"):
            assert row[key] > 0, (name, key)
        assert row["worst_gap_ms"] >= row["p50_gap_ms"]
        (run,) = res["runs"][name]
        assert run["running_tokens"] == 4 * 16 and len(run["step_s"]) == row["steps"]
    assert rows["no-chunk"]["ttft_vs_no_chunk"] == 1.0
    assert res["suggested_default"] in (None, 64, 128)
    assert ("(suggested default)" in r.output) == (res["suggested_default"] is not None)
    from rich.console import Console

    from benchmarks.chunked_prefill import render_table

    console = Console(width=120, record=True)  # the narrowest the benchmark prints at: the label stays whole
    console.print(render_table({**res, "suggested_default": 128}))
    assert "chunked 128 (suggested default)" in console.export_text()


def test_chunked_prefill_suggested_default_and_bad_chunks(tmp_path):
    from benchmarks.chunked_prefill import app as chunked_app
    from benchmarks.chunked_prefill import suggested_default

    def row(n, gap, ttft):
        return {"max_num_batched_tokens": n, "worst_gap_ms": gap, "long_ttft_ms": ttft}

    rows = {"no-chunk": row(8192, 500.0, 100.0), "chunk-256": row(256, 20.0, 150.0),
            "chunk-512": row(512, 40.0, 110.0), "chunk-1024": row(1024, 80.0, 104.0)}
    assert suggested_default(rows) == 512  # 256 has the smallest gap but its TTFT is 1.5x
    assert suggested_default({k: v for k, v in rows.items() if k != "chunk-512"}) == 1024
    assert suggested_default({"no-chunk": rows["no-chunk"], "chunk-256": rows["chunk-256"]}) is None
    cases = [(["--chunk", "64,x"], "--chunk '64,x': 'x' is not an integer"),
             (["--chunk", "0"], "--chunk '0': 0 must be >= 1"),
             (["--start-after", "300"], "--start-after 300 must be >= 1 and < --running-output-len 256"),
             (["--dtype", "fp8"], "--dtype 'fp8' is not one of float32, bfloat16, float16")]
    for args, message in cases:
        r = CliRunner().invoke(chunked_app, ["--model", str(tmp_path), *args], terminal_width=400)
        assert r.exit_code == 2, (args, r.output)
        assert message in " ".join(r.output.replace("│", " ").split()), (args, r.output)


def test_prefix_cache_rejects_bad_options_before_starting_workers(tmp_path):
    from benchmarks.prefix_cache import app as prefix_app

    model = make_tiny_model(tmp_path, "llama", seed=0)  # 4 attention heads, 256 positions
    cases = [(["--dtype", "auto"], "--dtype 'auto' is not one of float32, bfloat16, float16"),
             (["--hf-attn", "flash"], "--hf-attn 'flash' is not one of auto, sdpa, eager"),
             (["--tp", "5"], "--tp 5: tp_size=5 is invalid for this model"),
             (["--doc-len", "200", "--question-len", "40", "--output-len", "20"],
              "--doc-len 200 + --question-len 40 + --output-len 20 = 260 exceeds the model's "
              "max_position_embeddings 256"),
             (["--num-prompts", "0"], "must be >= 1")]
    for args, message in cases:
        r = CliRunner().invoke(prefix_app, ["--model", str(model), *args], terminal_width=400)
        assert r.exit_code == 2, (args, r.output)
        assert message in " ".join(r.output.replace("│", " ").split()), (args, r.output)


def test_big_file_smoke(tmp_path, monkeypatch):
    """benchmarks.big_file on files of 3 and 7 lines: every line gets its record, the times are
    positive and rank 0's peak memory is reported (its jobs start through the fork server, as the
    other benchmarks' workers here)."""
    import subprocess
    from types import SimpleNamespace

    from benchmarks import big_file
    from benchmarks.big_file import app as big_app

    forked = SimpleNamespace(Popen=lambda cmd, **kw: subprocess.Popen(launch.forked(cmd), **kw),
                             DEVNULL=subprocess.DEVNULL, PIPE=subprocess.PIPE)
    monkeypatch.setattr(big_file, "subprocess", forked)

    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        import pytest

        pytest.skip("needs the SmolLM2 tokenizer (make model)")
    model = make_tiny_model(tmp_path, "llama", seed=0, vocab_size=49152)
    out = tmp_path / "big.json"
    args = ["--model", str(model), "--lines", "3", "--lines", "7", "--max-num-seqs", "4", "--out", str(out)]
    r = CliRunner().invoke(big_app, args, terminal_width=200)
    assert r.exit_code == 0, r.output + repr(r.exception)
    runs = json.loads(out.read_text())["runs"]
    assert [(x["lines"], x["records"], x["summary"]["requests_ok"]) for x in runs] == [(3, 3, 3), (7, 7, 7)]
    for x in runs:
        assert 0 < x["first_record_s"] <= x["wall_s"] and x["rank0_peak_rss_mib"] > 0
        assert x["summary"]["output_tokens"] == 2 * x["lines"]


def test_bench_serve_smoke(tmp_path):
    """benchmarks.bench_serve at tp=1 on a tiny model: the batch job and the server on 4 x (8 in -> 4 out)
    at 2 concurrent streaming clients; every request's usage says exactly 4 tokens."""
    from benchmarks.bench_serve import app as serve_app

    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        import pytest

        pytest.skip("needs the SmolLM2 tokenizer (make model)")
    model = make_tiny_model(tmp_path, "llama", seed=0, vocab_size=49152)
    out = tmp_path / "serve.json"
    args = ["--model", str(model), "--tp", "1", "--dtype", "float32", "--num-prompts", "4", "--input-len", "8",
            "--output-len", "4", "--max-concurrency", "2", "--out", str(out)]
    r = CliRunner().invoke(serve_app, args, terminal_width=200)
    assert r.exit_code == 0, r.output + repr(r.exception)
    res = json.loads(out.read_text())
    assert {"config", "machine", "offline", "server_ready_s", "results", "total_s"} <= set(res)
    assert res["config"]["max_concurrency"] == [2] and res["config"]["tp"] == 1
    off = res["offline"]
    assert (off["requests_ok"], off["prompt_tokens"], off["output_tokens"]) == (4, 4 * 8, 4 * 4)
    assert off["output_tok_s"] > 0
    (row,) = res["results"]
    assert (row["max_concurrency"], row["completed"], row["input_tokens"], row["output_tokens"]) == (2, 4, 32, 16)
    assert abs(row["output_tok_s"] - 16 / row["wall_s"]) <= 0.05 + 0.005 * row["output_tok_s"]
    assert abs(row["vs_offline"] - row["output_tok_s"] / off["output_tok_s"]) < 0.01
    assert row["request_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(row[key]) == {"mean", "p50", "p99"}, key
        assert 0 < row[key]["p50"] <= row[key]["p99"], key
    assert row["ttft_ms"]["p99"] <= row["e2e_ms"]["p99"]


def test_hf_auto_attention_is_measured_and_cached(tmp_path, monkeypatch, measuring):
    """``--hf-attn auto`` times HF generate with each implementation on this machine (the model left
    set to the faster), then reads the choice back; sdpa / eager are taken as given."""
    import pytest
    import torch

    from benchmarks import hf_system
    from benchmarks.hf_system import HFSystem, hf_attn_for
    from tpengine.backends.cpu import measured

    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(measured, "probe_busy", lambda: False)  # a quiet start, whatever runs beside the test
    model = make_tiny_model(tmp_path, name="llama")
    ran = []
    real = measured.measure
    # generate really runs with both; eager "wins" by fixed timings (real ones under a loaded machine may
    # disagree by more than measured's 1.5x between the two measurements, and then are not cached)
    monkeypatch.setattr(measured, "measure", lambda c, p: ran.append(sorted(c)) or
                        (real(c, p) and {"eager": [1.0], "sdpa": [1e9]}))
    # and the machine counts as quiet: a busy one's timings (another job on the cores) are not cached
    monkeypatch.setattr(measured, "Contention", QuietContention)
    monkeypatch.setattr(hf_system, "AUTO_ATTN_WORKLOAD", (2, 8, 2))  # a smaller timed workload: the same path
    hf = HFSystem(str(model), torch.float32, 1, 4)
    assert (hf.attn, hf.model.config._attn_implementation, ran) == ("eager", "eager", [["eager", "sdpa"]] * 2)
    again = HFSystem(str(model), torch.float32, 1, 4)
    assert again.attn == "eager" and len(ran) == 2  # cached
    assert HFSystem(str(model), torch.float32, 1, 4, "sdpa").attn == "sdpa" and len(ran) == 2
    assert hf_attn_for("auto") is None and hf_attn_for("eager") == "eager"
    with pytest.raises(ValueError, match="hf attention 'flash' is not one of auto, sdpa, eager"):
        hf_attn_for("flash")

