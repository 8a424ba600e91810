"""Quantized checkpoints on disk (tpengine/model/quant/checkpoint.py): ``tpengine-shard split --quantize``,
full folders with quantization.json, the loader reading both, verify and info, and their errors.

The tiny Qwen3 (head_dim 32, intermediate 128) splits on 32-column groups at tp 1 and 2; its
vocabulary (1001 rows) pads one row at tp 2. Under both schemes the embedding and the untied LM
head are stored int8 per output channel, as ``--quantization`` holds them; a tied tiny Llama
covers the one quantized table the embedding and LM head share.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from launch import NO_MEASURING, run_engine_jobs
from safetensors.torch import load_file, save_file
from test_shard_tool import cli
from transformers import AutoConfig

from shard_tool.split import split_model
from shard_tool.verify import verify_dir
from tpengine.distributed import TPInfo
from tpengine.errors import UserError
from tpengine.model.loader import QUANTIZED_LAYERS, VOCAB_LAYERS, load_model
from tpengine.model.plan import ShardPlan
from tpengine.model.quant.arith import quantize_int8
from tpengine.model.quant.checkpoint import (
    QuantEntry,
    is_linear_weight,
    is_vocab_weight,
    pack_nibbles,
    parse_table,
    part_name,
    quantize_parts,
    read_table,
    table_json,
    unpack_nibbles,
    write_table,
)
from tpengine.model.quant.weights import Int8Weight, QuantizedWeight
from tpengine.model.surgery import build_model, checkpoint_targets

CPU = torch.device("cpu")
#: --quantization int8 / int4's entries (int4: coded zeros; its table the same), and int4 with float zeros (GGUF Q4_1's)
INT8, INT4, INT4F = QuantEntry("int8", None), QuantEntry("int4", 32, True), QuantEntry("int4", 32)


def write_full_quantized(src: Path, out: Path, entry_of, vocab: QuantEntry | None = INT8) -> Path:
    """A full quantized folder from the float folder ``src``: every linear weight ``n`` with
    ``entry_of(n)`` not None, and the embedding / LM head with ``vocab`` not None (default int8
    per channel, as ``--quantization int8``), stored as its parts, model.safetensors + quantization.json."""
    out.mkdir()
    tensors, table = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        e = entry_of(name) if is_linear_weight(name, t.dim()) else vocab if is_vocab_weight(name, t.dim()) else None
        if e is None:
            tensors[name] = t
            continue
        table[name] = e
        if e.scheme == "int8" and e.group_size is not None:  # grouped int8 (GGUF's Q8_0): w = q * scale
            q, scales = quantize_int8(t, torch.float32, group_size=e.group_size)
            parts = {"qweight": q, "scales": scales}
        else:
            parts = quantize_parts(t, e)
        tensors.update({part_name(name, p): v for p, v in parts.items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    write_table(out, table)
    return out


def quant_buffers(model) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if ".quant." in n}


VOCAB = {"model.embed_tokens.weight", "lm_head.weight"}


#: :func:`folders`' one build a session: test_quantized_split_tools imports the fixture, and each module's copy
#: of it returns this (the tests read the folders and change copies only)
_FOLDERS: dict = {}


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    """The tiny Qwen3, its split --quantize folders at tp 1 and 2 and its full quantized folders, built
    once a session for this module and test_quantized_split_tools."""
    if not _FOLDERS:
        _FOLDERS.update(_build_folders(tmp_path_factory))
    return _FOLDERS


def _build_folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("qsplit")
    qwen3 = make_tiny_model(root, "qwen3", seed=2, name="qwen3", head_dim=32, intermediate_size=128,
                            random_biases=True)
    f = {"root": root, "qwen3": qwen3}
    for q in ("int8", "int4"):
        for tp in (1, 2):
            f[f"split/{q}/{tp}"] = root / f"split-{q}-tp{tp}"
            split_model(qwen3, tp, f[f"split/{q}/{tp}"], quantize=q)
        e = INT8 if q == "int8" else INT4  # as --quantization q: linears and table
        f[f"full/{q}"] = write_full_quantized(qwen3, root / f"full-{q}", lambda n, e=e: e, vocab=e)
    # attention int4, MLP int8: a folder of two schemes
    f["full/mixed"] = write_full_quantized(qwen3, root / "full-mixed", lambda n: INT4 if "self_attn" in n else INT8)
    return f


# --------------------------------------------------------------------------- the format
def test_nibbles_and_parts_layout():
    """int4 qweight bytes: element 2j in the low nibble, 2j+1 in the high one; parts' shapes and dtypes."""
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 9, 10]], dtype=torch.int32)
    b = pack_nibbles(q)
    assert b.dtype == torch.uint8 and b.tolist() == [[0x21, 0x0F], [0x87, 0xA9]]
    assert torch.equal(unpack_nibbles(b), q)
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    p4, p8, pz = quantize_parts(w, INT4F), quantize_parts(w, INT8), quantize_parts(w, INT4)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in p4.items()} == {
        "qweight": (torch.uint8, (48, 32)), "scales": (torch.float32, (48, 2)), "zeros": (torch.float32, (48, 2))}
    assert {k: (v.dtype, tuple(v.shape)) for k, v in pz.items()} == {
        "qweight": (torch.uint8, (48, 32)), "scales": (torch.float32, (48, 2)), "zeros": (torch.int8, (48, 2))}
    deqz = ((unpack_nibbles(pz["qweight"]).float() - 8).reshape(48, 2, 32) * pz["scales"][..., None]
            + (pz["zeros"].float() * pz["scales"] / 16)[..., None])  # zero = code * scale / 16
    assert float((deqz.reshape(48, 64) - w).abs().max()) <= float(pz["scales"].max()) * (1 / 2 + 1 / 32) + 1e-6
    assert {k: (v.dtype, tuple(v.shape)) for k, v in p8.items()} == {
        "qweight": (torch.int8, (48, 64)), "scales": (torch.float32, (48, 1))}
    deq = ((unpack_nibbles(p4["qweight"]).float() - 8).reshape(48, 2, 32) * p4["scales"][..., None]
           + p4["zeros"][..., None])
    assert float((deq.reshape(48, 64) - w).abs().max()) <= float(p4["scales"].max()) / 2 + 1e-6
    with pytest.raises(UserError, match=r"^int8 with group size 32: tpengine quantizes int8 per output channel only$"):
        quantize_parts(w, QuantEntry("int8", 32))
    assert table_json({"b.weight": INT8, "a.weight": INT4F, "c.weight": INT4}) == {
        "quant_method": "tpengine", "format_version": 1,
        "weights": {"a.weight": {"scheme": "int4", "group_size": 32},
                    "b.weight": {"scheme": "int8", "group_size": None},
                    "c.weight": {"scheme": "int4", "group_size": 32, "zeros": "int8"}}}
    assert parse_table(table_json({"c.weight": INT4}), "t") == {"c.weight": INT4}
    bad = {"quant_method": "tpengine", "format_version": 1, "weights": {"a.weight": {
        "scheme": "int8", "group_size": None, "zeros": "int8"}}}
    with pytest.raises(UserError) as e:
        parse_table(bad, "t")
    assert str(e.value) == ("t: weight 'a.weight': zeros 'int8' is invalid (\"int8\" for int4 coded zeros, or "
                            "absent for float32 zeros)")


