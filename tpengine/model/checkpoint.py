"""The on-disk checkpoint layout shared by ``tpengine-shard`` and the loader.

A full HF folder holds ``model.safetensors`` or several files named by
``model.safetensors.index.json``; a shard folder (``tpengine-shard split``) holds
``manifest.json`` and one ``rank-RR-of-NN.safetensors`` per rank (docs/design.md).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tpengine.errors import UserError

MANIFEST = "manifest.json"
INDEX_NAME = "model.safetensors.index.json"
FORMAT_VERSION = 1
#: The manifest keys the loader and ``tpengine-shard verify`` read, with their JSON types.
MANIFEST_KEYS = {"format_version": int, "tp_size": int, "plan": dict, "config": dict, "shard_files": list,
                 "tensors": dict}


def rank_file_name(rank: int, tp_size: int) -> str:
    """``rank-RR-of-NN.safetensors``, e.g. ``rank-00-of-02.safetensors``."""
    return f"rank-{rank:02d}-of-{tp_size:02d}.safetensors"


def is_shard_folder(model_dir: str | Path) -> bool:
    """True if ``model_dir`` holds a ``tpengine-shard split`` manifest."""
    return (Path(model_dir) / MANIFEST).is_file()


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of the file at ``path`` (read in 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def checkpoint_files(model_dir: str | Path) -> dict[str, list[str]]:
    """Map each safetensors file of a full HF checkpoint (single ``model.safetensors`` or several
    named by the index) to the tensor names it holds, sorted.

    Raises:
        FileNotFoundError: no safetensors checkpoint in ``model_dir``, or a file the index names
            is missing (naming the file and the index).
        UserError: the index is not valid JSON (naming it).
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.is_file():
        files: dict[str, list[str]] = {}
        for name, fname in read_json_file(index, "checkpoint index").get("weight_map", {}).items():
            files.setdefault(fname, []).append(name)
        for fname in files:
            if not (model_dir / fname).is_file():
                raise FileNotFoundError(
                    f"checkpoint file {fname!r} named in {str(index)!r} is missing from {str(model_dir)!r}")
        return {f: sorted(names) for f, names in sorted(files.items())}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(
            f"no safetensors checkpoint in {str(model_dir)!r}: expected model.safetensors or {INDEX_NAME}")
    with safe_open(single, framework="pt") as f:
        return {single.name: sorted(f.keys())}


def read_json_file(path: str | Path, what: str) -> dict[str, Any]:
    """The JSON object in the file ``path`` (``what`` names it in messages, e.g. "model config").

    Raises:
        UserError: one line naming ``what`` and the path: the file does not exist, cannot be
            read, is not valid JSON (a truncated file) or is not a JSON object.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read {what} {str(path)!r}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{what} {str(path)!r} is not valid JSON (truncated or damaged?): {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{what} {str(path)!r} is not a JSON object (got {type(data).__name__})")
    return data


def read_manifest(model_dir: str | Path) -> dict[str, Any]:
    """The ``manifest.json`` of the shard folder ``model_dir``: :data:`FORMAT_VERSION`, with every
    key of :data:`MANIFEST_KEYS` present and of its type.

    Raises:
        UserError: missing, unreadable, not JSON (truncated), another format version, or a key
            missing or of the wrong type: one line naming the file (and the key) and the command
            that remakes it.
    """
    path = Path(model_dir) / MANIFEST
    m = read_json_file(path, "shard manifest")
    if m.get("format_version") != FORMAT_VERSION:
        raise UserError(f"shard manifest {str(path)!r}: format_version={m.get('format_version')!r} is not "
                        f"supported (expected {FORMAT_VERSION}); re-run tpengine-shard split")
    for key, kind in MANIFEST_KEYS.items():
        if not isinstance(m.get(key), kind) or isinstance(m.get(key), bool):
            raise UserError(f"shard manifest {str(path)!r}: key {key!r} is missing or not a JSON "
                            f"{'integer' if kind is int else 'array' if kind is list else 'object'}; "
                            "re-run tpengine-shard split")
    return m


def check_model_folder(model_dir: str | Path) -> dict[str, Any]:
    """Check that ``model_dir`` is a model folder tpengine can read before anything loads it: a
    folder with a ``config.json`` object naming its ``model_type`` and, for a shard folder, a
    readable ``manifest.json`` (:func:`read_manifest`). Returns the parsed ``config.json``.
    (Weights and tokenizer files are checked when they are loaded.)

    Raises:
        UserError: one line naming the folder or file and what is wrong with it.
    """
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise UserError(f"model folder {str(model_dir)!r} does not exist")
    if not model_dir.is_dir():
        raise UserError(f"model folder {str(model_dir)!r} is not a folder")
    if not (model_dir / "config.json").is_file():
        raise UserError(f"{str(model_dir)!r} is not a model folder: it has no config.json (pass a Hugging Face "
                        "model folder or a tpengine-shard split folder)")
    config = read_json_file(model_dir / "config.json", "model config")
    if not isinstance(config.get("model_type"), str):
        raise UserError(f"model config {str(model_dir / 'config.json')!r} has no \"model_type\" (a Hugging Face "
                        "config.json names it, e.g. \"llama\")")
    if is_shard_folder(model_dir):
        read_manifest(model_dir)
    return config
