"""Build this rank's tensor-parallel model and load its weights.

Two sources: a shard folder written by ``tpengine-shard split`` (``manifest.json`` +
``rank-RR-of-NN.safetensors``: this rank reads only its own file), or a full HF folder, sliced on
the fly through :class:`tpengine.plan.ShardPlan` tensor by tensor. Afterwards nothing is left on
the meta device, every weight was assigned exactly once, rotary buffers are rebuilt from the
config on the real device, and tied embeddings share storage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open
from transformers import AutoConfig

from tpengine.checkpoint import MANIFEST, checkpoint_files, is_shard_folder, rank_file_name, sha256_file
from tpengine.distributed import TPInfo
from tpengine.errors import UserError
from tpengine.plan import ShardPlan
from tpengine.surgery import apply_tensor_parallel, build_meta_model, kind_of

# config fields a shard folder must agree on with the config it is launched with
CHECKED_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "head_dim", "tie_word_embeddings")


class CheckpointMismatchError(UserError):
    """Shards made for another TP size or config, or files that do not match the manifest."""


def check_manifest(model_dir: Path, hf_config, tp: TPInfo) -> ShardPlan:
    """Check a shard folder against the launch (world size, config, file hash) before any
    weight is read or collective runs; return its plan.

    Raises:
        CheckpointMismatchError: naming the shard tp and the launch tp, or the config field and
            both values, or the file whose hash differs — and the command that re-shards (C19).
    """
    manifest = json.loads((model_dir / MANIFEST).read_text())
    fix = (f"re-shard with: tpengine-shard split <full HF model folder> --tp {tp.size} "
           f"--out <new folder>")
    if manifest["tp_size"] != tp.size:
        raise CheckpointMismatchError(
            f"shard folder {str(model_dir)!r} was made for tp={manifest['tp_size']} but this launch "
            f"has tp={tp.size} (world size); {fix}, or launch with --nproc_per_node={manifest['tp_size']}")
    stored = manifest["config"]
    for field in CHECKED_FIELDS:
        mine = getattr(hf_config, field, None)
        if field in stored and mine is not None and stored[field] != mine:
            raise CheckpointMismatchError(
                f"shard folder {str(model_dir)!r} was made for {field}={stored[field]} but the model "
                f"config has {field}={mine}; {fix}")
    plan = ShardPlan.from_dict(manifest["plan"])
    if plan != ShardPlan.build(hf_config, tp.size):
        raise CheckpointMismatchError(f"the plan in {MANIFEST} differs from this config's plan; {fix}")
    name = rank_file_name(tp.rank, tp.size)
    entry = next((f for f in manifest["shard_files"] if f["name"] == name), None)
    path = model_dir / name
    if entry is None or not path.is_file():
        raise CheckpointMismatchError(f"rank {tp.rank}: shard file {str(path)!r} is missing; {fix}")
    if sha256_file(path) != entry["sha256"]:
        raise CheckpointMismatchError(
            f"rank {tp.rank}: {str(path)!r} does not match the sha256 in {MANIFEST} (corrupt or "
            f"truncated); {fix}")
    return plan


def iter_rank_tensors(model_dir: Path, plan: ShardPlan | None, rank: int, size: int,
                      tie: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` of this rank's shard, one tensor at a time: read straight from
    its shard file when ``plan`` is None, else sliced from the full checkpoint through ``plan``.
    A tied ``lm_head.weight`` is skipped (the LM head shares the embedding)."""
    if plan is None:
        with safe_open(str(model_dir / rank_file_name(rank, size)), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if not (tie and name == "lm_head.weight"):
                    yield name, f.get_tensor(name)
        return
    for fname, names in checkpoint_files(model_dir).items():
        with safe_open(str(model_dir / fname), framework="pt") as f:
            for name in names:
                if tie and name == "lm_head.weight":
                    continue
                t = f.get_tensor(name)
                yield name, plan.shard(kind_of(name, t.dim()), name.endswith(".bias"), t, rank)


def _rebuild_rotary(model, device: torch.device) -> None:
    for module in model.modules():
        if "inv_freq" in getattr(module, "_buffers", {}) and hasattr(module, "config"):
            fresh = type(module)(config=module.config)  # real tensors, honours rope scaling
            for bname, buf in fresh.named_buffers(recurse=False):
                module._buffers[bname] = buf.to(device)
            if hasattr(fresh, "attention_scaling"):
                module.attention_scaling = fresh.attention_scaling


def load_model(model_dir: str | Path, tp: TPInfo, dtype: torch.dtype = torch.float32):
    """Build and load this rank's model from ``model_dir`` (shard folder or full HF folder).

    Returns ``(model, plan, hf_config)``; ``model`` is the HF causal LM with parallel layers,
    attention routed to tpengine, on ``tp.device`` in ``dtype``.

    Raises:
        CheckpointMismatchError: a shard folder for another tp/config or with a bad hash.
        FileNotFoundError: a checkpoint file the folder or its index names is missing.
        RuntimeError: a weight assigned twice or never, or anything left on meta.
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{str(model_dir)!r} has no config.json; pass a HF model folder or a "
                                f"tpengine-shard split folder (run `make model` for the default)")
    hf_config = AutoConfig.from_pretrained(model_dir)
    sharded = is_shard_folder(model_dir)
    plan = check_manifest(model_dir, hf_config, tp) if sharded else ShardPlan.build(hf_config, tp.size)
    tie = bool(getattr(hf_config, "tie_word_embeddings", False))
    model = apply_tensor_parallel(build_meta_model(hf_config, dtype), plan, tp.rank, dtype)

    loaded: set[str] = set()
    for name, tensor in iter_rank_tensors(model_dir, None if sharded else plan, tp.rank, tp.size, tie):
        if name in loaded:
            raise RuntimeError(f"weight {name!r} appears twice in the checkpoint")
        set_module_tensor_to_device(model, name, tp.device, value=tensor.to(dtype))
        loaded.add(name)
    if tie:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    expected = {n for n, _ in model.named_parameters()}
    if loaded != expected:
        raise RuntimeError(f"rank {tp.rank}: weights never loaded {sorted(expected - loaded)}, "
                           f"unexpected {sorted(loaded - expected)}")
    _rebuild_rotary(model, tp.device)
    for module in model.modules():
        if hasattr(module, "tp_q_to_kv"):
            module.tp_q_to_kv = module.tp_q_to_kv.to(tp.device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"rank {tp.rank}: still on the meta device after loading: {left}")
    return model, plan, hf_config
