"""Random-weight mixture-of-experts model and its dense-active twin, for ``make bench-moe`` (issue 56).

    python -m benchmarks.moe_models --out models                 (models/bench-qwen3moe, models/bench-dense-active)

No MoE checkpoint ships offline, and a released one (Qwen3-30B-A3B: 61 GB) does not fit this machine.
:func:`build_moe` writes a Qwen3-MoE model with SmolLM2-135M's width, depth, attention and vocabulary
(hidden 576, 30 layers, 9 query / 3 KV heads of 64, vocabulary 49152, tied embedding) whose every layer
is sparse: :data:`NUM_EXPERTS` experts, :data:`TOP_K` routed per token (softmax, top-k, renormalized:
``norm_topk_prob``, as Qwen3-30B-A3B), each expert's MLP :data:`EXPERT_INTERMEDIATE` wide.
:func:`build_dense_active` writes the dense Qwen3 with the MoE's *active* parameters: the same
embedding, attention (Qwen3's, with its query/key norms) and depth, and one MLP
``TOP_K * EXPERT_INTERMEDIATE`` wide (= SmolLM2's 1536),
so a decode step of either reads the same weight bytes per layer when the MoE reads only its routed
experts (the router's ``NUM_EXPERTS x hidden`` aside). Both: seeded random weights written by
transformers in bfloat16 (HF's ``initializer_range`` init, norms at 1), SmolLM2's tokenizer files,
so the bench's prompts and HF's ``generate`` run on them as on SmolLM2.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.family_models import SIZE, TOKENIZER_FILES
from tpengine.config import DEFAULT_MODEL_DIR

#: experts per MoE layer and experts routed per token
NUM_EXPERTS, TOP_K = 16, 4
#: one expert's MLP width: TOP_K of them are SmolLM2's MLP (1536)
EXPERT_INTERMEDIATE = SIZE["intermediate_size"] // TOP_K
#: the folders :func:`main` writes under ``--out``
MOE_NAME, DENSE_NAME = "bench-qwen3moe", "bench-dense-active"


def moe_config():
    """The ``transformers.Qwen3MoeConfig`` of the bench's MoE model (every layer sparse)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**SIZE, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
                          moe_intermediate_size=EXPERT_INTERMEDIATE, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], rope_parameters={"rope_type": "default", "rope_theta": 100000.0})


def dense_active_config():
    """The ``transformers.Qwen3Config`` of the MoE's dense-active twin (Qwen3-MoE's attention, its per-head
    query/key norms included): MLP ``TOP_K * EXPERT_INTERMEDIATE``."""
    from transformers import Qwen3Config

    return Qwen3Config(**{**SIZE, "intermediate_size": TOP_K * EXPERT_INTERMEDIATE},
                       rope_parameters={"rope_type": "default", "rope_theta": 100000.0})


def active_params(config) -> int:
    """Parameters a decode step's token reads (embedding row aside, the LM head counted once):
    attention, norms and, per layer, the dense MLP or ``num_experts_per_tok`` experts plus the router."""
    h, layers = config.hidden_size, config.num_hidden_layers
    d = config.head_dim
    attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) + 2 * h
    if getattr(config, "num_experts", None):
        mlp = config.num_experts_per_tok * 3 * h * config.moe_intermediate_size + config.num_experts * h
    else:
        mlp = 3 * h * config.intermediate_size
    return layers * (attn + mlp) + config.vocab_size * h + h


def _save(config, out: Path, tokenizer_dir: Path, seed: int) -> Path:
    """Write a random-weight model of ``config`` (bfloat16 safetensors, norms at 1) and the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # norms at 1 (random ones blow up a model this deep)
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")  # renamed when complete: a stopped build is not a model
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).is_file():
            shutil.copy2(tokenizer_dir / f, tmp / f)
    tmp.rename(out)
    return out


def build_moe(out: Path, tokenizer_dir: Path = Path(DEFAULT_MODEL_DIR), seed: int = 0) -> Path:
    """Write the bench's Qwen3-MoE model (:func:`moe_config`) to ``out``; return ``out``."""
    return _save(moe_config(), out, Path(tokenizer_dir), seed)


def build_dense_active(out: Path, tokenizer_dir: Path = Path(DEFAULT_MODEL_DIR), seed: int = 0) -> Path:
    """Write the MoE's dense-active Qwen3 twin (:func:`dense_active_config`) to ``out``; return ``out``."""
    return _save(dense_active_config(), out, Path(tokenizer_dir), seed)


def ensure_models(models_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """``(moe, dense)`` folders under ``models_dir``, each built unless its config.json is there."""
    moe, dense = Path(models_dir) / MOE_NAME, Path(models_dir) / DENSE_NAME
    for path, build in ((moe, build_moe), (dense, build_dense_active)):
        if not (path / "config.json").is_file():
            build(path, seed=seed)
    return moe, dense


def main(out: Annotated[Path, typer.Option(help="parent folder of the two models")] = Path("models"),
         seed: Annotated[int, typer.Option(help="weights' seed")] = 0) -> None:
    """Build both folders (unless built) and print their paths and active parameter counts."""
    moe, dense = ensure_models(out, seed)
    print(f"{moe}: {active_params(moe_config()) / 1e6:.1f} M active parameters")
    print(f"{dense}: {active_params(dense_active_config()) / 1e6:.1f} M active parameters")


if __name__ == "__main__":
    typer.run(main)
