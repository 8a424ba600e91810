"""``tpengine-shard convert`` of GGUF files of the newer families (shard_tool/gguf_families.py): Gemma,
Gemma 2, Gemma 3 (text), Phi-3, OLMo 2 and Granite.

Each test builds a tiny random-weight HF model (conftest ``make_tiny_model``, every norm and bias
random), writes it as a GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` does (:func:`write_gguf`:
the metadata keys its model class writes, its tensor names, Gemma's ``w + 1`` norms, Granite's Llama
Q/K row permutation, the SmolLM2 tokenizer as a ``gpt2`` vocabulary with its merges), converts it
back and checks the tensors (HF names, values) and the logits of transformers' forward on the
converted folder against the original's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SMOLLM2_DIR, make_tiny_model
from safetensors.torch import load_file
from typer.testing import CliRunner

from shard_tool.cli import app

#: HF model_type -> the GGUF architecture llama.cpp writes it as
GGUF_ARCH = {"gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "olmo2": "olmo2",
             "granite": "granite"}

# What each tiny model sets beyond conftest's defaults so that a GGUF can hold it, as released
# models have it: Gemma ties its LM head (llama.cpp drops lm_head for Gemma 1/2) and scales queries
# by head_dim ** -0.5 below 27B; Gemma 3 slides on 5 of every 6 layers (llama.cpp's fixed pattern),
# with the linear RoPE scaling of its 4B+ models on the full layers. Small sliding windows make the
# window matter within the test's prompt.
OVERRIDES = {
    "gemma": dict(tie_word_embeddings=True),
    "gemma2": dict(tie_word_embeddings=True, query_pre_attn_scalar=16, sliding_window=3),
    "gemma3_text": dict(tie_word_embeddings=True, query_pre_attn_scalar=16, num_hidden_layers=6, layer_types=None,
                        sliding_window=3, final_logit_softcapping=3.0,
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                            "rope_theta": 1000000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
    "phi3": dict(sliding_window=3),
    # Phi-3.5 / 128k style: LongRoPE factors (one per rotated pair), which llama.cpp stores as tensors
    "phi3-longrope": dict(original_max_position_embeddings=64,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "long_factor": [1.0 + i / 8 for i in range(8)],
                                           "short_factor": [1.0 + i / 16 for i in range(8)]}),
    "olmo2": {},
    "granite": {},
}


def cli(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (rows of each head: halves interleaved), for weights and biases."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def shrink_tokenizer(folder: Path, vocab_size: int) -> None:
    """Cut ``folder``'s SmolLM2 tokenizer.json to its first ``vocab_size`` ids and the merges among
    them, so that, as in a real GGUF, the vocabulary is one token per embedding row (llama.cpp's
    converter refuses a tokenizer with ids past the model's vocabulary). BPE ids follow merge order,
    so the kept merges only build kept tokens: a working, smaller tokenizer."""
    path = folder / "tokenizer.json"
    tj = json.loads(path.read_text())
    model = tj["model"]
    model["vocab"] = {t: i for t, i in model["vocab"].items() if i < vocab_size}
    model["merges"] = [m for m in model["merges"]
                       if m[0] in model["vocab"] and m[1] in model["vocab"] and m[0] + m[1] in model["vocab"]]
    tj["added_tokens"] = [t for t in tj["added_tokens"] if t["id"] < vocab_size]
    path.write_text(json.dumps(tj, ensure_ascii=False))


def _add_vocab(w, folder: Path, vocab_size: int) -> None:
    """llama.cpp's ``_set_vocab_gpt2``: every id's token (added ones CONTROL when special, else
    USER_DEFINED), the pre-tokenizer name, and gguf-py's SpecialVocab (merges, special ids, flags,
    chat template)."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    vocab = tok.get_vocab()
    assert max(vocab.values()) < vocab_size
    reverse = {i: t for t, i in vocab.items()}
    added, decoder = tok.get_added_vocab(), tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        t = reverse[i]
        if t in added:
            special = decoder[i].special or (t.startswith("<|") and t.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(t)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(w)


def write_gguf(folder: Path, path: Path, q8_0: bool = False) -> Path:
    """Write HF folder ``folder`` (a tiny model of one of :data:`GGUF_ARCH`) as GGUF ``path``, F32
    tensors (with ``q8_0``: 2-D weights whose rows are whole 32-weight blocks as Q8_0), with the
    metadata llama.cpp's converter writes for its architecture."""
    import gguf
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(folder)
    arch = GGUF_ARCH[hf.model_type]
    rope = hf.rope_parameters
    full = rope.get("full_attention", rope)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(folder.name)
    heads, hidden = hf.num_attention_heads, hf.hidden_size
    w.add_block_count(hf.num_hidden_layers)
    w.add_context_length(hf.max_position_embeddings)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hf.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(hf.num_key_value_heads)
    w.add_layer_norm_rms_eps(hf.rms_norm_eps)
    if arch in ("gemma", "gemma2", "gemma3"):  # GemmaModel / Gemma2Model / Gemma3Model
        w.add_key_length(hf.head_dim)
        w.add_value_length(hf.head_dim)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(hf.attn_logit_softcapping)
        w.add_final_logit_softcapping(hf.final_logit_softcapping)
        w.add_sliding_window(hf.sliding_window)
    if arch in ("gemma3", "olmo2", "granite"):  # TextModel: the full layers' RoPE (and the sliding ones')
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base(full["rope_theta"])
        if "sliding_attention" in rope:
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if arch == "gemma3":
        if hf.final_logit_softcapping:
            w.add_final_logit_softcapping(hf.final_logit_softcapping)
        w.add_sliding_window(hf.sliding_window)
    if arch == "phi3":  # Phi3MiniModel
        w.add_rope_scaling_orig_ctx_len(hf.original_max_position_embeddings)
        w.add_rope_dimension_count(int(full.get("partial_rotary_factor", 1.0) * hidden) // heads)
        w.add_rope_freq_base(full["rope_theta"])
        w.add_sliding_window(hf.sliding_window or 0)
        if full.get("rope_type") == "longrope":  # Phi3MiniModel.generate_extra_tensors
            orig = hf.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(hf.max_position_embeddings / orig) / math.log(orig)))
            w.add_tensor("rope_factors_long.weight", np.array(full["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(full["short_factor"], np.float32))
    if arch == "granite":  # GraniteModel(LlamaModel)
        w.add_vocab_size(hf.vocab_size)
        w.add_rope_dimension_count(hidden // heads)
        w.add_attention_scale(hf.attention_multiplier)
        w.add_embedding_scale(hf.embedding_multiplier)
        w.add_residual_scale(hf.residual_multiplier)
        w.add_logit_scale(hf.logits_scaling)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_vocab(w, folder, hf.vocab_size)

    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     hf.num_hidden_layers)
    for name, t in load_file(folder / "model.safetensors").items():
        x = t.numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            x = x + np.float32(1)  # stored as 1 + w, as llama.cpp's Gemma converters do
        if arch == "granite" and ".q_proj." in name:
            x = _llama_permute(x, heads)
        if arch == "granite" and ".k_proj." in name:
            x = _llama_permute(x, hf.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if q8_0 and x.ndim == 2 and x.shape[1] % 32 == 0:
            w.add_tensor(gguf_name, gguf.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tokenizer_files() -> None:
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip("needs the SmolLM2 tokenizer (make model)")


def logits(folder: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("case", list(OVERRIDES))
def test_convert_family_gguf(case: str, tmp_path: Path, tokenizer_files) -> None:
    """The converted folder holds every original tensor, bit for bit (Gemma's norms within the one
    float32 rounding of llama.cpp's ``w + 1``), its config is the original's in every field that
    shapes the forward, and transformers' float32 logits on it equal the original's."""
    from transformers import AutoConfig, AutoTokenizer

    model_type = case.split("-")[0]
    src = make_tiny_model(tmp_path, model_type, random_biases=True, **OVERRIDES[case])
    shrink_tokenizer(src, AutoConfig.from_pretrained(src).vocab_size)
    gguf = write_gguf(src, tmp_path / f"tiny-{model_type}.gguf")
    out = tmp_path / "converted"
    r = cli("convert", gguf, out)
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"wrote {out}"

    ref, got = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert got[name].dtype == torch.float32 and got[name].shape == t.shape, name
        if model_type.startswith("gemma") and name.endswith("norm.weight"):
            # (w + 1) - 1 in float32: within half an ulp of numbers in [1, 4)
            assert torch.allclose(got[name], t, rtol=0, atol=2.0 ** -22), name
            assert not torch.equal(got[name], t) or model_type == "gemma3_text", name
        else:
            assert torch.equal(got[name], t), name

    a, b = AutoConfig.from_pretrained(src).to_dict(), AutoConfig.from_pretrained(out).to_dict()
    assert b["model_type"] == model_type and b["architectures"] == a["architectures"]
    skip = {"architectures", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "transformers_version",
            "_name_or_path", "dtype", "initializer_range", "use_cache"}
    diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if k not in skip and a.get(k) != b.get(k)}
    assert diff == {}
    tok = AutoTokenizer.from_pretrained(out)
    ref_tok = AutoTokenizer.from_pretrained(src)
    text = "The capital of France is Paris, and 1234 is a number."
    assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    assert b["eos_token_id"] == ref_tok.eos_token_id and b["bos_token_id"] == ref_tok.bos_token_id

    ids = ref_tok(text)["input_ids"][:10]
    want, have = logits(src, ids), logits(out, ids)
    if model_type.startswith("gemma"):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(have, want)
    assert math.isfinite(float(want.abs().max())) and float(want.std()) > 0


@pytest.mark.parametrize("model_type", ["gemma2", "granite", "phi3"])
def test_keep_quant_family_gguf(model_type: str, tmp_path: Path, tokenizer_files) -> None:
    """--keep-quant on a Q8_0 file: the kept int8 weights dequantise exactly to the plain convert's
    float32 (Granite's Q/K rows reordered as whole rows, Phi-3's fused tensors kept whole), and the
    float tensors (Gemma's norms through its processor) are the plain convert's."""
    from test_convert_keep_quant import dequant

    src = make_tiny_model(tmp_path, model_type, random_biases=True, **OVERRIDES[model_type])
    shrink_tokenizer(src, 1001)
    gguf = write_gguf(src, tmp_path / "q.gguf", q8_0=True)
    plain, kept = tmp_path / "plain", tmp_path / "kept"
    assert cli("convert", gguf, plain).exit_code == 0
    r = cli("convert", gguf, kept, "--keep-quant")
    assert r.exit_code == 0, r.output
    ref, got = load_file(plain / "model.safetensors"), load_file(kept / "model.safetensors")
    weights = json.loads((kept / "quantization.json").read_text())["weights"]
    assert weights and all(v == {"scheme": "int8", "group_size": 32} for v in weights.values())
    assert len(weights) == sum(1 for t in ref.values() if t.dim() == 2 and t.shape[1] % 32 == 0)
    for name, t in ref.items():
        if name in weights:
            assert torch.equal(dequant(got, name.removesuffix(".weight"), "int8"), t), name
        else:
            assert torch.equal(got[name], t), name
    orig = load_file(src / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight" if model_type != "phi3" else "model.layers.0.self_attn.qkv_proj.weight"
    assert (ref[q] - orig[q]).abs().max() < 0.01 * orig[q].abs().max()  # Q8_0 of the same rows, in HF order


def test_unsupported_architecture_is_one_error_line(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "bloom.gguf"
    w = gguf.GGUFWriter(str(path), "bloom")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = cli("convert", path, tmp_path / "out")
    assert r.exit_code == 2
    assert r.output.strip() == (f"error: GGUF file {str(path)!r} has architecture 'bloom', which convert does not "
                                "support; supported: llama, qwen2, qwen3, gemma, gemma2, gemma3, phi3, olmo2, granite, "
                                "qwen3moe")
    assert not (tmp_path / "out").exists()
    for data, why in ((b"", "it is empty"), (b"PK\x03\x04 not a gguf", "it does not start with 'GGUF'")):
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(data)
        r = cli("convert", bad, tmp_path / "out")
        assert r.exit_code == 2 and r.output.strip() == f"error: {str(bad)!r} is not a GGUF file ({why})"
