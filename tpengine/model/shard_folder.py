"""A shard folder written by ``tpengine-shard split``, checked against the launch before loading:
its manifest's tp size, config and plan, and this rank's file (:func:`check_manifest`), and the
files each rank reads (:func:`rank_files`)."""

from __future__ import annotations

from pathlib import Path

from tpengine.distributed import TPInfo
from tpengine.errors import UserError
from tpengine.model.checkpoint import MANIFEST, checkpoint_files, rank_file_name, read_manifest, sha256_file
from tpengine.model.plan import ShardPlan

# config fields a shard folder must agree on with the config it is launched with
CHECKED_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "head_dim", "tie_word_embeddings")


class CheckpointMismatchError(UserError):
    """Shards made for another TP size or config, or files that do not match the manifest."""


def check_manifest(model_dir: Path, hf_config, tp: TPInfo, expert_parallel: bool = False,
                   layer_partition: list[int] | None = None) -> ShardPlan:
    """Check a shard folder against the launch (world size, config, the experts' layout:
    ``expert_parallel``, the pipeline stages: a folder split ``--pp P`` runs at ``tp.pp_size`` P with its
    layer split (``layer_partition``, when given, must be it), this rank's file size, or its sha256 for a
    manifest without sizes) before any weight is read or collective runs; return its plan. (A folder split
    for TP alone runs at any ``tp.pp_size``, each stage reading its layers from its TP rank's file;
    ``tpengine-shard verify`` re-hashes every file; a header that does not fit the file is caught when it
    is read.)

    Raises:
        CheckpointMismatchError: naming the shard tp and the launch tp, or the config field and
            both values, or the file whose hash differs — and the command that re-shards (C19).
    """
    manifest = read_manifest(model_dir)  # UserError: unreadable or truncated, naming the file
    pp_flag = f" --pp {tp.pp_size}" if tp.pp_size > 1 else ""
    fix = (f"re-shard with: tpengine-shard split <full HF model folder>{pp_flag} --tp {tp.size} "
           f"--out <new folder>")
    if manifest["tp_size"] != tp.size:
        raise CheckpointMismatchError(
            f"shard folder {str(model_dir)!r} was made for tp={manifest['tp_size']} but this launch "
            f"has tp={tp.size} (world size / data_parallel_size); {fix}, or launch with "
            f"--tensor-parallel-size {manifest['tp_size']} (world size = data_parallel_size x tensor_parallel_size)")
    stored = manifest["config"]
    for field in CHECKED_FIELDS:
        mine = getattr(hf_config, field, None)
        if field in stored and mine is not None and stored[field] != mine:
            raise CheckpointMismatchError(
                f"shard folder {str(model_dir)!r} was made for {field}={stored[field]} but the model "
                f"config has {field}={mine}; {fix}")
    plan = ShardPlan.from_dict(manifest["plan"])
    pp = int(manifest.get("pp_size", 1))
    counts = [b - a for a, b in plan.stages] or None
    if pp > 1 and (pp != tp.pp_size or (layer_partition is not None and layer_partition != counts)):
        raise CheckpointMismatchError(
            f"shard folder {str(model_dir)!r} was split into {pp} pipeline stages of {','.join(map(str, counts))} "
            f"layers, but this launch has pipeline_parallel_size={tp.pp_size}"
            + (f" and pp_layer_partition={','.join(map(str, layer_partition))!r}" if layer_partition else "")
            + f"; launch with --pipeline-parallel-size {pp} --pp-layer-partition {','.join(map(str, counts))}, or "
            f"{fix}")
    if plan.num_experts and plan.expert_parallel != bool(expert_parallel):
        how = ("with --enable-expert-parallel (whole experts per rank)" if plan.expert_parallel
               else "without --enable-expert-parallel (every expert split over the ranks)")
        raise CheckpointMismatchError(
            f"shard folder {str(model_dir)!r} was split {how}; launch the same way, or {fix}"
            + (" --enable-expert-parallel" if expert_parallel else ""))
    if plan != ShardPlan.build(hf_config, tp.size, expert_parallel, pp, counts):
        raise CheckpointMismatchError(f"the plan in {MANIFEST} differs from this config's plan; {fix}")
    name = rank_file_name(*_file_rank(pp, tp))
    entry = next((f for f in manifest["shard_files"] if f["name"] == name), None)
    path = model_dir / name
    if entry is None or not path.is_file():
        raise CheckpointMismatchError(f"rank {tp.rank}: shard file {str(path)!r} is missing; {fix}")
    if "bytes" in entry:  # a size check costs nothing; `tpengine-shard verify` re-hashes the files
        if path.stat().st_size != entry["bytes"]:
            raise CheckpointMismatchError(
                f"rank {tp.rank}: {str(path)!r} has {path.stat().st_size} bytes, not the {entry['bytes']} recorded "
                f"in {MANIFEST} (corrupt or truncated); {fix}")
    elif sha256_file(path) != entry["sha256"]:  # a manifest from before sizes were recorded
        raise CheckpointMismatchError(
            f"rank {tp.rank}: {str(path)!r} does not match the sha256 in {MANIFEST} (corrupt or "
            f"truncated); {fix}")
    return plan


def _file_rank(pp: int, tp: TPInfo) -> tuple[int, int]:
    """``(file index, files)`` of this rank in a folder split into ``pp`` stages: one file per TP rank of
    every stage (stage-major, ``pp x tp`` files), or one per TP rank (a folder split for TP alone)."""
    return (tp.engine_rank, tp.engine_size) if pp > 1 else (tp.rank, tp.size)


def rank_files(model_dir: Path, sharded: bool, tp: TPInfo) -> list[Path]:
    """The safetensors files this rank reads: its own ``rank-RR-of-NN.safetensors`` in a shard
    folder (a stage-split folder's file of this stage and TP rank, ``RR`` = stage x tp + TP rank of
    ``NN`` = pp x tp), else every file of the full checkpoint (see
    :func:`tpengine.model.checkpoint.checkpoint_files`)."""
    if sharded:
        pp = int(read_manifest(model_dir).get("pp_size", 1)) if tp.pp_size > 1 else 1
        return [model_dir / rank_file_name(*_file_rank(pp, tp))]
    return [model_dir / f for f in checkpoint_files(model_dir)]