def test_split_manifest_and_names(folders):
    """split --quantize stores exactly what --quantization quantizes, the column/row-parallel linears in the
    scheme and the embedding / LM head (int4 g32 with coded zeros under int4), as qweight/scales/zeros; the
    manifest lists them, and no quantization.json is copied."""
    m = json.loads((folders["split/int4/2"] / "manifest.json").read_text())
    table = read_table(folders["split/int4/2"])
    cfg = AutoConfig.from_pretrained(folders["qwen3"])
    model = build_model(cfg, ShardPlan.build(cfg, 1), 0, torch.float32, CPU)  # weights on meta
    linears = {n for n, t in checkpoint_targets(model, False).items() if isinstance(t.module, QUANTIZED_LAYERS)
               and t.attr == "weight"}
    assert set(table) == linears | VOCAB and len(linears) == 14 and {table[n] for n in linears} == {INT4}
    assert {table[n] for n in VOCAB} == {INT4}
    assert m["quantization"] == table_json(table)
    r0 = m["tensors"]["0"]
    assert r0["model.layers.0.mlp.down_proj.qweight"] == [64, 32]  # [hidden, intermediate/2 / 2]
    assert r0["model.layers.0.mlp.down_proj.scales"] == r0["model.layers.0.mlp.down_proj.zeros"] == [64, 2]
    assert r0["model.layers.0.self_attn.k_proj.qweight"] == [32, 32] and "model.layers.0.mlp.up_proj.weight" not in r0
    assert r0["model.layers.0.self_attn.q_norm.weight"] == [32]
    for r in ("0", "1"):  # the padded vocabulary's 1002 rows, 501 a rank, a scale and a zero code per 32
        t = m["tensors"][r]
        assert t["model.embed_tokens.qweight"] == t["lm_head.qweight"] == [501, 32]
        assert t["model.embed_tokens.scales"] == t["lm_head.scales"] == t["lm_head.zeros"] == [501, 2]
        assert "model.embed_tokens.weight" not in t and "lm_head.weight" not in t
    r1 = load_file(folders["split/int4/2"] / "rank-01-of-02.safetensors")
    for p in ("model.embed_tokens", "lm_head"):  # rank 1's last row is padding: all zero
        assert r1[f"{p}.qweight"].dtype == torch.uint8 and r1[f"{p}.scales"].dtype == torch.float32
        assert r1[f"{p}.zeros"].dtype == torch.int8 and not r1[f"{p}.zeros"][-1].any()
        assert not r1[f"{p}.qweight"][-1].any() and not r1[f"{p}.scales"][-1].any()
        assert bool((r1[f"{p}.scales"][:-1] > 0).all())
    m8 = json.loads((folders["split/int8/2"] / "manifest.json").read_text())["tensors"]["1"]
    o_proj = "model.layers.1.self_attn.o_proj"
    assert m8[f"{o_proj}.qweight"] == [64, 64] and m8[f"{o_proj}.scales"] == [64, 1]  # the full row's scale
    assert not (folders["split/int4/2"] / "quantization.json").exists()


