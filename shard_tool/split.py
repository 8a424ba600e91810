"""``tpengine-shard split MODEL_DIR --tp N --out DIR``: HF folder -> per-rank safetensors.

Every shard is cut by :meth:`tpengine.plan.ShardPlan.shard` with the kind from
:func:`tpengine.surgery.kind_of`; this module holds no partition math. Output layout: see
DESIGN.md, "Per-rank checkpoint layout".
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Annotated, Any

import typer

from shard_tool.common import UserError, atomic_dir, side_files, user_errors
from tpengine.checkpoint import FORMAT_VERSION, INDEX_NAME, checkpoint_files, rank_file_name, sha256_file

DTYPES = ("float32", "bfloat16", "float16")


def _find(files: dict[str, list[str]], suffix: str) -> tuple[str, str] | None:
    for fname, names in files.items():
        for n in names:
            if n == suffix or n.endswith("." + suffix):
                return fname, n
    return None


def _load(model_dir: Path, fname: str, name: str):
    from safetensors import safe_open

    with safe_open(model_dir / fname, framework="pt") as f:
        return f.get_tensor(name)


def _tied_skip(model_dir: Path, files: dict[str, list[str]], tied: bool) -> set[str]:
    """Names of tensors not written: lm_head.weight of a tied model (after checking it equals
    the embedding). Raises UserError for a tied lm_head that differs, or an untied model with
    no lm_head.weight."""
    import torch

    head, emb = _find(files, "lm_head.weight"), _find(files, "embed_tokens.weight")
    if not tied:
        if head is None and emb is not None:
            raise UserError("config has tie_word_embeddings=false but the checkpoint has no lm_head.weight")
        return set()
    if head is None:
        return set()
    if emb is not None and not torch.equal(_load(model_dir, *head), _load(model_dir, *emb)):
        raise UserError(
            f"config has tie_word_embeddings=true but {head[1]} differs from {emb[1]}; "
            "fix the config or the checkpoint"
        )
    return {head[1]}


def split_model(
    model_dir: Path, tp_size: int, out: Path, dtype: str | None = None, force: bool = False, progress=None
) -> dict[str, Any]:
    """Split the HF checkpoint in ``model_dir`` into ``tp_size`` rank files under ``out``.

    Works one rank at a time, one tensor at a time (peak memory: one rank's shards plus one
    full tensor). Floating tensors are cast to ``dtype`` (default: the dtype of the first
    floating tensor in the checkpoint). Returns the manifest written to ``out/manifest.json``.

    Raises:
        UserError: missing config/checkpoint files, bad dtype, a tied lm_head that differs from
            the embedding, or ``out`` already existing without ``force``.
        ValueError: an invalid tp_size for this model (message from ShardPlan.build), or a
            weight whose module tpengine's layer table does not cover.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from tpengine.plan import ShardPlan
    from tpengine.surgery import kind_of

    model_dir, out = Path(model_dir), Path(out)
    if not (model_dir / "config.json").is_file():
        raise UserError(f"{str(model_dir)!r} is not a model folder: it has no config.json")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"invalid dtype {dtype!r}: must be one of {', '.join(DTYPES)}")
    if out.exists() and not force:
        raise UserError(f"output folder {str(out)!r} already exists; remove it or pass --force")
    config = AutoConfig.from_pretrained(model_dir)
    plan = ShardPlan.build(config, tp_size)
    files = checkpoint_files(model_dir)
    skip = _tied_skip(model_dir, files, bool(getattr(config, "tie_word_embeddings", False)))
    if dtype is None:
        dtype = _first_float_dtype(model_dir, files) or "float32"
    tdtype = getattr(torch, dtype)
    total = sum(len(names) for names in files.values())

    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "tp_size": tp_size,
        "plan": plan.to_dict(),
        "dtype": dtype,
        "source_files": [],
        "shard_files": [],
        "config": config.to_dict(),
        "tensors": {},
    }
    with atomic_dir(out, force=force) as tmp:
        for r in range(tp_size):
            task = progress.add_task(f"rank {r}/{tp_size}", total=total) if progress else None
            shards: dict[str, torch.Tensor] = {}
            for fname, names in files.items():
                with safe_open(model_dir / fname, framework="pt") as f:
                    for name in names:
                        if progress:
                            progress.advance(task)
                        if name in skip:
                            continue
                        t = f.get_tensor(name)
                        piece = plan.shard(kind_of(name, t.dim()), name.endswith(".bias"), t, r)
                        shards[name] = piece.to(tdtype) if piece.is_floating_point() else piece
                        del t
            rname = rank_file_name(r, tp_size)
            save_file(shards, tmp / rname, metadata={"format": "pt", "rank": str(r), "tp_size": str(tp_size)})
            manifest["tensors"][str(r)] = {n: list(t.shape) for n, t in shards.items()}
            manifest["shard_files"].append({"name": rname, "rank": r, "sha256": sha256_file(tmp / rname)})
            del shards
        sources = list(files) + ([INDEX_NAME] if (model_dir / INDEX_NAME).is_file() else [])
        manifest["source_files"] = [{"name": s, "sha256": sha256_file(model_dir / s)} for s in sources]
        for p in side_files(model_dir):
            shutil.copy2(p, tmp / p.name)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    return manifest


def _first_float_dtype(model_dir: Path, files: dict[str, list[str]]) -> str | None:
    from safetensors import safe_open

    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    for fname, tensors in files.items():
        with safe_open(model_dir / fname, framework="pt") as f:
            for n in tensors:
                code = f.get_slice(n).get_dtype()
                if code in names:
                    return names[code]
    return None


def split(
    model_dir: Annotated[Path, typer.Argument(help="Hugging Face model folder (config.json + safetensors)")],
    tp: Annotated[int, typer.Option("--tp", help="tensor-parallel size (1..num_attention_heads)")],
    out: Annotated[Path, typer.Option("--out", help="output folder for the rank files and manifest")],
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="float32, bfloat16 or float16 (default: checkpoint's)")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="replace --out if it exists")] = False,
) -> None:
    """Write one safetensors file per rank plus manifest.json (exactly what each rank loads)."""
    from rich.console import Console
    from rich.progress import Progress

    with user_errors(), Progress(console=Console(stderr=True), transient=True) as progress:
        m = split_model(model_dir, tp, out, dtype=dtype, force=force, progress=progress)
    n = len(m["tensors"]["0"])
    print(f"wrote {tp} rank files ({n} tensors each, {m['dtype']}) and manifest.json to {out}")
