"""``tpengine-shard convert`` of mixture-of-experts GGUF files (issue 56): Mixtral (``llama`` with
``expert_count``) and Qwen3-MoE (``qwen3moe``).

Each test builds a tiny random-weight HF MoE model, writes it as a GGUF the way llama.cpp's
``convert_hf_to_gguf.py`` does (:func:`write_moe_gguf`: its metadata keys, each layer's experts
stacked into ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` [experts, rows, columns], the
router as ``ffn_gate_inp``, Llama's Q/K row permutation for Mixtral), converts it back and checks
the per-expert checkpoint tensors (HF's names, bit for bit), the config and transformers' logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SMOLLM2_DIR, TOKENIZER_FILES
from safetensors.torch import load_file
from test_convert_families import _add_vocab, _llama_permute, cli, logits, shrink_tokenizer

#: the tiny models: 4 experts, top 2, expert rows of whole Q8_0 blocks (64 and 32 columns)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=1001, max_position_embeddings=256, tie_word_embeddings=False, num_experts_per_tok=2,
            bos_token_id=1, eos_token_id=2)
CONFIGS = {"mixtral": ("MixtralConfig", dict(num_local_experts=4, intermediate_size=32, rope_theta=10000.0)),
           "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, moe_intermediate_size=32, intermediate_size=96,
                                                norm_topk_prob=True))}
#: HF checkpoint projection -> the GGUF stacked tensor it goes into
EXPERT_GGUF = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def make_moe_model(tmp_path: Path, model_type: str) -> Path:
    """A tiny random ``model_type`` folder (float32, random norms), SmolLM2's tokenizer cut to its vocabulary."""
    import transformers
    from transformers import AutoModelForCausalLM

    cls, extra = CONFIGS[model_type]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(getattr(transformers, cls)(**TINY, **extra), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.rand_like(p) + 0.5)
    out = tmp_path / f"tiny-{model_type}"
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (SMOLLM2_DIR / f).is_file():
            (out / f).write_bytes((SMOLLM2_DIR / f).read_bytes())
    shrink_tokenizer(out, TINY["vocab_size"])
    return out


