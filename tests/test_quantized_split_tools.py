"""The quantized split's tools and errors (issue 18): tpengine-shard verify and info on quantized
folders, split's refusals, a full quantized folder split as stored, and the loader's exact errors
for quantized folders. Fixtures and folder builders: tests/test_quantized_split.py."""
# ruff: noqa: F811  (the ``folders`` fixture is imported from there and named by each test)

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_quantized_split import CPU, INT4, INT8, folders, quant_buffers, write_full_quantized  # noqa: F401
from test_shard_tool import cli

from shard_tool.split import split_model
from shard_tool.verify import verify_dir
from tpengine.distributed import TPInfo
from tpengine.errors import UserError
from tpengine.model.checkpoint import sha256_file
from tpengine.model.loader import load_model
from tpengine.model.quant.checkpoint import (
    read_table,
    table_json,
    write_table,
)


def rewrite_rank_file(folder: Path, rank: int, change) -> None:
    """Rewrite ``folder``'s rank file with ``change(tensors)`` applied, and its manifest entry (sha256,
    bytes, shapes) to match, so only the plan and scheme checks can tell."""
    mpath = folder / "manifest.json"
    m = json.loads(mpath.read_text())
    name = f"rank-{rank:02d}-of-{m['tp_size']:02d}.safetensors"
    tensors = load_file(folder / name)
    change(tensors)
    save_file(tensors, folder / name, metadata={"format": "pt"})
    entry = next(e for e in m["shard_files"] if e["name"] == name)
    entry["sha256"], entry["bytes"] = sha256_file(folder / name), (folder / name).stat().st_size
    m["tensors"][str(rank)] = {n: list(t.shape) for n, t in tensors.items()}
    mpath.write_text(json.dumps(m))


def test_verify_quantized(folders, tmp_path):
    good = folders["split/int4/2"]
    r = cli("verify", good)
    assert r.exit_code == 0 and r.stdout == (
        f"OK: {good}: 2 rank files, 114 tensors, dtype float32, quantized int4, group size 32, int8 zero codes: "
        "16 weights, sha256, names and shapes match manifest and plan\n")
    tampered = shutil.copytree(good, tmp_path / "tampered")
    f = tampered / "rank-01-of-02.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    errors = verify_dir(tampered)
    assert len(errors) == 1 and errors[0].startswith("rank-01-of-02.safetensors: sha256 ")
    bad = shutil.copytree(good, tmp_path / "bad")
    down = "model.layers.0.mlp.down_proj"

    def change(t):
        t[f"{down}.scales"] = t[f"{down}.scales"][:, :1].contiguous()  # one group, where the plan gives two
        t[f"{down}.zeros"] = t[f"{down}.zeros"].to(torch.bfloat16)
        del t["model.layers.1.self_attn.q_proj.zeros"]
        t["model.layers.1.mlp.up_proj.weight"] = torch.zeros(64, 64)
        t["model.embed_tokens.scales"] = t["model.embed_tokens.scales"][:500].contiguous()  # a row short

    rewrite_rank_file(bad, 0, change)
    assert verify_dir(bad) == [
        "rank-00-of-02.safetensors: tensor model.layers.1.mlp.up_proj.weight is stored float, but the "
        "quantization table lists it as int4, group size 32, int8 zero codes",
        "rank-00-of-02.safetensors: tensor model.layers.1.self_attn.q_proj.zeros (int4, group size 32, int8 zero "
        "codes) is missing",
        "rank-00-of-02.safetensors: tensor model.embed_tokens.scales has shape [500, 2]; the plan and int4, group "
        "size 32, int8 zero codes give rank 0 [501, 2]",
        f"rank-00-of-02.safetensors: tensor {down}.scales has shape [64, 1]; the plan and int4, group size 32, "
        "int8 zero codes give rank 0 [64, 2]",
        f"rank-00-of-02.safetensors: tensor {down}.zeros has dtype BF16; int4, group size 32, int8 zero codes "
        "stores zeros as I8",
    ]
    r = cli("verify", bad)
    assert r.exit_code == 1 and r.stderr.count("\n") == 5


def test_info_quantized(folders):
    r = cli("info", folders["split/int4/2"], "--tp", "2")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[1] == "quantized: int4, group size 32, int8 zero codes: 16 weights (the rest float32)"
    for rank in (0, 1):  # the weight bytes each rank loads, the quantized vocabulary (rank 1: its padding row) in
        loaded = load_model(folders["split/int4/2"], TPInfo(rank, 2, rank, CPU))
        assert sum(line.split()[:1] == [str(rank)] and str(loaded.weight_bytes) in line.split() for line in lines) == 1
    r = cli("info", folders["full/mixed"])
    assert r.exit_code == 0 and ("quantized: int4, group size 32, int8 zero codes: 8 weights; int8, per output "
                                 "channel: 8 weights (the rest float32)") in r.stdout


# ------------------------------------------------------------------------------ errors
def test_split_errors(folders, tmp_path, smollm2_dir):
    r = cli("split", smollm2_dir, "--tp", "5", "--out", tmp_path / "x", "--quantize", "int4")
    assert (r.exit_code, r.stderr) == (2, (
        "error: --quantization int4 (group size 32) at tp=5: the row-parallel layer mlp.down_proj splits its "
        "input at column 308, not on a group boundary (a multiple of 32); valid tp sizes: 1, 2, 3, 4, 6, 8\n"))
    for args, msg in [
        (("--quantize", "int8", "--group-size", "32"),
         "--group-size 32 applies to --quantize int4 only (int8 has one scale per output channel)"),
        (("--quantize", "int4", "--group-size", "48"), "invalid int4 group size 48: must be one of 32, 64, 128, 256"),
        (("--quantize", "fp8"), "invalid --quantize 'fp8': must be one of int8, int4"),
        (("--group-size", "32"), "--group-size is given without --quantize int4"),
    ]:
        r = cli("split", folders["qwen3"], "--tp", "2", "--out", tmp_path / "x", *args)
        assert (r.exit_code, r.stderr) == (2, f"error: {msg}\n")
    r = cli("split", folders["full/int4"], "--tp", "2", "--out", tmp_path / "x", "--quantize", "int8")
    assert (r.exit_code, r.stderr) == (2, f"error: {str(folders['full/int4'])!r} is already quantized (int4, group "
                                          "size 32, int8 zero codes: 16 weights); split it without --quantize\n")
    assert not (tmp_path / "x").exists()


