"""``python -m benchmarks.chart``: the PNG of a ``make bench`` run, from a results JSON in the exact
shape :mod:`benchmarks.bench` writes (its ``results`` made by :func:`benchmarks.bench_report.summarize`
from raw runs, its system keys by :func:`benchmarks.bench.system_key`)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from benchmarks.bench import QUANT_DTYPE, system_key
from benchmarks.bench_report import _name, summarize
from benchmarks.chart import (
    PEERS_GROUP,
    app,
    chart_groups,
    chart_panels,
    chart_title,
    draw_chart,
    system_label,
    system_order,
)
from benchmarks.machine import cpu_flags

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LAT_OUT = 8


def _runs(tp: int, tok_s: float, tpot_s: float, throughput: bool = True) -> dict:
    """One system's raw runs as :func:`benchmarks.bench.run_dtype` returns them (two rounds)."""
    tput = [{"output_tokens": 400, "prompt_tokens": 400, "elapsed_s": 400 / (tok_s * f)} for f in (1.0, 0.9)]
    lat = [{"ttft_s": 0.05, "latency_s": 0.05 + tpot_s * f * (LAT_OUT - 1)} for f in (1.0, 1.1)]
    return {"threads": [2 // tp] * tp, "weight_bytes": [100 // tp] * tp, "load_s": 1.0,
            "throughput": tput if throughput else [], "latency": lat, "choices": []}


def bench_result() -> dict:
    """A results JSON with every key :func:`benchmarks.bench.main` writes, in float32 and bfloat16,
    HF, tp=1, tp=2 and (in bfloat16) latency-only int8 / int4 rows."""
    runs = {}
    for dt, scale in (("float32", 1.0), ("bfloat16", 2.0)):
        hf = _runs(1, 200 * scale, 0.03 / scale)
        for kind in ("throughput", "latency"):  # --hf-attn auto over 2 rounds: sdpa, then eager
            hf[kind] = [{**x, "attn_implementation": a} for x, a in zip(hf[kind], ("sdpa", "eager"))]
        runs[dt] = {"hf": hf,
                    system_key(1): _runs(1, 450 * scale, 0.02 / scale), system_key(2): _runs(2, 400 * scale, 0.024)}
        if dt == QUANT_DTYPE:
            for q in ("int8", "int4"):
                for tp in (1, 2):
                    runs[dt][system_key(tp, q)] = _runs(tp, 1, 0.008 if q == "int8" else 0.005, throughput=False)
    return {
        "config": {"model": "models/smollm2-135m-instruct", "num_prompts": 4, "input_len": 100, "output_len": 100,
                   "latency_input_len": 16, "latency_output_len": LAT_OUT, "dtypes": list(runs), "tp": [1, 2],
                   "rounds": 2, "seed": 0, "cores": 2, "hf_batch_size": 4, "hf_attn": "auto",
                   "quantization": ["int8", "int4"], "quantized_dtype": QUANT_DTYPE, "quantized_throughput": False},
        "machine": {"cpu": "Intel(R) Xeon(R) Platinum 8480+", "cpu_flags": cpu_flags({"avx512f", "avx512_bf16"}),
                    "cores": 2, "memory_gib": 23.5, "cpu_capability": "avx512", "torch": "2.13.0+cpu",
                    "transformers": "5.24.0", "python": "3.11.7"},
        "results": summarize(runs, LAT_OUT),
        "runs": runs,
        "total_s": 12.3,
    }


def test_chart_cli_writes_a_png(tmp_path):
    """make bench's command line: the results JSON in, a PNG (header, nonzero size) out."""
    results = tmp_path / "bench-results.json"
    results.write_text(json.dumps(bench_result(), indent=2) + "\n")  # as benchmarks.emit writes it
    out = tmp_path / "docs" / "bench.png"  # its folder does not exist yet
    r = CliRunner().invoke(app, ["--results", str(results), "--out", str(out), "--date", "2026-12-03 05:33"])
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert f"wrote {out}" in r.output
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_chart_without_tpot_and_with_latency_only_rows(tmp_path):
    """A results JSON whose rows lack TPOT draws the throughput panel alone; latency-only rows (no
    output_tok_s) get no throughput bar; the default date is the file's modification time."""
    result = bench_result()
    for rows in result["results"].values():
        for row in rows.values():
            row.pop("tpot_ms")
    out = draw_chart(result, tmp_path / "a.png", "2026-12-03")
    assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > 0
    results = tmp_path / "r.json"
    results.write_text(json.dumps(bench_result()))
    r = CliRunner().invoke(app, ["--results", str(results), "--out", str(tmp_path / "b.png")])
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert (tmp_path / "b.png").read_bytes().startswith(PNG_MAGIC)


def test_chart_labels_title_and_bad_input(tmp_path):
    """Systems in bench's order and under its table's names; the CPU model and date in the title;
    empty results and a file that is not JSON are refused, with no PNG written."""
    result = bench_result()
    systems = system_order(result["results"])
    assert systems == ["hf", "tp1", "tp2", "tp1-int8", "tp2-int8", "tp1-int4", "tp2-int4"]
    assert all(system_label(s) == _name(s) for s in systems)  # the names of bench's table
    title = chart_title(result, "2026-12-03 05:33")
    assert "Intel(R) Xeon(R) Platinum 8480+" in title and "2026-12-03 05:33" in title and "AMX no" in title
    with pytest.raises(ValueError, match="no results"):
        draw_chart({"results": {}}, tmp_path / "c.png", "x")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = CliRunner().invoke(app, ["--results", str(bad), "--out", str(tmp_path / "d.png")])
    assert r.exit_code == 2 and not (tmp_path / "d.png").exists()


def test_chart_roofline_panels_and_peers(tmp_path):
    """A run with a roofline adds the TPOT / floor and FLOP-fraction panels and the roofline's line to
    the title; a bench-peers JSON is one group of its rows, each under its name and precision."""
    from benchmarks import roofline
    from benchmarks.bench_report import add_limits

    result = bench_result()
    assert [p[0] for p in chart_panels(result["results"])] == ["output_tok_s", "tpot_ms"]
    result["roofline"] = {"triad_mib": 128, "bandwidth": [{"procs": 1, "threads": 2, "gb_s": 25.0},
                                                          {"procs": 2, "threads": 1, "gb_s": 20.0}],
                          "gemm": {"float32": {"gflop_s": 100.0}, "bfloat16": {"gflop_s": 200.0}, "int8": None}}
    tensors = roofline.ModelTensors(linears=((64, 64, 8),), experts=(), expert_share=1.0, head=(256, 64), tied=False,
                                    vector_params=256, kv_per_token=128)
    add_limits(result["results"], result["roofline"], tensors, 20, 2)
    assert [p[0] for p in chart_panels(result["results"])] == ["output_tok_s", "tpot_ms", "tpot_vs_floor",
                                                               "flops_fraction"]
    assert chart_title(result, "d").endswith("\nroofline: triad 25.0 GB/s (1 x 2 threads), 20.0 GB/s (2 x 1 "
                                             "threads); GEMM GFLOP/s float32 100, bfloat16 200, int8 -")
    peers = {"config": result["config"], "machine": result["machine"], "roofline": result["roofline"],
             "systems": {"tpengine-int4": {"name": "tpengine tp=1", "precision": "int4 weights, bf16 act."},
                         "llama.cpp-q4_1": {"name": "llama-cpp-python 0.3.36", "precision": "Q4_1 (GGUF)"}},
             "results": {"tpengine-int4": {"output_tok_s": 400.0, "tpot_ms": 5.0, "floor_ms": 3.0,
                                           "tpot_vs_floor": 1.67, "flops_fraction": 0.25},
                         "llama.cpp-q4_1": {"tpot_ms": 9.0, "floor_ms": 3.2, "tpot_vs_floor": 2.81}}}
    groups, systems, labels = chart_groups(peers)
    assert list(groups) == [PEERS_GROUP] and systems == ["tpengine-int4", "llama.cpp-q4_1"]
    assert labels["llama.cpp-q4_1"] == "llama-cpp-python 0.3.36 Q4_1 (GGUF)"
    assert chart_title(peers, "d").startswith("make bench-peers, ")
    assert len(chart_panels(groups)) == 4  # drawn two a row, the floor's panel with its line at 1
    assert draw_chart(peers, tmp_path / "p.png", "d").read_bytes().startswith(PNG_MAGIC)
