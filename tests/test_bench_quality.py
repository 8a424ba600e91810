"""``python -m benchmarks.quality`` (make quality): its metrics on hand-made values, and a smoke run
on a tiny random model (bf16 / int8 / int4 engines, the GGUF row skipped when absent or broken)."""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest
from conftest import make_tiny_model
from typer.testing import CliRunner

from benchmarks import quality_metrics as qm


def _lp(x: float) -> SimpleNamespace:
    return SimpleNamespace(chosen=SimpleNamespace(logprob=x))


def test_first_solution_token_counts_a_boundary_token_as_solution():
    # "def f():\n" + "    return 1": the tokenizer merges "\n" with the indentation ("\n    ")
    offsets = [(0, 3), (3, 5), (5, 8), (8, 13), (13, 19), (19, 20), (20, 21)]
    assert qm.first_solution_token(offsets, 9) == 3
    assert qm.first_solution_token(offsets, 8) == 3  # a token ending exactly at the prompt's end is the prompt's
    assert qm.first_solution_token(offsets, 13) == 4
    with pytest.raises(ValueError, match="no token ends past the prompt's 21 characters: the solution is empty"):
        qm.first_solution_token(offsets, 21)
    with pytest.raises(ValueError, match="the first token already holds solution characters"):
        qm.first_solution_token(offsets, 2)


def test_solution_nll_and_perplexity():
    lps = [None, _lp(-1.0), _lp(-0.5), _lp(-0.25)]
    assert qm.solution_nll(lps, 2) == (0.75, 2)
    assert qm.solution_nll(lps, 1) == (1.75, 3)
    assert qm.perplexity(0.75, 2) == math.exp(0.375)
    with pytest.raises(ValueError, match=r"first scored position 4 is outside \[1, 4\)"):
        qm.solution_nll(lps, 4)
    with pytest.raises(ValueError, match=r"first scored position 0 is outside \[1, 4\)"):
        qm.solution_nll(lps, 0)
    with pytest.raises(ValueError, match="perplexity of 0 tokens: needs at least 1"):
        qm.perplexity(0.0, 0)


def test_greedy_agreement_counts_tokens_up_to_the_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 2]]
    other = [[1, 2, 9, 4], [5, 6], [7, 8, 9]]  # diverges at 2; equal; stops one token early
    got = qm.greedy_agreement(ref, other)
    assert got == {"prefix_agreement": (2 + 2 + 3) / 10, "exact_match": 1 / 3, "prompts": 3}
    assert qm.greedy_agreement(ref, ref) == {"prefix_agreement": 1.0, "exact_match": 1.0, "prompts": 3}
    with pytest.raises(ValueError, match="2 completions to compare with 3 reference ones"):
        qm.greedy_agreement(ref, other[:2])
    with pytest.raises(ValueError, match="the reference completions hold no tokens"):
        qm.greedy_agreement([[]], [[1]])


def test_ppl_verdict_thresholds():
    assert qm.PPL_THRESHOLDS == {"int8": 0.005, "int4": 0.03, "gguf": 0.05, "kv-int8": 0.005}
    assert qm.relative_change(101.0, 100.0) == pytest.approx(0.01)
    assert qm.ppl_verdict("int8", 0.0049) is True and qm.ppl_verdict("int8", 0.0051) is False
    assert qm.ppl_verdict("int8", -0.0051) is False  # |change|: lower by more than 0.5 % is a change too
    assert qm.ppl_verdict("int4", 0.029) is True and qm.ppl_verdict("int4", 0.031) is False
    assert qm.ppl_verdict("gguf", 0.049) is True and qm.ppl_verdict("gguf", 0.051) is False
    assert qm.ppl_verdict("bf16", 0.5) is None


def test_quality_smoke(tmp_path):
    from transformers import AutoTokenizer

    from benchmarks.humaneval import humaneval_problems
    from benchmarks.quality import app, scoring_requests

    # the SmolLM2 tokenizer's ids need its vocabulary; int4 needs input features in groups of 32
    model = make_tiny_model(tmp_path, "llama", seed=0, vocab_size=49152, intermediate_size=128)
    broken = tmp_path / "broken-gguf"
    broken.mkdir()
    shutil.copy2(model / "config.json", broken / "config.json")  # a config and no weights
    out = tmp_path / "quality.json"
    args = ["--model", str(model), "--limit", "3", "--max-tokens", "4", "--out", str(out)]
    runner = CliRunner()
    r = runner.invoke(app, [*args, "--gguf-dir", str(broken)], terminal_width=200)
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert f"gguf: skipped: {broken} does not load (" in " ".join(r.output.split())  # rich wraps long lines
    res = json.loads(out.read_text())
    assert list(res["results"]) == ["bf16", "int8", "int4", "kv-int8"]
    problems = humaneval_problems()[:3]
    scoring = scoring_requests(AutoTokenizer.from_pretrained(model), problems)
    tokens = sum(len(ids) - first for ids, first in scoring)
    for name, row in res["results"].items():
        assert row["solution_tokens"] == tokens and row["perplexity"] > 1, name
        assert row["weight_bytes"] > 0
        assert len(res["completions"][name]) == 3 and all(1 <= len(c) <= 4 for c in res["completions"][name])
    bf16 = res["results"]["bf16"]
    assert bf16["prefix_agreement"] == 1.0 and bf16["exact_match"] == 1.0 and bf16["ppl_pass"] is None
    assert res["results"]["int8"]["threshold"] == 0.005 and res["results"]["int4"]["threshold"] == 0.03
    assert res["results"]["int4"]["weight_bytes"] < res["results"]["int8"]["weight_bytes"] < bf16["weight_bytes"]
    assert res["results"]["kv-int8"]["threshold"] == 0.005 and res["results"]["kv-int8"]["weight_bytes"] == \
        bf16["weight_bytes"]  # the bf16 weights over an int8 KV cache
    assert res["config"] == {"model": str(model), "gguf_dir": str(broken), "problems": 3, "max_tokens": 4,
                             "max_model_len": res["config"]["max_model_len"], "tp": 1, "threads": None,
                             "activations": "bfloat16"}
    assert "machine: " in r.output and "HumanEval quality, 3 problems" in r.output
    assert "0.5%" in r.output  # int8's limit, as the table prints it

    # --configs and an absent --gguf-dir in one run (the folder is checked before any engine, whatever the
    # configs): two engines, not a second run of all four for the skip line
    r = runner.invoke(app, [*args, "--configs", "int4", "--gguf-dir", str(tmp_path / "absent")], terminal_width=200)
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert list(json.loads(out.read_text())["results"]) == ["bf16", "int4"] and "3%" in r.output
    assert f"gguf: skipped: {tmp_path / 'absent'} is not a model folder (no config.json)" in " ".join(r.output.split())
