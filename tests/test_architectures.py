"""Decoders of other families are refused as a user's mistake, in the job and in the shard tool."""

from __future__ import annotations

import json
import subprocess

import launch


def run(args: list[str], tp: int) -> subprocess.CompletedProcess:
    """``tpengine.entrypoints.run`` at tp=1 (python -m) or under torchrun (a real one: its report is checked)."""
    return launch.run(launch.command("tpengine.run", args, tp, real=tp > 1), check=False)


def test_unsupported_architecture_is_one_line_exit_2(tmp_path):
    """A decoder of another family (GPT-2: no intermediate_size; GPT-NeoX: no ``model.model``) is
    the user's mistake: one line naming its model_type, exit 2, no traceback -- in the job at tp=1
    and tp=2 (the rank's line, and no traceback recorded for torchrun) and in the shard tool."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

    from shard_tool.cli import app as shard_app

    gpt2, neox = tmp_path / "gpt2", tmp_path / "neox"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=1000)).save_pretrained(gpt2)
    GPTNeoXForCausalLM(GPTNeoXConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=1000)).save_pretrained(neox)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 2}) + "\n")
    for model, tp in ((gpt2, 1), (neox, 1), (neox, 2)):
        r = run(["--prompts", str(prompts), "--model", str(model), "--out", str(tmp_path / "o.jsonl")], tp)
        mtype = "gpt2" if model == gpt2 else "gpt_neox"
        lines = [ln for ln in r.stderr.splitlines() if f"model_type {mtype!r}" in ln]
        assert lines and all("failed: UserError" in ln for ln in lines), r.stderr[-3000:]
        if tp == 1:
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        else:  # torchrun exits 1 for any failed child; the child itself exited 2 and recorded no traceback
            assert r.returncode != 0 and "exitcode  : 2" in r.stderr and "error_file: <N/A>" in r.stderr
    from typer.testing import CliRunner

    r = CliRunner().invoke(shard_app, ["info", str(gpt2), "--tp", "1"])
    assert r.exit_code == 2
    assert "model_type 'gpt2' is not supported; tpengine runs gemma, gemma2, gemma3_text, granite, llama" in r.output


def test_unsupported_feature_is_one_line_exit_2(tmp_path):
    """A family tpengine runs, with a config feature no layer computes (Phi-4-mini's partial rotary
    embeddings): one line naming the field and its value, exit 2, before any weight is read."""
    from conftest import make_tiny_model

    d = make_tiny_model(tmp_path, "phi3", partial_rotary_factor=0.75)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 2}) + "\n")
    r = run(["--prompts", str(prompts), "--model", str(d), "--out", str(tmp_path / "o.jsonl")], 1)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    message = ("model_type 'phi3': partial_rotary_factor=0.75 (RoPE on part of each head) is not supported; "
               "tpengine rotates whole heads (partial_rotary_factor 1.0)")
    assert message in r.stderr
    from typer.testing import CliRunner

    from shard_tool.cli import app as shard_app

    for args in (["info", str(d), "--tp", "2"], ["split", str(d), "--tp", "2", "--out", str(tmp_path / "s")]):
        r = CliRunner().invoke(shard_app, args)  # the shard tool refuses what the engine would
        assert r.exit_code == 2 and message in " ".join(r.output.split()), r.output
    assert not (tmp_path / "s").exists()