@pytest.mark.parametrize("q", ["int8", "int4"])
def test_split_tp1_equals_on_the_fly(folders, q):
    """The tp=1 split's quantized storage equals --quantization's on-the-fly result bit for bit."""
    fly = load_model(folders["qwen3"], TPInfo(0, 1, 0, CPU), quantization=q)
    disk = load_model(folders[f"split/{q}/1"], TPInfo(0, 1, 0, CPU))
    a, b = quant_buffers(fly.module), quant_buffers(disk.module)
    # 8 linear modules and 2 vocabulary layers, 2 buffers each (int8) or 3 (int4: packed, scales, zero codes)
    assert sorted(a) == sorted(b) and len(a) == (20 if q == "int8" else 30)
    parts = ("qweight", "scales") if q == "int8" else ("packed", "scales", "zero_codes")
    assert {n for n in a if not n.startswith("model.layers.")} == {
        f"{m}.quant.{p}" for m in ("model.embed_tokens", "lm_head") for p in parts}
    assert all(torch.equal(a[n], b[n]) and a[n].dtype == b[n].dtype for n in a)
    assert disk.weight_bytes == fly.weight_bytes
    assert all(m.weight is None for m in disk.module.modules() if isinstance(m, (*QUANTIZED_LAYERS, *VOCAB_LAYERS)))


def test_split_tp2_equals_on_the_fly(folders):
    """Each rank of the tp=2 int4 split holds --quantization int4's tp=2 storage bit for bit, the
    vocabulary's padding row (rank 1) included (int4 needs no all-reduce: loaded rank by rank)."""
    for rank in (0, 1):
        fly = load_model(folders["qwen3"], TPInfo(rank, 2, rank, CPU), quantization="int4")
        disk = load_model(folders["split/int4/2"], TPInfo(rank, 2, rank, CPU))
        a, b = quant_buffers(fly.module), quant_buffers(disk.module)
        assert sorted(a) == sorted(b) and len(a) == 30
        assert all(torch.equal(a[n], b[n]) and a[n].dtype == b[n].dtype for n in a)
        assert disk.weight_bytes == fly.weight_bytes
        if rank == 1:  # local row 500 is the padding row (then 11 kernel padding rows): scale and code 0
            assert not a["lm_head.quant.scales"][:, 500:].any() and not a["lm_head.quant.zero_codes"][:, 500:].any()
            assert bool((a["lm_head.quant.scales"][:, :500] > 0).all())


