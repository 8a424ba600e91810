"""``tpengine-shard convert GGUF_FILE OUT_DIR [--keep-quant]``: GGUF file -> Hugging Face folder
(float32, or with the GGUF's Q4_1 / Q8_0 blocks kept as int4 / int8: shard_tool/gguf_quant.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from shard_tool.common import UserError, atomic_dir, user_errors


def convert_gguf(gguf_file: Path, out_dir: Path, force: bool = False, keep_quant: bool = False) -> Path:
    """Dequantise ``gguf_file`` with transformers and write a float32 HF folder at ``out_dir``:
    config.json (without ``quantization_config``), model.safetensors, generation_config.json and
    the tokenizer files (with the chat template). The folder appears atomically.

    With ``keep_quant`` the folder is the same except that model.safetensors holds the Q4_1 /
    Q8_0 weights as int4 / int8 (group 32) read straight from the GGUF blocks, listed in
    quantization.json (format: docs/notes/quant-format.md; :mod:`shard_tool.gguf_quant`).

    Raises:
        UserError: ``gguf_file`` is missing / not a .gguf file, or ``out_dir`` exists
            (without ``force``); with ``keep_quant``, a tensor of another quantized type
            (see :func:`shard_tool.gguf_quant.write_keep_quant_weights`).
    """
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise UserError(f"GGUF file {str(gguf_file)!r} does not exist")
    if gguf_file.suffix != ".gguf":
        raise UserError(f"{str(gguf_file)!r} is not a .gguf file (expected a name ending in .gguf)")
    if Path(out_dir).exists() and not force:
        raise UserError(f"output folder {str(out_dir)!r} already exists; remove it or pass --force")
    if keep_quant:
        return _convert_keep_quant(gguf_file, Path(out_dir), force)
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


def _convert_keep_quant(gguf_file: Path, out_dir: Path, force: bool) -> Path:
    """The --keep-quant folder: the model is built on the meta device from the GGUF's config (no
    float weights are made), its config and generation config saved as ``save_pretrained`` would."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from shard_tool.gguf_quant import write_keep_quant_weights

    src, name = str(gguf_file.parent.resolve()), gguf_file.name
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.dtype = torch.float32
    model.config.architectures = [type(model).__name__]
    with atomic_dir(out_dir, force=force) as tmp:
        write_keep_quant_weights(gguf_file, model, tmp)  # first: an unsupported type fails fast
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        model.config.save_pretrained(tmp)
        if model.can_generate() and model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out_dir


def convert(
    gguf_file: Annotated[Path, typer.Argument(help="input .gguf file")],
    out_dir: Annotated[Path, typer.Argument(help="output Hugging Face model folder (must not exist)")],
    force: Annotated[bool, typer.Option("--force", help="replace OUT_DIR if it exists")] = False,
    keep_quant: Annotated[bool, typer.Option(
        "--keep-quant", help="keep Q4_1 / Q8_0 weights as int4 / int8 (group 32) instead of dequantising")] = False,
) -> None:
    """Convert a GGUF file into a plain float32 Hugging Face model folder (--keep-quant: its Q4_1 and
    Q8_0 weights kept as tpengine int4 / int8, listed in quantization.json)."""
    with user_errors():
        out = convert_gguf(gguf_file, out_dir, force=force, keep_quant=keep_quant)
    print(f"wrote {out}")
