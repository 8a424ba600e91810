"""``tpengine-shard convert GGUF_FILE OUT_DIR [--keep-quant]``: GGUF file -> Hugging Face folder
(float32, or with the GGUF's Q4_1 / Q8_0 blocks kept as int4 / int8: shard_tool/gguf_quant.py), for
GGUF architectures llama, qwen2, qwen3 (transformers' loader) and gemma, gemma2, gemma3, phi3, olmo2,
granite, qwen3moe and llama with experts (Mixtral) (shard_tool/gguf_families.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from shard_tool.common import UserError, atomic_dir, user_errors
from shard_tool.gguf_families import build_config, builds_config, check_architecture, tensor_processor
from shard_tool.gguf_file import GGUFFile


def convert_gguf(gguf_file: Path, out_dir: Path, force: bool = False, keep_quant: bool = False) -> Path:
    """Dequantise ``gguf_file`` and write a float32 HF folder at ``out_dir``: config.json (without
    ``quantization_config``), model.safetensors, generation_config.json and the tokenizer files
    (with the chat template). The folder appears atomically.

    GGUF architectures (``general.architecture``): ``llama`` (incl. Mistral and SmolLM2), ``qwen2``
    and ``qwen3`` are read by transformers' GGUF loader; ``gemma``, ``gemma2``, ``gemma3`` (the text
    model: ``gemma3_text``), ``phi3``, ``olmo2`` and ``granite`` by :mod:`shard_tool.gguf_families`
    (config from llama.cpp's metadata keys, tensors through transformers' name map and processors).

    With ``keep_quant`` the folder is the same except that model.safetensors holds the Q4_1 /
    Q8_0 weights as int4 / int8 (group 32) read straight from the GGUF blocks, listed in
    quantization.json (format: docs/notes/quant-format.md; :mod:`shard_tool.gguf_quant`).

    Raises:
        UserError: ``gguf_file`` is missing / not a .gguf file / not readable as GGUF, its
            architecture is not one of the above (naming it and them), or ``out_dir`` exists
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
    gguf = GGUFFile(gguf_file)
    arch = gguf.architecture
    check_architecture(arch, str(gguf_file))
    if builds_config(gguf):
        config = build_config(gguf)
        del gguf  # its memory map: the weights are read again below
        return _convert_meta(gguf_file, Path(out_dir), force, keep_quant, config, family=arch)
    del gguf
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
    """The --keep-quant folder of a file transformers reads (llama, qwen2, qwen3): its config from
    transformers' GGUF loader, then :func:`_convert_meta`."""
    from transformers import AutoConfig

    src, name = str(gguf_file.parent.resolve()), gguf_file.name
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return _convert_meta(gguf_file, out_dir, force, True, config)


def _convert_meta(gguf_file: Path, out_dir: Path, force: bool, keep_quant: bool, config,
                  family: str | None = None) -> Path:
    """Write the folder from ``config`` without materialising a model: it is built on the meta
    device (no float weights are made), the weights are written from the GGUF by
    :func:`shard_tool.gguf_quant.write_gguf_weights` (through ``family``'s tensor processor, when
    given), and the config and generation config are saved as ``save_pretrained`` would."""
    import torch
    from transformers import AutoModelForCausalLM

    from shard_tool.gguf_quant import write_gguf_weights

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.dtype = torch.float32
    model.config.architectures = [type(model).__name__]
    processor = None if family is None else tensor_processor(family, model.config.to_dict())
    with atomic_dir(out_dir, force=force) as tmp:
        # first: with keep_quant, an unsupported type fails fast
        write_gguf_weights(gguf_file, model, tmp, processor=processor, keep_quant=keep_quant)
        tokenizer = _tokenizer(gguf_file, family)
        model.config.save_pretrained(tmp)
        if model.can_generate() and model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out_dir


def _tokenizer(gguf_file: Path, family: str | None):
    """The file's tokenizer, built by transformers from its ``tokenizer.ggml.*`` metadata.
    AutoTokenizer first reads the file's config with transformers' loader, which knows no
    ``gemma`` / ``olmo2`` / ``granite``; for :data:`FAMILY_ARCHS` the generic fast tokenizer is
    built from the same metadata instead (what AutoTokenizer gives for the others too); ``family``
    is the GGUF architecture of a file :func:`shard_tool.gguf_families.build_config` read, else None."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    src, name = str(gguf_file.parent.resolve()), gguf_file.name
    if family is None:
        return AutoTokenizer.from_pretrained(src, gguf_file=name)
    return PreTrainedTokenizerFast.from_pretrained(src, gguf_file=name)


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