def test_split_of_a_full_quantized_folder(folders, tmp_path):
    """Splitting a full quantized folder slices its stored parts: the same tensors as split --quantize."""
    out = tmp_path / "resplit"
    m = split_model(folders["full/mixed"], 2, out)
    assert read_table(out) == read_table(folders["full/mixed"]) and verify_dir(out) == []
    assert m["quantization"]["weights"]["model.layers.0.mlp.down_proj.weight"] == {"scheme": "int8", "group_size": None}
    out4 = split_model(folders["full/int4"], 2, tmp_path / "resplit4")
    for r in (0, 1):
        a = load_file(tmp_path / "resplit4" / f"rank-{r:02d}-of-02.safetensors")
        b = load_file(folders["split/int4/2"] / f"rank-{r:02d}-of-02.safetensors")
        assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert out4["quantization"] == json.loads((folders["split/int4/2"] / "manifest.json").read_text())["quantization"]


def test_load_errors(folders, tmp_path):
    split4 = folders["split/int4/2"]
    with pytest.raises(UserError) as e:
        load_model(split4, TPInfo(0, 2, 0, CPU), quantization="int8")
    assert str(e.value) == (f"--quantization int8 (int8, per output channel) disagrees with the quantized folder "
                            f"{str(split4)!r} (int4, group size 32, int8 zero codes: 16 weights); "
                            "drop --quantization to run the "
                            "folder's weights as stored, or pass a float folder to quantize on the fly")
    load_model(split4, TPInfo(1, 2, 1, CPU), quantization="int4")  # the same scheme: loaded as stored
    with pytest.raises(UserError) as e:
        load_model(folders["full/mixed"], TPInfo(0, 1, 0, CPU), quantization="int4")
    assert str(e.value).startswith("--quantization int4 (int4, group size 32, int8 zero codes) disagrees with the "
                                   "quantized folder ")
    with pytest.raises(UserError) as e:
        load_model(folders["full/int4"], TPInfo(0, 3, 0, CPU))
    assert str(e.value) == (
        f"the quantized folder {str(folders['full/int4'])!r} (int4, group size 32, int8 zero codes: 16 weights) "
        "cannot run at tp=3: "
        "--quantization int4 (group size 32) at tp=3: the row-parallel layer mlp.down_proj splits its input at "
        "column 43, not on a group boundary (a multiple of 32); valid tp sizes: 1, 2, 4")
    src = folders["qwen3"]
    merged = write_full_quantized(src, tmp_path / "merged", lambda n: INT4 if "k_proj" in n else None)
    with pytest.raises(UserError) as e:
        load_model(merged, TPInfo(0, 1, 0, CPU))
    assert str(e.value) == (
        "the parts model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.k_proj.weight, "
        "model.layers.0.self_attn.v_proj.weight of one merged layer are stored in different ways (float, int4, "
        "group size 32, int8 zero codes, float); tpengine needs them alike")
    norm = shutil.copytree(folders["full/int8"], tmp_path / "norm")  # a layer with float weights only
    write_table(norm, {**read_table(norm), "model.norm.weight": INT8})
    with pytest.raises(UserError) as e:
        load_model(norm, TPInfo(0, 1, 0, CPU))
    assert str(e.value) == ("'model.norm.weight' is stored quantized (int8, per output channel), but "
                            "tpengine's RMSNorm holds float weights only in this version")
    bad = shutil.copytree(folders["full/int8"], tmp_path / "v2")
    (bad / "quantization.json").write_text(json.dumps({**table_json(read_table(bad)), "format_version": 2}))
    with pytest.raises(UserError) as e:
        load_model(bad, TPInfo(0, 1, 0, CPU))
    assert str(e.value) == (f"quantization table {str(bad / 'quantization.json')!r}: quant_method='tpengine', "
                            "format_version=2 is not supported (expected 'tpengine', 1)")
    (bad / "quantization.json").write_text(json.dumps(
        {**table_json(read_table(folders["full/int8"])), "weights": {"x.weight": {"scheme": "int3"}}}))
    with pytest.raises(UserError) as e:
        load_model(bad, TPInfo(0, 1, 0, CPU))
    assert str(e.value) == (f"quantization table {str(bad / 'quantization.json')!r}: weight 'x.weight': scheme "
                            "'int3' is invalid (must be one of int8, int4, for a name ending in .weight)")
    wrong = shutil.copytree(folders["full/int4"], tmp_path / "wrongdtype")
    t = load_file(wrong / "model.safetensors")
    t["model.layers.0.mlp.down_proj.qweight"] = t["model.layers.0.mlp.down_proj.qweight"].to(torch.int8)
    save_file(t, wrong / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        load_model(wrong, TPInfo(0, 1, 0, CPU))
    assert str(e.value) == ("checkpoint tensor 'model.layers.0.mlp.down_proj.qweight' has dtype torch.int8; the "
                            "int4 format stores qweight as torch.uint8")
