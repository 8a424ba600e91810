"""The on-disk checkpoint layout shared by ``tpengine-shard`` and the loader.

A full HF folder holds ``model.safetensors`` or several files named by
``model.safetensors.index.json``; a shard folder (``tpengine-shard split``) holds
``manifest.json`` and one ``rank-RR-of-NN.safetensors`` per rank (docs/design.md).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"
INDEX_NAME = "model.safetensors.index.json"
FORMAT_VERSION = 1


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
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.is_file():
        files: dict[str, list[str]] = {}
        for name, fname in json.loads(index.read_text()).get("weight_map", {}).items():
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