def write_moe_gguf(folder: Path, path: Path, q8_0_experts: bool = False) -> Path:
    """Write MoE folder ``folder`` as GGUF ``path`` as llama.cpp's converter does (``LlamaModel`` for
    Mixtral, ``Qwen3MoeModel``), F32 tensors (``q8_0_experts``: the stacked experts as Q8_0)."""
    import re

    import gguf
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(folder)
    mixtral = hf.model_type == "mixtral"
    arch = "llama" if mixtral else "qwen3moe"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(folder.name)
    w.add_block_count(hf.num_hidden_layers)
    w.add_context_length(hf.max_position_embeddings)
    w.add_embedding_length(hf.hidden_size)
    w.add_feed_forward_length(hf.intermediate_size)
    w.add_head_count(hf.num_attention_heads)
    w.add_head_count_kv(hf.num_key_value_heads)
    w.add_rope_freq_base(hf.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(hf.rms_norm_eps)
    w.add_expert_count(hf.num_local_experts if mixtral else hf.num_experts)
    w.add_expert_used_count(hf.num_experts_per_tok)
    if mixtral:
        w.add_vocab_size(hf.vocab_size)
        w.add_rope_dimension_count(hf.head_dim)
    else:
        w.add_key_length(hf.head_dim)
        w.add_value_length(hf.head_dim)
        w.add_expert_feed_forward_length(hf.moe_intermediate_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_vocab(w, folder, hf.vocab_size)

    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     hf.num_hidden_layers)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, t in load_file(folder / "model.safetensors").items():
        x = t.numpy()
        if m := re.fullmatch(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight", name):
            experts.setdefault((int(m[1]), EXPERT_GGUF[m[3]]), {})[int(m[2])] = x
            continue
        if mixtral and ".q_proj." in name:
            x = _llama_permute(x, hf.num_attention_heads)
        if mixtral and ".k_proj." in name:
            x = _llama_permute(x, hf.num_key_value_heads)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(x))
    for (i, proj), per_expert in experts.items():
        x = np.stack([per_expert[e] for e in sorted(per_expert)])
        if q8_0_experts:
            w.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", gguf.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tokenizer_files() -> None:
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip("needs the SmolLM2 tokenizer (make model)")


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_convert_moe_gguf(model_type: str, tmp_path: Path, tokenizer_files) -> None:
    """Every original tensor comes back under its HF checkpoint name, bit for bit (the experts cut
    out of the stacked tensors, Mixtral's Q/K rows unpermuted), the config equals the original's in
    every field that shapes the forward, and transformers' float32 logits on it equal the original's."""
    from transformers import AutoConfig

    src = make_moe_model(tmp_path, model_type)
    out = tmp_path / "converted"
    r = cli("convert", write_moe_gguf(src, tmp_path / "tiny.gguf"), out)
    assert r.exit_code == 0, r.output
    ref, got = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(got) == sorted(ref)
    assert sum(".experts." in n for n in got) == 2 * 4 * 3
    for name, t in ref.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], t), name

    a, b = AutoConfig.from_pretrained(src).to_dict(), AutoConfig.from_pretrained(out).to_dict()
    assert b["model_type"] == model_type and b["architectures"] == a["architectures"]
    skip = {"bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "transformers_version", "_name_or_path",
            "dtype", "initializer_range", "use_cache"}
    assert {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if k not in skip and a.get(k) != b.get(k)} == {}
    ids = [1, 17, 300, 42, 999, 5, 64, 2]
    assert torch.equal(logits(out, ids), logits(src, ids))


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_convert_moe_keep_quant(model_type: str, tmp_path: Path, tokenizer_files) -> None:
    """``--keep-quant`` of a file whose stacked experts are Q8_0: every expert is a grouped int8 weight of
    its own, under tpengine's names (Mixtral's ``w1``/``w3``/``w2`` as ``gate_proj``/``up_proj``/``down_proj``,
    in the tensors and in quantization.json), holding that expert's blocks, so qweight x scales is
    llama.cpp's dequantization of the expert's slice; the rest stays float32; and the engine runs the
    folder (``LLM``, tp 1: the weights it holds are what ``info`` counts)."""
    import gguf
    from transformers import AutoConfig

    from shard_tool.gguf_file import GGUFFile
    from shard_tool.info import rank_bytes, weight_shapes
    from tpengine import LLM, SamplingParams
    from tpengine.model.plan import ShardPlan
    from tpengine.model.quant.checkpoint import read_table

    src = make_moe_model(tmp_path, model_type)
    path = write_moe_gguf(src, tmp_path / "tiny.gguf", q8_0_experts=True)
    out = tmp_path / "converted"
    r = cli("convert", path, out, "--keep-quant")
    assert r.exit_code == 0, r.output
    table = read_table(out)
    expert_names = [f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for i in range(2) for e in range(4)
                    for p in ("gate_proj", "up_proj", "down_proj")]
    assert sorted(table) == sorted(expert_names)
    assert {e.describe() for e in table.values()} == {"int8, group size 32"}
    got, stacked = load_file(out / "model.safetensors"), GGUFFile(path).tensors
    for i, e, p in ((0, 0, "gate_proj"), (1, 3, "down_proj"), (1, 2, "up_proj")):
        base = f"model.layers.{i}.mlp.experts.{e}.{p}"
        t = stacked[f"blk.{i}.ffn_{EXPERT_GGUF[p]}_exps.weight"]
        q, s = got[base + ".qweight"], got[base + ".scales"]
        assert q.dtype == torch.int8 and list(q.shape) == list(t.shape[1:])
        want = gguf.dequantize(t.data, t.qtype)[e]
        assert np.array_equal((q.float().reshape(q.shape[0], -1, 32) * s[..., None]).reshape(q.shape).numpy(), want)
    assert got["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router (Mixtral's renamed too)
    assert not any("block_sparse_moe" in n for n in got)

    config = AutoConfig.from_pretrained(out)
    with LLM(str(out), dtype="float32", max_model_len=64, kv_cache_gb=0.02) as llm:
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(outs[0].outputs[0].token_ids) == 4
        held = llm.llm_engine.runner.weight_bytes
    assert [held] == rank_bytes(ShardPlan.build(config, 1), weight_shapes(config), "float32", table)
