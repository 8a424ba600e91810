"""tpengine-shard: convert output, split/reassemble round trips, manifest, verify, info."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from shard_tool.cli import app
from shard_tool.common import atomic_dir
from shard_tool.info import rank_bytes, weight_shapes
from shard_tool.split import split_model
from tpengine.model import plan as P
from tpengine.model.checkpoint import sha256_file
from tpengine.model.plan import ShardPlan
from tpengine.model.surgery import kind_of

runner = CliRunner()


def cli(*args: str):
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result


def original_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def reassemble(plan: ShardPlan, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Undo the split of one tensor: concat along the split dim, dedupe replicated KV heads,
    strip vocab padding."""
    kind, is_bias = kind_of(name, shards[0].dim()), name.endswith(".bias")
    spec = plan.slice_spec(kind, is_bias, 0)
    if spec is None:
        for s in shards[1:]:
            assert torch.equal(s, shards[0]), f"{name}: replicated tensor differs between ranks"
        return shards[0]
    dim = spec[0]
    if kind in (P.K, P.V):
        heads: dict[int, torch.Tensor] = {}
        for rp, s in zip(plan.ranks, shards):
            for j, h in enumerate(range(*rp.kv_heads)):
                piece = s.narrow(0, j * plan.head_dim, plan.head_dim)
                if h in heads:  # a replicated KV head must be an identical copy
                    assert torch.equal(piece, heads[h]), f"{name}: copies of KV head {h} differ"
                heads[h] = piece
        assert sorted(heads) == list(range(plan.num_kv_heads)), f"{name}: KV heads missing"
        return torch.cat([heads[h] for h in sorted(heads)], 0)
    full = torch.cat(shards, dim)
    if kind == P.VOCAB:
        assert full.shape[0] == plan.padded_vocab_size
        assert not full[plan.vocab_size:].any(), f"{name}: vocab padding rows are not zero"
        full = full[: plan.vocab_size]
    return full


def check_round_trip(model_dir: Path, out: Path, tp: int) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    config = json.loads((model_dir / "config.json").read_text())
    plan = ShardPlan.from_dict(manifest["plan"])
    assert manifest["tp_size"] == tp == plan.tp_size
    assert manifest["format_version"] == 1 and manifest["dtype"] == "float32"
    from transformers import AutoConfig

    assert plan == ShardPlan.build(AutoConfig.from_pretrained(model_dir), tp)
    orig = original_tensors(model_dir)
    tied = config.get("tie_word_embeddings", False)
    ranks = []
    for r in range(tp):
        fname = f"rank-{r:02d}-of-{tp:02d}.safetensors"
        entry = manifest["shard_files"][r]
        assert entry == {"name": fname, "rank": r, "sha256": sha256_file(out / fname),
                         "bytes": (out / fname).stat().st_size}
        ranks.append(load_file(out / fname))
        assert {n: list(t.shape) for n, t in ranks[-1].items()} == manifest["tensors"][str(r)]
    expected_names = set(orig) - ({"lm_head.weight"} if tied else set())
    for shards in ranks:
        assert set(shards) == expected_names
    for name in expected_names:
        got = reassemble(plan, name, [shards[name] for shards in ranks])
        assert torch.equal(got, orig[name]), f"{name} at tp={tp}"
    src = {s["name"]: s["sha256"] for s in manifest["source_files"]}
    for f in model_dir.glob("*.safetensors"):
        assert src[f.name] == sha256_file(f)
    for side in ("config.json", "generation_config.json", "tokenizer.json"):
        if (model_dir / side).exists():
            assert (out / side).read_bytes() == (model_dir / side).read_bytes()
    return manifest