@pytest.mark.parametrize("q", ["int8", "int4"])
def test_full_folder_sliced_equals_split(folders, q):
    """A full quantized folder sliced on the fly at tp=2 gives each rank the storage of the tp=2 split."""
    for rank in (0, 1):
        full = load_model(folders[f"full/{q}"], TPInfo(rank, 2, rank, CPU))
        split = load_model(folders[f"split/{q}/2"], TPInfo(rank, 2, rank, CPU))
        a, b = quant_buffers(full.module), quant_buffers(split.module)
        assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
        assert full.weight_bytes == split.weight_bytes


def test_grouped_int8_vocab_folder(folders, tmp_path):
    """A full folder whose embedding / LM head are grouped int8 (group 32, as convert --keep-quant imports
    GGUF's Q8_0) beside int4 linears: loaded as grouped Int8Weight, its tp=2 split verifies and gives each
    rank the storage of the full folder sliced on the fly, and info's weight bytes are what each rank loads."""
    q8 = QuantEntry("int8", 32)
    full = write_full_quantized(folders["qwen3"], tmp_path / "full-q8", lambda n: INT4F, vocab=q8)
    assert {read_table(full)[n] for n in VOCAB} == {q8}
    one = load_model(full, TPInfo(0, 1, 0, CPU))
    emb = one.module.get_input_embeddings().quant
    assert isinstance(emb, Int8Weight) and emb.group_size == 32 and emb.out_features == 1001
    w = load_file(folders["qwen3"] / "model.safetensors")["model.embed_tokens.weight"]
    q, scales = quantize_int8(w, torch.float32, group_size=32)
    assert torch.equal(emb.dequantize(), q.float().reshape(1001, 2, 32).mul(scales[..., None]).reshape(1001, 64))
    m = split_model(full, 2, tmp_path / "split-q8")
    assert m["tensors"]["1"]["model.embed_tokens.scales"] == [501, 2] and verify_dir(tmp_path / "split-q8") == []
    r = cli("info", tmp_path / "split-q8", "--tp", "2")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[1] == ("quantized: int4, group size 32: 14 weights; int8, group size 32: 2 weights "
                                        "(the rest float32)")
    for rank in (0, 1):
        sliced = load_model(full, TPInfo(rank, 2, rank, CPU))
        split = load_model(tmp_path / "split-q8", TPInfo(rank, 2, rank, CPU))
        a, b = quant_buffers(sliced.module), quant_buffers(split.module)
        assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
        assert "model.embed_tokens.quant.packed_lo" in a and sliced.weight_bytes == split.weight_bytes
        assert sum(line.split()[:1] == [str(rank)] and str(split.weight_bytes) in line.split()
                   for line in r.stdout.splitlines()) == 1


# ------------------------------------------------------------------------------ engine
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "logprobs": 0}


@pytest.fixture(scope="module")
def runs(folders):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1001, (n,), generator=g).tolist() for n in (5, 19)]
    reqs = [[f"t{i}", p, GREEDY] for i, p in enumerate(prompts)]
    base = {"dtype": "float32", "max_model_len": 64, "kv_cache_gb": 0.02}

    def job(key, model, q=None):
        return {"key": key, "requests": reqs, "config": {"model": str(model), "quantization": q, **base}}

    at = {1: [], 2: []}
    for q in ("int8", "int4"):
        for tp in (1, 2):
            at[tp] += [job(f"fly/{q}", folders["qwen3"], q), job(f"split/{q}", folders[f"split/{q}/{tp}"]),
                       job(f"full/{q}", folders[f"full/{q}"])]
    for tp in (1, 2):
        at[tp].append(job("full/mixed", folders["full/mixed"]))
    # every load the same default kernels (launch.NO_MEASURING): the tests compare loads' tokens
    return {tp: run_engine_jobs(folders["root"], tp, jobs, env=NO_MEASURING) for tp, jobs in at.items()}


def greedy(result: dict) -> dict:
    """request id -> (token ids, each token's logprob)."""
    return {o["request_id"]: (o["token_ids"], [p["chosen"]["logprob"] for p in o["outputs"][0]["logprobs"]])
            for o in result["outputs"]}


