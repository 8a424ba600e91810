"""A model folder's generation_config.json is the job's sampling defaults: a SmolLM2 copy whose
generation_config.json sets ``repetition_penalty`` 1.3, ``do_sample`` false and ``max_new_tokens`` 24
gives, through the real job at tp 1 and 2 with no sampling field in any request, exactly the tokens
of Hugging Face ``generate(**inputs)`` with no arguments (it reads the same file), in float32."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import SMOLLM2_DIR
from launch import cli
from test_cli import records, write_jsonl

PROMPTS = ["The capital of France is", "List three colors: red, red, red,", "Once upon a time, once upon a"]


@pytest.fixture(scope="module")
def penalized(tmp_path_factory):
    if not (SMOLLM2_DIR / "model.safetensors").is_file():
        pytest.skip("needs the converted SmolLM2 (make model)")
    d = tmp_path_factory.mktemp("smollm2-penalized")
    for p in SMOLLM2_DIR.iterdir():
        if p.is_file():
            (d / p.name).symlink_to(p) if p.suffix == ".safetensors" else shutil.copy(p, d / p.name)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps(
        {**gen, "repetition_penalty": 1.3, "do_sample": False, "max_new_tokens": 24}))
    return d


@pytest.fixture(scope="module")
def hf_tokens(penalized):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(penalized)
    m = AutoModelForCausalLM.from_pretrained(penalized, dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for i, text in enumerate(PROMPTS):
            ids = tok(text, return_tensors="pt")
            gen = m.generate(**ids)  # everything from generation_config.json
            out[str(i)] = gen[0, ids["input_ids"].shape[1]:].tolist()
    return out


@pytest.mark.parametrize("tp", (1, 2))
def test_generation_config_defaults_give_hf_tokens(penalized, hf_tokens, tmp_path, tp):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": str(i), "prompt": t} for i, t in enumerate(PROMPTS)])
    out = tmp_path / "out.jsonl"
    p = cli(["--model", penalized, "--prompts", prompts, "--out", out, "--dtype", "float32",
             "--max-model-len", "256", "--kv-cache-gb", "0.1"], tp=tp, timeout=300)
    assert (f"tpengine: sampling defaults from {penalized}/generation_config.json: temperature=0.0, "
            "repetition_penalty=1.3, max_tokens=24 (--generation-config ignore to use tpengine's own)") in p.stderr
    got = {rid: r["token_ids"] for rid, r in records(out).items()}
    assert got == hf_tokens
    assert all(len(t) == 24 or t[-1] == 2 for t in got.values())
    plain = cli(["--model", penalized, "--prompts", prompts, "--out", tmp_path / "plain.jsonl", "--dtype", "float32",
                 "--max-model-len", "256", "--kv-cache-gb", "0.1", "--generation-config", "ignore",
                 "--temperature", "0", "--max-tokens", "24"], tp=tp, timeout=300)
    assert "sampling defaults from" not in plain.stderr
    assert {rid: r["token_ids"] for rid, r in records(tmp_path / "plain.jsonl").items()} != hf_tokens
