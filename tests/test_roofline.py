"""The roofline's arithmetic (:mod:`benchmarks.roofline`): the bytes a decode step reads per precision
for known configs, the floor and FLOP fractions of a row, the limits as the tables show them, and the
triad and GEMM measurements in this process (tiny sizes; figures positive, never timed)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from rich.console import Console
from transformers import LlamaConfig, Qwen3MoeConfig

import benchmarks.bench_peers as bp
from benchmarks import roofline as rl

#: SmolLM2-135M's shape (models/smollm2-135m-instruct/config.json): 30 layers, hidden 576, 9 heads of
#: 64, 3 KV heads, MLP 1536, vocabulary 49152, the head tied to the embedding.
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
#: Weights a token multiplies by: 30 x (q 576^2 + k, v 192 x 576 + o 576^2 + gate, up, down 3 x 1536 x 576)
#: + the head 49152 x 576.
SMOLLM2_MATMUL = 30 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576) + 49152 * 576
SMOLLM2_VECTORS = 30 * 2 * 576 + 576  # two RMSNorms a layer and the final one
SMOLLM2_ROWS = 30 * (576 + 192 + 192 + 576 + 1536 + 1536 + 576) + 49152  # output rows of every matrix
KV_PER_TOKEN = 2 * 30 * 3 * 64  # K and V, every layer, 3 heads of 64


@pytest.fixture(scope="module")
def smollm2():
    return rl.model_tensors(LlamaConfig(**SMOLLM2))


def test_smollm2_bytes_per_precision(smollm2):
    """Weight bytes equal to the engine's ``ModelRunner.weight_bytes`` for SmolLM2 at tp=1 (README:
    256.6, 128.7, 76.2 MiB; docs/notes/quantized-head.md), and a decode step's bytes = those plus the
    KV cache at the context (the head tied: no embedding row on top)."""
    t = smollm2
    assert t.tied and t.head == (49152, 576) and t.kv_per_token == KV_PER_TOKEN and t.expert_share == 1.0
    assert rl.matmul_params(t) == SMOLLM2_MATMUL and t.vector_params == SMOLLM2_VECTORS
    expect = {  # (precision, weight bytes, KV bytes an element)
        "float32": (rl.tpengine_precision("float32", None), 4 * (SMOLLM2_MATMUL + SMOLLM2_VECTORS), 4),
        "bfloat16": (rl.tpengine_precision("bfloat16", None), 269030016, 2),
        # int8 per output channel, a bfloat16 scale a row
        "int8": (rl.tpengine_precision("bfloat16", "int8"), 134959488, 2),
        # int4 groups of 32: half a byte a weight, a bfloat16 scale and an int8 zero code a group
        "int4": (rl.tpengine_precision("bfloat16", "int4"), 79917696, 2),
        # CTranslate2 int8: a float32 scale a row, float32 norms and KV
        "ct2 int8": (rl.ct2_precision("int8"), SMOLLM2_MATMUL + 4 * SMOLLM2_ROWS + 4 * SMOLLM2_VECTORS, 4),
    }
    assert expect["bfloat16"][1] == 2 * (SMOLLM2_MATMUL + SMOLLM2_VECTORS)
    assert expect["int8"][1] == SMOLLM2_MATMUL + 2 * SMOLLM2_ROWS + 2 * SMOLLM2_VECTORS
    assert expect["int4"][1] == SMOLLM2_MATMUL // 2 + 3 * SMOLLM2_MATMUL // 32 + 2 * SMOLLM2_VECTORS
    for name, (p, weights, kv) in expect.items():
        assert rl.weight_bytes(t, p) == weights, name
        assert rl.decode_bytes(t, p, 0) == weights, name
        assert rl.decode_bytes(t, p, 160) == weights + KV_PER_TOKEN * 160 * kv, name
    assert rl.ct2_precision("float32") == rl.float_precision("float32") == rl.tpengine_precision("float32", None)
    assert [rl.tpengine_precision("bfloat16", q).compute for q in (None, "int8", "int4")] == ["bfloat16"] * 3
    assert rl.ct2_precision("int8").compute == "int8"
    with pytest.raises(ValueError, match="compute_type 'int16' is not one of float32, int8"):
        rl.ct2_precision("int16")
    with pytest.raises(ValueError, match="dtype 'int3' is not one of float32, bfloat16, float16"):
        rl.float_precision("int3")


def test_untied_head_and_experts():
    """An untied head: the embedding's table is held (weight bytes) but a decode step reads one row of
    it; a mixture of experts: a step reads top-k / experts of the expert matrices."""
    tied = rl.model_tensors(LlamaConfig(**SMOLLM2))
    untied = rl.model_tensors(LlamaConfig(**{**SMOLLM2, "tie_word_embeddings": False}))
    p = rl.float_precision("bfloat16")
    assert not untied.tied
    assert rl.weight_bytes(untied, p) - rl.weight_bytes(tied, p) == 2 * 49152 * 576
    assert rl.decode_bytes(untied, p, 10) - rl.decode_bytes(tied, p, 10) == 2 * 576
    moe = rl.model_tensors(Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                          num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                                          mlp_only_layers=[], tie_word_embeddings=False))
    assert moe.expert_share == 0.25 and moe.kv_per_token == 2 * 2 * 2 * 16
    experts = sum(r * c * n for r, c, n in moe.experts)
    assert experts == 2 * 8 * (2 * 32 * 64 + 64 * 32)  # gate+up [64, 64] and down [64, 32], 8 experts, 2 layers
    dense = sum(r * c * n for r, c, n in moe.linears)
    assert rl.matmul_params(moe) == dense + experts / 4 + 256 * 64
    assert rl.weight_bytes(moe, p) - rl.decode_bytes(moe, p, 0) == 2 * (experts * 3 // 4 + 255 * 64)


def _write_gguf(path, untied: bool):
    """A GGUF of two tensors of SmolLM2's head shape and blocks: a Q8_0 token_embd (34 bytes / 32), one
    Q4_1 [1536, 576] linear (20 bytes / 32), an F32 norm; an F16 output.weight with ``untied``."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((49152, 576 // 32 * 34), np.uint8), raw_dtype=T.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((1536, 576 // 32 * 20), np.uint8), raw_dtype=T.Q4_1)
    w.add_tensor("output_norm.weight", np.ones(576, np.float32))
    if untied:
        w.add_tensor("output.weight", np.zeros((49152, 576), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_decode_bytes(tmp_path, smollm2):
    """llama.cpp's bytes from its GGUF's tensor table: each tensor as stored, token_embd as the head
    (tied) or one row of it (an output.weight present), plus an f16 KV cache."""
    linear, norm = 1536 * 576 // 32 * 20, 576 * 4
    tied = _write_gguf(tmp_path / "tied.gguf", False)
    assert rl.gguf_decode_bytes(tied, smollm2, 0) == 49152 * 576 // 32 * 34 + linear + norm
    assert rl.gguf_decode_bytes(tied, smollm2, 100) == 49152 * 576 // 32 * 34 + linear + norm + KV_PER_TOKEN * 100 * 2
    untied = _write_gguf(tmp_path / "untied.gguf", True)
    assert rl.gguf_decode_bytes(untied, smollm2, 0) == 576 // 32 * 34 + linear + norm + 49152 * 576 * 2


ROOFLINE = {"triad_mib": 128, "bandwidth": [{"procs": 1, "threads": 2, "gb_s": 25.0},
                                            {"procs": 2, "threads": 1, "gb_s": 20.0}],
            "gemm": {"float32": {"gflop_s": 100.0}, "bfloat16": {"gflop_s": 200.0}, "int8": None}}


def test_row_limits_and_cells(smollm2):
    """floor = bytes / bandwidth, TPOT / floor, 2 x params x tokens/s over the GEMM rate; a figure
    whose input is missing is left out, and the table shows ``-``."""
    got = rl.row_limits(tpot_ms=30.0, tok_s=500.0, nbytes=250e6, bandwidth_gb_s=25.0, params=1e8, gemm_gflop_s=200.0)
    assert got == {"floor_bytes": 250000000, "floor_ms": 10.0, "tpot_vs_floor": 3.0, "flops_fraction": 0.5}
    assert rl.limits_cells(got) == ("10.00", "3.00x", "50.0%")
    assert rl.row_limits(None, None, 100, None, 1e8, None) == {"floor_bytes": 100}
    assert rl.limits_cells({}) == ("-", "-", "-")
    assert rl.bandwidth_of(ROOFLINE, 2, 1) == 20.0 and rl.bandwidth_of(ROOFLINE, 4, 1) is None
    assert rl.gemm_of(ROOFLINE, "bfloat16") == 200.0 and rl.gemm_of(ROOFLINE, "int8") is None
    assert rl.roofline_text(ROOFLINE) == ("roofline: triad 25.0 GB/s (1 x 2 threads), 20.0 GB/s (2 x 1 threads); "
                                          "GEMM GFLOP/s float32 100, bfloat16 200, int8 -")
    assert rl.roofline_text({**ROOFLINE, "load_avg": 9.96}).endswith("int8 - (load average 10.0)")
    row = {"tpot_ms": 20.0, "total_tok_s": 1000.0}  # int8 weights, bfloat16 arithmetic, at tp=2
    p = rl.tpengine_precision("bfloat16", "int8")
    rl.annotate(row, ROOFLINE, smollm2, rl.decode_bytes(smollm2, p, 160), p.compute, 2, 1)
    floor = rl.decode_bytes(smollm2, p, 160) / 20e9 * 1e3  # 138645888 bytes at 20 GB/s: 6.932 ms
    assert row["floor_ms"] == 6.932 and row["tpot_vs_floor"] == round(20.0 / floor, 2) == 2.89
    assert row["flops_fraction"] == float(f"{2 * SMOLLM2_MATMUL * 1000.0 / 200e9:.4g}") == 1.345
    assert rl.mean_context(128, 64) == 160


def test_peer_rows_get_the_limits(tmp_path, smollm2):
    """bench-peers: every row against one process of all cores; llama.cpp's bytes from its GGUF and
    the int8 GEMM (here not measured: no FLOPs), CTranslate2 int8's with float32 scales; the table
    shows the columns and the caption the roofline."""
    gguf = _write_gguf(tmp_path / "m.gguf", False)
    runs = {"tpengine-int4": {"threads": [2], "throughput": [{"elapsed_s": 2.0, "output_tokens": 600,
                                                              "prompt_tokens": 400}],
                              "latency": [{"ttft_s": 0.1, "latency_s": 0.73}]},
            "ctranslate2-int8": {"threads": [2], "throughput": [], "latency": [{"ttft_s": 0.2, "latency_s": 1.2}]},
            "llama.cpp-q4_1": {"threads": [2], "throughput": [{"elapsed_s": 4.0, "output_tokens": 1000}],
                               "latency": [{"ttft_s": 0.05, "latency_s": 0.68}]}}
    results = bp.summarize_peers(runs, 64)
    assert results["tpengine-int4"]["total_tok_s"] == 500.0 and "total_tok_s" not in results["llama.cpp-q4_1"]
    systems = [*bp.TPENGINE_SYSTEMS, *bp.CT2_SYSTEMS, *bp.LLAMA_SYSTEMS]
    bp.add_peer_limits(results, systems, ROOFLINE, smollm2, 160, 2, gguf)
    int4 = rl.decode_bytes(smollm2, rl.tpengine_precision("bfloat16", "int4"), 160)
    assert results["tpengine-int4"]["floor_bytes"] == int4 == 83604096  # 79917696 + 11520 x 160 x 2
    assert results["tpengine-int4"]["floor_ms"] == 3.344  # at 25 GB/s
    assert results["tpengine-int4"]["tpot_vs_floor"] == round(10.0 / (int4 / 25e6), 2) == 2.99
    assert results["tpengine-int4"]["flops_fraction"] == 0.6724  # 2 x 134479872 x 500 / 200e9
    assert results["ctranslate2-int8"]["floor_bytes"] == rl.decode_bytes(smollm2, rl.ct2_precision("int8"), 160)
    assert results["llama.cpp-q4_1"]["floor_bytes"] == rl.gguf_decode_bytes(gguf, smollm2, 160)
    assert "flops_fraction" not in results["llama.cpp-q4_1"]  # no int8 rate measured here
    assert "tpengine-float32" not in results
    result = {"config": {"model": "models/m", "num_prompts": 64, "input_len": 128, "output_len": 128,
                         "latency_input_len": 128, "latency_output_len": 64, "rounds": 2},
              "machine": {"cpu": "AMD EPYC", "cpu_flags": {"AMX": False}, "cores": 2, "torch": "2.13.0+cpu"},
              "systems": {s.key: {"name": s.name, "precision": s.precision, "peer": s.peer} for s in systems},
              "roofline": ROOFLINE, "results": results, "total_s": 12.5}
    console = Console(width=250, record=True)
    console.print(bp.render_peers_table(result))
    text = console.export_text()
    assert "floor ms" in text and "TPOT / floor" in text and "roofline: triad 25.0 GB/s (1 x 2 threads)" in text
    row = next(line for line in text.splitlines() if "int4 weights" in line)
    cells = [c.strip() for c in row.split("│")[7:10]]
    assert cells == list(rl.limits_cells(results["tpengine-int4"]))


def test_triad_and_gemm_measure_in_process():
    """The triad over tiny arrays and each GEMM dtype run and give positive rates (their values are
    the machine's, not checked); int8 is None only where torch has no int8 product."""
    arrays = rl.triad_arrays(1, 1)
    assert arrays[0].numel() == 2**18 and float(arrays[0][0]) == 7.0  # 1 + 3 x 2
    got = rl.triad_best(arrays, time.monotonic(), 0.02)
    assert got["gb_s"] > 0 and float(arrays[0][-1]) == 7.0
    rates = rl.gemm_rates([(4, 32, 48)], 1, 0.005)
    assert rates["float32"]["gflop_s"] > 0 and rates["bfloat16"]["gflop_s"] > 0
    assert set(rates["float32"]["by_shape"]) == {"4x32x48"}
    assert rates["int8"] is None or rates["int8"]["gflop_s"] > 0
    shapes = rl.gemm_shapes(LlamaConfig(**SMOLLM2), 64, 128)
    assert shapes == [(64, 576, 1536), (rl.GEMM_MAX_ROWS, 576, 1536)]
    assert rl.gemm_shapes(LlamaConfig(**SMOLLM2), 4, 2) == [(4, 576, 1536), (8, 576, 1536)]


def test_cli_refuses_bad_options(tmp_path):
    """``python -m benchmarks.roofline``: a bad count or a folder without a config is one error, exit 2,
    before anything is measured."""
    from typer.testing import CliRunner

    cases = [(["--tp", "0"], "--num-prompts, --input-len, --mib and --tp must be >= 1, --threads >= 0"),
             (["--model", str(tmp_path)], f"--model '{tmp_path}': cannot read its config.json")]
    for args, message in cases:
        r = CliRunner().invoke(rl.app, args, terminal_width=400)
        assert r.exit_code == 2, (args, r.output)
        assert message in " ".join(r.output.replace("│", " ").split()), (args, r.output)  # unwrap rich's box