@pytest.mark.parametrize("q", ["int8", "int4"])
def test_split_runs_as_on_the_fly(runs, q):
    """Greedy tokens and their logprobs, float32 activations: the tp=2 split equals --quantization at tp=2
    (bit for bit), and the tp=1 split's tokens; the full folder gives the same at tp 1 and 2."""
    fly2, split2 = greedy(runs[2][f"fly/{q}"]), greedy(runs[2][f"split/{q}"])
    assert split2 == fly2 and all(len(t) == 12 for t, _ in split2.values())
    assert greedy(runs[1][f"split/{q}"]) == greedy(runs[1][f"fly/{q}"])
    tokens = lambda r: {k: t for k, (t, _) in greedy(r).items()}  # noqa: E731
    assert tokens(runs[1][f"split/{q}"]) == tokens(runs[2][f"split/{q}"]) == tokens(runs[1][f"full/{q}"]) \
        == tokens(runs[2][f"full/{q}"])
    assert runs[2][f"split/{q}"]["weight_bytes"] == runs[2][f"fly/{q}"]["weight_bytes"] == \
        runs[2][f"full/{q}"]["weight_bytes"]


def test_mixed_full_folder_tp2_equals_tp1(runs):
    one, two = greedy(runs[1]["full/mixed"]), greedy(runs[2]["full/mixed"])
    assert {k: t for k, (t, _) in one.items()} == {k: t for k, (t, _) in two.items()}
    assert all(len(t) == 12 for t, _ in one.values())
    assert runs[1]["full/mixed"]["weight_bytes"][0] < runs[1]["fly/int8"]["weight_bytes"][0]


# --------------------------------------------------------------------------- verify, info
def test_tied_llama_split_int4(tmp_path):
    """A tied embedding is stored once, int4 with coded zeros (no lm_head entry), and loads as ONE quantized table
    the LM head shares, beside int4 linears: bit for bit --quantization int4's, at tp 1 and on both ranks of
    tp 2 (padding row included); greedy tokens and logprobs equal on the fly's, and tp 2's tokens tp 1's."""
    src = make_tiny_model(tmp_path, "llama", seed=5, intermediate_size=128, tie_word_embeddings=True)
    split_model(src, 1, tmp_path / "t1", quantize="int4")
    m = split_model(src, 2, tmp_path / "t2", quantize="int4")
    weights = m["quantization"]["weights"]
    assert weights["model.embed_tokens.weight"] == {"scheme": "int4", "group_size": 32, "zeros": "int8"}
    assert "lm_head.weight" not in weights and len(weights) == 15
    assert not any(n.startswith("lm_head.") for n in m["tensors"]["1"])
    for tp, rank in ((1, 0), (2, 0), (2, 1)):
        model = load_model(tmp_path / f"t{tp}", TPInfo(rank, tp, rank, CPU))
        fly = load_model(src, TPInfo(rank, tp, rank, CPU), quantization="int4")
        for mod in (model.module, fly.module):
            head, emb = mod.get_output_embeddings(), mod.get_input_embeddings()
            assert head.quant is emb.quant and emb.weight is None and head.weight is None
            assert sum(isinstance(q, QuantizedWeight) for q in mod.modules()) == 9  # 8 linear modules, 1 table
        a, b = quant_buffers(fly.module), quant_buffers(model.module)
        assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) and a[n].dtype == b[n].dtype for n in a)
        assert model.weight_bytes == fly.weight_bytes
    g = torch.Generator().manual_seed(4)
    reqs = [["a", torch.randint(3, 1001, (9,), generator=g).tolist(), {**GREEDY, "max_tokens": 8}]]
    cfg = {"dtype": "float32", "max_model_len": 64, "kv_cache_gb": 0.02}
    jobs = {tp: [{"key": "k", "requests": reqs, "config": {"model": str(tmp_path / f"t{tp}"), **cfg}},
                 {"key": "fly", "requests": reqs, "config": {"model": str(src), "quantization": "int4", **cfg}}]
            for tp in (1, 2)}
    one, two = (run_engine_jobs(tmp_path, tp, jobs[tp], env=NO_MEASURING) for tp in (1, 2))
    for res in (one, two):  # equal buffers; each load measures its own int4 kernel choice (a busy machine's
        # is not cached), and two valid kernels round differently: tokens equal, logprobs within 1e-4
        (k_ids, k_lp), (f_ids, f_lp) = greedy(res["k"])["a"], greedy(res["fly"])["a"]
        assert k_ids == f_ids and torch.allclose(torch.tensor(k_lp), torch.tensor(f_lp), atol=1e-4, rtol=0)
    assert greedy(one["k"])["a"][0] == greedy(two["k"])["a"][0] and len(greedy(one["k"])["a"][0]) == 8
