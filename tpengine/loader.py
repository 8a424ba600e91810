"""Build this rank's tensor-parallel model and load its weights.

Two sources: a shard folder written by ``tpengine-shard split`` (``manifest.json`` +
``rank-RR-of-NN.safetensors``: this rank reads only its own file), or a full HF folder, sliced on
the fly through :class:`tpengine.plan.ShardPlan` tensor by tensor. Each tensor's bytes for this
rank are read straight into the parameter of the final model that keeps them
(:mod:`tpengine.tensor_file`), so loading never holds a weight twice and maps no file.
Afterwards nothing is left on the meta device, every weight was assigned exactly once, and tied
embeddings share storage.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig

from tpengine.checkpoint import (
    MANIFEST,
    check_model_folder,
    checkpoint_files,
    is_shard_folder,
    rank_file_name,
    read_manifest,
    sha256_file,
)
from tpengine.distributed import TPInfo
from tpengine.errors import UserError
from tpengine.kernels import cpu_gemv
from tpengine.kernels.linear_layout import choose_layouts
from tpengine.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from tpengine.layers.quantized import QuantizedWeight, QuantScheme, check_quantization, quantize_linear
from tpengine.plan import ShardPlan
from tpengine.surgery import build_model, checkpoint_targets, kind_of
from tpengine.tensor_file import TensorInfo, read_header, read_rows

# the linears --quantization stores quantized (not the embeddings, not the LM head)
QUANTIZED_LAYERS = (ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear)
# config fields a shard folder must agree on with the config it is launched with
CHECKED_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "head_dim", "tie_word_embeddings")


class CheckpointMismatchError(UserError):
    """Shards made for another TP size or config, or files that do not match the manifest."""


def check_manifest(model_dir: Path, hf_config, tp: TPInfo) -> ShardPlan:
    """Check a shard folder against the launch (world size, config, this rank's file size, or its
    sha256 for a manifest without sizes) before any weight is read or collective runs; return
    its plan. (``tpengine-shard verify`` re-hashes every file; a header that does not fit the
    file is caught when it is read.)

    Raises:
        CheckpointMismatchError: naming the shard tp and the launch tp, or the config field and
            both values, or the file whose hash differs — and the command that re-shards (C19).
    """
    manifest = read_manifest(model_dir)  # UserError: unreadable or truncated, naming the file
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


def rank_files(model_dir: Path, sharded: bool, tp: TPInfo) -> list[Path]:
    """The safetensors files this rank reads: its own ``rank-RR-of-NN.safetensors`` in a shard
    folder, else every file of the full checkpoint (see :func:`tpengine.checkpoint.checkpoint_files`)."""
    if sharded:
        return [model_dir / rank_file_name(tp.rank, tp.size)]
    return [model_dir / f for f in checkpoint_files(model_dir)]


def _materialize(module: torch.nn.Module, attr: str, dtype: torch.dtype, device: torch.device,
                 staging: _Staging | None = None) -> torch.Tensor:
    """The real storage of ``module.<attr>``, allocated (uninitialised) on first use: from
    ``staging`` for a weight that will be replaced by its packed layout, else its own memory."""
    p = getattr(module, attr)
    if p.is_meta:
        data = staging.take(module, p.shape, dtype) if staging is not None else torch.empty(p.shape, dtype=dtype,
                                                                                              device=device)
        p = torch.nn.Parameter(data, requires_grad=False)
        setattr(module, attr, p)
    return p.data


class _Staging:
    """Reusable CPU buffers for weights that only pass through on their way to the packed layout:
    each layer's plain weight is read into a buffer already in memory (not freshly faulted pages),
    reordered, and the buffer goes back for the next layer. Holds a few buffers of the largest
    packed weights' size while loading; dropped afterwards."""

    def __init__(self):
        self.free: list[torch.Tensor] = []
        self.held: dict[int, torch.Tensor] = {}

    def take(self, module: torch.nn.Module, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        n = shape.numel() * dtype.itemsize
        fits = [i for i, b in enumerate(self.free) if b.numel() >= n]
        i = min(fits, key=lambda i: self.free[i].numel()) if fits else None
        buf = self.free.pop(i) if i is not None else torch.empty(n, dtype=torch.uint8)
        self.held[id(module)] = buf
        return buf[:n].view(dtype).view(shape)

    def give_back(self, module: torch.nn.Module) -> None:
        if (buf := self.held.pop(id(module), None)) is not None:
            self.free.append(buf)


def _fill(fd: int, info: TensorInfo, dest: torch.Tensor, spec: tuple[int, int, int] | None, full: int | None) -> None:
    """Write this rank's part of checkpoint tensor ``info`` into ``dest``: the whole tensor
    (``spec`` None) or its ``(dim, start, end)`` slice of a dimension of size ``full``; rows past
    ``full`` (vocabulary padding) are zeroed. Off the CPU it goes through one CPU staging tensor.

    Raises:
        ValueError: the checkpoint tensor's shape does not fit the plan, naming both.
    """
    want = tuple(dest.shape) if spec is None else None
    if spec is not None:
        dim, start, end = spec
        shape = list(info.shape)
        if len(shape) <= dim or shape[dim] != full:
            raise ValueError(f"checkpoint tensor {info.name!r} has shape {list(info.shape)}, expected size {full} "
                             f"along dim {dim} for this model's config")
        shape[dim] = end - start
        want = tuple(shape)
    if tuple(dest.shape) != want or (spec is None and tuple(info.shape) != want):
        raise ValueError(f"checkpoint tensor {info.name!r} has shape {list(info.shape)}, but this rank's "
                         f"parameter is {list(dest.shape)}")
    stage = dest if dest.device.type == "cpu" else torch.empty(dest.shape, dtype=dest.dtype)
    if spec is None:
        read_rows(fd, info, stage)
    else:
        dim, start, end = spec
        keep = max(0, min(end, full) - start)
        if keep:
            read_rows(fd, info, stage.narrow(dim, 0, keep), dim, start)
        if keep < end - start:
            stage.narrow(dim, keep, end - start - keep).zero_()
    if stage is not dest:
        dest.copy_(stage)


def load_weights(model: torch.nn.Module, files: list[Path], plan: ShardPlan | None, rank: int, tie: bool,
                 dtype: torch.dtype, device: torch.device, pack, quant: QuantScheme | None = None,
                 reduce_max=None) -> int:
    """Fill every parameter of ``model`` (from :func:`tpengine.surgery.build_model`) from
    ``files``: each checkpoint tensor's byte range for this rank (its ShardPlan slice, or the
    whole tensor when ``plan`` is None: a rank file of a shard folder) is read straight into the
    parameter that keeps it (cast to ``dtype``), so no weight is ever held twice and no file
    stays mapped. With ``pack`` (CPU; a bool, or a predicate on the layer), each linear layer's weight
    is replaced by its oneDNN layout as soon as all its parts are in (a tied LM head keeps the
    embedding's plain rows).
    With ``quant``, each column/row-parallel linear's weight is instead quantized as soon as
    its parts are in (:func:`tpengine.layers.quantized.quantize_linear`, ``reduce_max`` the
    all-reduce MAX of int8's row absmax; never packed), and its float weight dropped.
    Returns the bytes of weights held (quantized ones as stored: values, scales and zeros).

    Raises:
        RuntimeError: a weight that appears twice, is never loaded, or has no place in the model.
        ValueError: a checkpoint tensor whose shape does not fit the plan.
    """
    targets = checkpoint_targets(model, tie)
    left: dict[int, int] = {}
    for t in targets.values():
        left[id(t.module)] = left.get(id(t.module), 0) + 1
    done: set[str] = set()
    unexpected: list[str] = []
    head = model.get_output_embeddings()
    quantizes = lambda m: quant is not None and isinstance(m, QUANTIZED_LAYERS)  # noqa: E731
    wants = pack if callable(pack) else (lambda m: pack)  # noqa: E731
    packs = lambda m: hasattr(m, "pack") and not (tie and m is head) and not quantizes(m) and wants(m)  # noqa: E731
    staging = _Staging() if (pack is not False or quant is not None) and device.type == "cpu" else None
    for path in files:
        infos = read_header(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            for name, info in infos.items():
                if tie and name == "lm_head.weight":
                    continue
                if name in done:
                    raise RuntimeError(f"weight {name!r} appears twice in the checkpoint")
                t = targets.get(name)
                if t is None:
                    unexpected.append(name)
                    continue
                spec = None
                if plan is not None:
                    kind = kind_of(name, len(info.shape))
                    spec = plan.slice_spec(kind, name.endswith(".bias"), rank)
                full = None if spec is None else plan.full_size(kind)
                via = staging if t.attr == "weight" and (packs(t.module) or quantizes(t.module)) else None
                param = _materialize(t.module, t.attr, dtype, device, via)
                _fill(fd, info, param.narrow(0, t.start, t.rows), spec, full)
                done.add(name)
                left[id(t.module)] -= 1
                if not left[id(t.module)] and quantizes(t.module):
                    quantize_linear(t.module, quant, reduce_max)  # new tensors: the staging buffer is free
                    if staging is not None:
                        staging.give_back(t.module)
                elif not left[id(t.module)] and packs(t.module):
                    if not t.module.pack() and staging is not None:  # no oneDNN: keep the weight, in memory of its own
                        t.module.weight.data = t.module.weight.data.clone()
                    if staging is not None:
                        staging.give_back(t.module)
        finally:
            os.close(fd)
    if tie:
        head.weight = model.get_input_embeddings().weight
    missing = sorted(set(targets) - done)
    if missing or unexpected:
        raise RuntimeError(f"rank {rank}: weights never loaded {missing}, unexpected {sorted(unexpected)}")
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        getattr(m, "packed_bytes", 0) for m in model.modules()) + sum(
        m.nbytes for m in model.modules() if isinstance(m, QuantizedWeight))


def _choose_layouts(model: torch.nn.Module, tie: bool, dtype: torch.dtype, setting: str, native: bool):
    """The measured or forced layout (:func:`tpengine.kernels.linear_layout.choose_layouts`) of every
    packable weight shape of ``model`` (still on meta), counting the layers of each shape."""
    head = model.get_output_embeddings()
    shapes: dict[tuple[int, int], int] = {}
    for m in model.modules():
        if hasattr(m, "pack") and m.weight is not None and not (tie and m is head):
            shapes[tuple(m.weight.shape)] = shapes.get(tuple(m.weight.shape), 0) + 1
    return choose_layouts(shapes, dtype, setting, native)


def _all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elementwise max over the tp ranks, in place (the default group; loading only)."""
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t


def load_model(model_dir: str | Path, tp: TPInfo, dtype: torch.dtype = torch.float32, pack: bool | None = None,
               native: bool = True, quantization: str | None = None, cpu_linear: str = "auto"):
    """Build and load this rank's model from ``model_dir`` (shard folder or full HF folder).

    Returns ``(model, plan, hf_config)``; ``model`` is the HF causal LM rebuilt by
    :func:`tpengine.surgery.build_model`, on ``tp.device`` in ``dtype``, its decoder stack's
    forward taking ``(input_ids [N], positions [N], ctx)``. ``pack`` (default: on the CPU) lets
    linear weights take oneDNN's layout instead of the plain one, per weight shape as
    ``cpu_linear`` says ("auto": measured, :mod:`tpengine.kernels.linear_layout`; "plain";
    "packed"; the choices are ``model.linear_layouts``); ``native`` lets the fused
    ops use the CPU C kernels. ``quantization`` ("int8", "int4" or None) stores the
    column/row-parallel linears' weights quantized (:mod:`tpengine.layers.quantized`; at tp > 1
    int8 all-reduces each row-parallel weight's row absmax while loading, so every rank loads
    the same files in the same order). ``model.weight_bytes`` is the bytes of weights this rank holds.

    Raises:
        CheckpointMismatchError: a shard folder for another tp/config or with a bad hash.
        UserError: no folder, a missing or unreadable ``config.json`` or ``manifest.json``
            (:func:`tpengine.checkpoint.check_model_folder`); ``quantization`` off the CPU, or
            an int4 group the tp split would cut (:func:`tpengine.layers.quantized.check_quantization`).
        FileNotFoundError: a checkpoint file the folder or its index names is missing.
        RuntimeError: a weight assigned twice or never, or anything left on meta.
    """
    model_dir = Path(model_dir)
    check_model_folder(model_dir)  # UserError: no folder, no or a broken config.json or manifest.json
    hf_config = AutoConfig.from_pretrained(model_dir)
    sharded = is_shard_folder(model_dir)
    plan = check_manifest(model_dir, hf_config, tp) if sharded else ShardPlan.build(hf_config, tp.size)
    quant = None if quantization is None else QuantScheme.of(quantization)
    if quant is not None:
        if tp.device.type != "cpu":
            raise UserError(f"--quantization {quantization} runs on the CPU only in this version, not on {tp.device}")
        check_quantization(hf_config, tp.size, quant)
    tie = bool(getattr(hf_config, "tie_word_embeddings", False))
    model = build_model(hf_config, plan, tp.rank, dtype, tp.device, native)
    pack = tp.device.type == "cpu" if pack is None else pack
    model.linear_layouts = {}
    if pack:
        model.linear_layouts = _choose_layouts(model, tie, dtype, cpu_linear, native)
        pack = lambda m: model.linear_layouts[tuple(m.weight.shape)].layout == "packed"  # noqa: E731
    model.weight_bytes = load_weights(model, rank_files(model_dir, sharded, tp), None if sharded else plan, tp.rank,
                                      tie, dtype, tp.device, pack, quant,
                                      _all_reduce_max if tp.size > 1 else None)
    for m in model.modules():  # plain bfloat16 weights measured faster through the GEMV kernel at a few rows
        choice = model.linear_layouts.get(tuple(m.weight.shape)) if getattr(m, "weight", None) is not None else None
        if hasattr(m, "pack") and choice is not None and choice.gemv_rows and cpu_gemv.available(m.weight):
            m.gemv_rows = choice.gemv_rows
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"rank {tp.rank}: still on the meta device after loading: {left}")
    return model, plan, hf_config