MODELS = {
    "llama-untied": ("llama", {"random_biases": True}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    "qwen2-bias": ("qwen2", {"random_biases": True}),
    "qwen3-head_dim32": ("qwen3", {"head_dim": 32, "random_biases": True}),
    "llama-6h-2kv-bias": (
        "llama",
        {"num_attention_heads": 6, "hidden_size": 96, "attention_bias": True, "mlp_bias": True,
         "random_biases": True},
    ),
}


@pytest.mark.parametrize("key", list(MODELS))
def test_split_reassembles_exactly(tmp_path: Path, key: str) -> None:
    arch, kw = MODELS[key]
    model_dir = make_tiny_model(tmp_path, arch, **kw)
    if key == "qwen2-bias":  # the q/k/v biases exist and are non-zero
        t = original_tensors(model_dir)
        assert t["model.layers.0.self_attn.k_proj.bias"].abs().min() > 0
    for tp in range(1, 5):
        out = tmp_path / f"tp{tp}"
        manifest = split_model(model_dir, tp, out)
        check_round_trip(model_dir, out, tp)
        if key == "llama-tied":  # case C03
            assert manifest["config"]["tie_word_embeddings"] is True
            for r in range(tp):
                with safe_open(out / f"rank-{r:02d}-of-{tp:02d}.safetensors", "pt") as f:
                    assert "lm_head.weight" not in set(f.keys())
        # info's byte count (from config shapes only) equals what the rank files hold
        shapes = weight_shapes(manifest_config(out))
        assert rank_bytes(ShardPlan.from_dict(manifest["plan"]), shapes, "float32") == [
            sum(t.numel() * 4 for t in load_file(out / f"rank-{r:02d}-of-{tp:02d}.safetensors").values())
            for r in range(tp)
        ]


def manifest_config(out: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(out)


def test_tied_checkpoint_with_lm_head(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    t = load_file(model_dir / "model.safetensors")
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    save_file(t, model_dir / "model.safetensors", metadata={"format": "pt"})
    split_model(model_dir, 2, tmp_path / "ok")
    with safe_open(tmp_path / "ok" / "rank-00-of-02.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    t["lm_head.weight"][0, 0] += 1.0
    save_file(t, model_dir / "model.safetensors", metadata={"format": "pt"})
    r = cli("split", model_dir, "--tp", "2", "--out", tmp_path / "bad")
    assert r.exit_code == 2 and "lm_head.weight differs" in r.output
    assert not (tmp_path / "bad").exists()


def test_multi_file_checkpoint_and_missing_file(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "qwen2", random_biases=True, max_shard_size="100KB")
    files = sorted(p.name for p in model_dir.glob("model-*.safetensors"))
    assert len(files) >= 2 and (model_dir / "model.safetensors.index.json").exists()
    manifest = split_model(model_dir, 3, tmp_path / "tp3")
    check_round_trip(model_dir, tmp_path / "tp3", 3)
    assert {s["name"] for s in manifest["source_files"]} == set(files) | {"model.safetensors.index.json"}
    (model_dir / files[1]).unlink()
    r = cli("split", model_dir, "--tp", "2", "--out", tmp_path / "out")
    assert r.exit_code == 2
    assert files[1] in r.output and "missing" in r.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_verify_ok_then_corrupt_byte(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama")
    out = tmp_path / "tp3"
    r = cli("split", model_dir, "--tp", "3", "--out", out)
    assert r.exit_code == 0, r.output
    r = cli("verify", out)
    assert r.exit_code == 0 and r.output.startswith("OK"), r.output
    victim = out / "rank-01-of-03.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    r = cli("verify", out)
    assert r.exit_code != 0
    assert "rank-01-of-03.safetensors" in r.output and "sha256" in r.output
    assert "rank-00-of-03" not in r.output and "rank-02-of-03" not in r.output


def test_verify_catches_shape_against_plan(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama")
    out = tmp_path / "tp2"
    split_model(model_dir, 2, out)
    # a rank file with a wrong q_proj shard that manifest and hashes agree with: only the plan
    # check can catch it
    name, victim = "model.layers.1.self_attn.q_proj.weight", out / "rank-00-of-02.safetensors"
    t = load_file(victim)
    t[name] = t[name][:16].clone()
    save_file(t, victim, metadata={"format": "pt"})
    m = json.loads((out / "manifest.json").read_text())
    m["tensors"]["0"][name] = [16, 64]
    m["shard_files"][0]["sha256"] = sha256_file(victim)
    (out / "manifest.json").write_text(json.dumps(m))
    r = cli("verify", out)
    assert r.exit_code == 1
    assert f"rank-00-of-02.safetensors: tensor {name} has shape [16, 64]" in r.output
    assert "size 32 along dim 0" in r.output


def test_split_dtype_and_errors(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "qwen3", head_dim=32)
    out = tmp_path / "bf16"
    assert cli("split", model_dir, "--tp", "2", "--out", out, "--dtype", "bfloat16").exit_code == 0
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "rank-01-of-02.safetensors").values())
    assert cli("verify", out).exit_code == 0
    r = cli("split", model_dir, "--tp", "2", "--out", out)
    assert r.exit_code == 2 and "already exists" in r.output
    r = cli("split", model_dir, "--tp", "5", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "tp_size=5" in r.output and "num_attention_heads=4" in r.output
    r = cli("split", model_dir, "--tp", "2", "--out", tmp_path / "x", "--dtype", "int8")
    assert r.exit_code == 2 and "'int8'" in r.output and "bfloat16" in r.output
    r = cli("split", tmp_path / "nowhere", "--tp", "2", "--out", tmp_path / "x")
    assert r.exit_code == 2 and "nowhere" in r.output and "config.json" in r.output
    assert not (tmp_path / "x").exists()


def table_rows(output: str) -> list[list[str]]:
    return [line.split() for line in output.splitlines() if line.split() and line.split()[0].isdigit()]


def test_info_valid_and_invalid_tp(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    d = tmp_path / "nine"
    LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=144, intermediate_size=200,
                num_hidden_layers=1, vocab_size=1000).save_pretrained(d)
    r = cli("info", d, "--tp", "10")
    assert r.exit_code != 0
    assert "tp_size=10" in r.output and "num_attention_heads=9" in r.output
    r = cli("info", d)
    assert r.exit_code == 0, r.output
    assert [row[0] for row in table_rows(r.output)] == [str(i) for i in range(1, 10)]
    assert "valid TP sizes: 1..9" in r.output


def modes(folder: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.iterdir()]}


def test_split_and_convert_output_get_default_modes(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama")
    (model_dir / "config.json").chmod(0o600)  # a private source file is not copied as private
    old = os.umask(0o022)
    try:
        r = cli("split", model_dir, "--tp", "2", "--out", tmp_path / "tp2")
        assert r.exit_code == 0, r.output
        got = modes(tmp_path / "tp2")
        assert got == {"tp2": 0o755, **{name: 0o644 for name in got if name != "tp2"}}
        assert {"rank-00-of-02.safetensors", "rank-01-of-02.safetensors", "manifest.json", "config.json"} <= set(got)
        # convert writes through the same atomic_dir (save_pretrained -> safetensors' save_file: 0600)
        os.umask(0o002)
        with atomic_dir(tmp_path / "converted") as tmp:
            save_file({"w": torch.zeros(2)}, tmp / "model.safetensors")
            (tmp / "config.json").write_text("{}")
        assert modes(tmp_path / "converted") == {"converted": 0o775, "model.safetensors": 0o664, "config.json": 0o664}
    finally:
        os.umask(old)


def test_convert_errors(tmp_path: Path) -> None:
    r = cli("convert", tmp_path / "missing.gguf", tmp_path / "out")
    assert r.exit_code == 2 and "missing.gguf" in r.output and "does not exist" in r.output


def test_converted_smollm2_says_paris(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (smollm2_dir / "generation_config.json").exists()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text


def test_smollm2_info_split_verify(smollm2_dir: Path, tmp_path: Path) -> None:
    r = cli("info", smollm2_dir, "--tp", "2")
    assert r.exit_code == 0, r.output
    rows = table_rows(r.output)
    plan_rows, estimate_rows = rows[:2], rows[2:]
    # columns: rank, q heads, #q, kv heads, #kv, q->kv, intermediate, vocab, bytes, MiB
    assert [(row[1], row[2], row[3], row[4]) for row in plan_rows] == [("0:5", "5", "0:2", "2"),
                                                                      ("5:9", "4", "1:3", "2")]
    # the per-rank memory estimate: weights (the plan's bytes), KV at the default 1 GiB budget,
    # runtime, total = their sum (to the printed rounding)
    assert [row[0] for row in estimate_rows] == ["0", "1"]
    for plan_row, (_, weights, kv, kv_token, runtime, total) in zip(plan_rows, estimate_rows):
        assert float(weights) == round(int(plan_row[8]) / 2**30, 2)
        assert kv == "1.00" and float(runtime) > 0.5
        assert kv_token == str(2 * 30 * 2 * 64 * 4)  # K and V, 30 layers, 2 KV heads of 64, float32
        assert abs(float(total) - (float(weights) + float(kv) + float(runtime))) <= 0.011
    r = cli("info", smollm2_dir, "--tp", "2", "--kv-cache-gb", "0.25")
    assert [row[2] for row in table_rows(r.output)[2:]] == ["0.25", "0.25"]
    r = cli("info", smollm2_dir, "--tp", "2", "--kv-cache-dtype", "int8")  # int8 codes + a float32 scale per row
    assert [row[3] for row in table_rows(r.output)[2:]] == [str(2 * 30 * 2 * (64 + 4))] * 2
    out = tmp_path / "tp2"
    r = cli("split", smollm2_dir, "--tp", "2", "--out", out)
    assert r.exit_code == 0, r.output
    r = cli("verify", out)
    assert r.exit_code == 0 and r.output.startswith("OK"), r.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["tp_size"] == 2
    assert m["tensors"]["0"]["model.layers.0.self_attn.q_proj.weight"] == [320, 576]
    assert m["tensors"]["1"]["model.layers.0.self_attn.k_proj.weight"] == [128, 576]
    assert "lm_head.weight" not in m["tensors"]["0"]
