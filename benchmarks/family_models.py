"""Random-weight models of the other families at SmolLM2-135M's size, for ``benchmarks.bench --model`` (issue 55).

    python -m benchmarks.family_models --family gemma2 --out models/bench-gemma2
    python -m benchmarks.bench --model models/bench-gemma2 --dtype float32 --dtype bfloat16

No checkpoint of these families ships offline. Each folder holds a model of the family with SmolLM2's
dimensions (hidden 576, 30 layers, 9 query / 3 KV heads of 64, MLP 1536, vocabulary 49152), its own
features at their released values (Gemma 2: a 4096-token window on every other layer and both soft
caps; Phi-3: fused checkpoint tensors), seeded random weights written by transformers, and SmolLM2's
tokenizer files, so the bench's prompts and HF's ``generate`` run on it as on SmolLM2.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer

from tpengine.config import DEFAULT_MODEL_DIR

#: SmolLM2-135M's dimensions
SIZE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
            intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=2)
#: family -> (transformers config class name, what it sets beyond SIZE)
FAMILIES = {
    "gemma2": ("Gemma2Config", dict(query_pre_attn_scalar=64, sliding_window=4096, attn_logit_softcapping=50.0,
                                    final_logit_softcapping=30.0)),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False, original_max_position_embeddings=8192)),
    "gemma3_text": ("Gemma3TextConfig", dict(query_pre_attn_scalar=64, sliding_window=512)),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                      attention_multiplier=0.015625, logits_scaling=2.25)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def build(family: str, out: Path, tokenizer_dir: Path = Path(DEFAULT_MODEL_DIR), seed: int = 0) -> Path:
    """Write a random-weight ``family`` model of SmolLM2's size (float32 safetensors) to ``out``.

    Raises:
        ValueError: an unknown family, naming the known ones.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    cls, extra = FAMILIES[family]
    config = getattr(transformers, cls)(**{**SIZE, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms at 1 (random: models this deep blow up): Gemma's are stored as w - 1
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(0.0 if family.startswith("gemma") else 1.0)
    out = Path(out)
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).is_file():
            shutil.copy2(tokenizer_dir / f, out / f)
    return out


def main(family: Annotated[str, typer.Option(help=f"one of {', '.join(FAMILIES)}")] = "gemma2",
         out: Annotated[Path | None, typer.Option(help="output folder (default models/bench-<family>)")] = None,
         seed: Annotated[int, typer.Option(help="weights' seed")] = 0) -> None:
    """Build the folder and print its path."""
    print(build(family, out or Path("models") / f"bench-{family}", seed=seed))


if __name__ == "__main__":
    typer.run(main)
