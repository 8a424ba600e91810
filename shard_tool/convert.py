"""``tpengine-shard convert GGUF_FILE OUT_DIR``: GGUF file -> plain Hugging Face folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from shard_tool.common import UserError, atomic_dir, user_errors


def convert_gguf(gguf_file: Path, out_dir: Path, force: bool = False) -> Path:
    """Dequantise ``gguf_file`` with transformers and write a float32 HF folder at ``out_dir``:
    config.json (without ``quantization_config``), model.safetensors, generation_config.json and
    the tokenizer files (with the chat template). The folder appears atomically.

    Raises:
        UserError: ``gguf_file`` is missing / not a .gguf file, or ``out_dir`` exists
            (without ``force``).
    """
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise UserError(f"GGUF file {str(gguf_file)!r} does not exist")
    if gguf_file.suffix != ".gguf":
        raise UserError(f"{str(gguf_file)!r} is not a .gguf file (expected a name ending in .gguf)")
    if Path(out_dir).exists() and not force:
        raise UserError(f"output folder {str(out_dir)!r} already exists; remove it or pass --force")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_file.parent.resolve()), gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    # save_pretrained refuses a config that still claims GGUF quantisation; the weights are
    # already dequantised to float32.
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is not None and hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    model.config.dtype = torch.float32
    with atomic_dir(Path(out_dir), force=force) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out_dir)


def convert(
    gguf_file: Annotated[Path, typer.Argument(help="input .gguf file")],
    out_dir: Annotated[Path, typer.Argument(help="output Hugging Face model folder (must not exist)")],
    force: Annotated[bool, typer.Option("--force", help="replace OUT_DIR if it exists")] = False,
) -> None:
    """Convert a GGUF file into a plain float32 Hugging Face model folder."""
    with user_errors():
        out = convert_gguf(gguf_file, out_dir, force=force)
    print(f"wrote {out}")
