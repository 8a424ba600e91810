"""Build this rank's tensor-parallel model and load its weights.

Two sources: a shard folder written by ``tpengine-shard split`` (``manifest.json`` +
``rank-RR-of-NN.safetensors``: this rank reads only its own file), or a full HF folder, sliced on
the fly through :class:`tpengine.model.plan.ShardPlan` tensor by tensor. Each tensor's bytes for this
rank are read straight into the parameter of the final model that keeps them
(:mod:`tpengine.model.tensor_file`), so loading never holds a weight twice and maps no file.
Either may be quantized (:mod:`tpengine.quant.checkpoint`: a full folder's ``quantization.json``,
a split folder's manifest): a stored weight's parts are read into its quantized storage, never
through a float weight.
Afterwards nothing is left on the meta device, every weight was assigned exactly once, and tied
embeddings share storage.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig

from tpengine.backends.cpu import cpu_gemm, cpu_gemv, cpu_qgemv
from tpengine.backends.cpu.linear_layout import choose_head, choose_layouts
from tpengine.distributed import TPInfo
from tpengine.errors import UserError
from tpengine.model.checkpoint import check_model_folder, is_shard_folder
from tpengine.model.layers.embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
    choose_greedy_path,
    choose_row_max_block,
)
from tpengine.model.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from tpengine.model.plan import ShardPlan
from tpengine.model.shard_folder import CheckpointMismatchError, check_manifest, rank_files  # noqa: F401 (re-exported)
from tpengine.model.surgery import build_model, checkpoint_targets, kind_of
from tpengine.model.tensor_file import TensorInfo, read_header, read_rows
from tpengine.quant.apply import quantize_linear
from tpengine.quant.checkpoint import PARTS, QuantEntry, is_linear_weight, part_name, part_of, part_slice, read_table
from tpengine.quant.load import QuantParts, check_stored_quantization
from tpengine.quant.weights import QuantizedWeight, QuantScheme, check_quantization

# the linears --quantization stores quantized with its scheme, and the vocabulary layers (QuantScheme.vocab)
QUANTIZED_LAYERS = (ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear)
VOCAB_LAYERS = (VocabParallelEmbedding, ParallelLMHead)
# the layers that can hold a weight a quantized folder stores quantized
STORED_QUANT_LAYERS = QUANTIZED_LAYERS + VOCAB_LAYERS
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
                 reduce_max=None, stored: dict[str, QuantEntry] | None = None) -> int:
    """Fill every parameter of ``model`` (from :func:`tpengine.model.surgery.build_model`) from
    ``files``: each checkpoint tensor's byte range for this rank (its ShardPlan slice, or the
    whole tensor when ``plan`` is None: a rank file of a shard folder) is read straight into the
    parameter that keeps it (cast to ``dtype``), so no weight is ever held twice and no file
    stays mapped. With ``pack`` (CPU; a bool, or a predicate on the layer), each linear layer's weight
    is replaced by its oneDNN layout as soon as all its parts are in (a tied LM head keeps the
    embedding's plain rows).
    With ``quant``, each column/row-parallel linear's weight is instead quantized as soon as
    its parts are in (:func:`tpengine.quant.apply.quantize_linear`, ``reduce_max`` the
    all-reduce MAX of int8's row absmax; never packed), and its float weight dropped.
    ``stored`` (a quantized folder's table, weight name -> entry): each listed weight is read
    from its stored parts (:mod:`tpengine.quant.checkpoint`; this rank's slice per the format's
    TP rules) into its quantized storage, scales and zeros cast to ``dtype``.
    Returns the bytes of weights held (quantized ones as stored: values, scales and zeros).

    Raises:
        RuntimeError: a weight that appears twice, is never loaded, or has no place in the model.
        ValueError: a checkpoint tensor whose shape or dtype does not fit the plan or format.
        UserError: a stored quantized weight of a layer that keeps float weights, or the parts
            of one merged layer stored in different schemes.
    """
    stored = stored or {}
    targets = checkpoint_targets(model, tie)
    wanted: dict[str, tuple] = {}  # checkpoint name -> (target, part or None, entry or None)
    schemes: dict[int, set] = {}
    for name, t in targets.items():
        e = stored.get(name) if t.attr == "weight" else None
        if t.attr == "weight":
            schemes.setdefault(id(t.module), set()).add(e)
        if e is None:
            wanted[name] = (t, None, None)
            continue
        if not isinstance(t.module, STORED_QUANT_LAYERS):
            raise UserError(f"{name!r} is stored quantized ({e.describe()}), but tpengine's "
                            f"{type(t.module).__name__} holds float weights only in this version")
        for part in PARTS[e.scheme]:
            wanted[part_name(name, part)] = (t, part, e)
    for name, t in targets.items():
        if len(schemes.get(id(t.module), ())) > 1:
            parts = [n for n, u in targets.items() if u.module is t.module and u.attr == "weight"]
            raise UserError(f"the parts {', '.join(parts)} of one merged layer are stored in different ways "
                            f"({', '.join(stored[n].describe() if n in stored else 'float' for n in parts)}); "
                            "tpengine needs them alike")
    left: dict[int, int] = {}
    for t, _, _ in wanted.values():
        left[id(t.module)] = left.get(id(t.module), 0) + 1
    done: set[str] = set()
    unexpected: list[str] = []
    head = model.get_output_embeddings()
    qstored = {id(t.module): e for t, part, e in wanted.values() if part is not None}  # layer -> its entry
    qparts = QuantParts(dtype)
    scheme = lambda m: quant if isinstance(m, QUANTIZED_LAYERS) else quant.vocab if isinstance(  # noqa: E731
        m, VOCAB_LAYERS) else None
    quantizes = lambda m: quant is not None and scheme(m) is not None  # noqa: E731
    wants = pack if callable(pack) else (lambda m: pack)  # noqa: E731
    packs = lambda m: (hasattr(m, "pack") and not (tie and m is head) and not quantizes(m)  # noqa: E731
                       and id(m) not in qstored and wants(m))
    staging = _Staging() if (pack is not False or quant is not None) and device.type == "cpu" else None
    for path in files:
        infos = read_header(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            for name, info in infos.items():
                if tie and (name == "lm_head.weight" or (part_of(name) or ("",))[0] == "lm_head.weight"):
                    continue
                if name in done:
                    raise RuntimeError(f"weight {name!r} appears twice in the checkpoint")
                if name not in wanted:
                    unexpected.append(name)
                    continue
                t, part, entry = wanted[name]
                spec, full = None, None
                if plan is not None:
                    kind = kind_of(name, len(info.shape))
                    if part is None:
                        spec = plan.slice_spec(kind, name.endswith(".bias"), rank)
                        full = None if spec is None else plan.full_size(kind)
                    else:
                        spec, full = part_slice(plan, kind, entry, part, rank)
                if part is None:
                    via = staging if t.attr == "weight" and (packs(t.module) or quantizes(t.module)) else None
                    dest = _materialize(t.module, t.attr, dtype, device, via)
                else:
                    if len(info.shape) != 2:
                        raise ValueError(f"checkpoint tensor {info.name!r} has shape {list(info.shape)}; the "
                                         f"{entry.scheme} format stores {part} as a 2-D tensor")
                    cols = spec[2] - spec[1] if spec is not None and spec[0] == 1 else info.shape[1]
                    dest = qparts.dest(t.module, part, entry, info, cols)
                _fill(fd, info, dest.narrow(0, t.start, t.rows), spec, full)
                done.add(name)
                left[id(t.module)] -= 1
                if left[id(t.module)]:
                    continue
                if id(t.module) in qstored:
                    qparts.finish(t.module, name, qstored[id(t.module)])
                elif quantizes(t.module):
                    quantize_linear(t.module, scheme(t.module), reduce_max)  # new tensors: the staging buffer is free
                    if staging is not None:
                        staging.give_back(t.module)
                elif packs(t.module):
                    if not t.module.pack() and staging is not None:  # no oneDNN: keep the weight, in memory of its own
                        t.module.weight.data = t.module.weight.data.clone()
                    if staging is not None:
                        staging.give_back(t.module)
        finally:
            os.close(fd)
    if tie:
        emb = model.get_input_embeddings()
        head.weight = emb.weight
        if getattr(emb, "quant", None) is not None:  # a stored quantized tied embedding: one storage for both
            head.quant = emb.quant
    missing = sorted(set(wanted) - done)
    if missing or unexpected:
        raise RuntimeError(f"rank {rank}: weights never loaded {missing}, unexpected {sorted(unexpected)}")
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        getattr(m, "packed_bytes", 0) for m in model.modules()) + sum(
        m.nbytes for m in model.modules() if isinstance(m, QuantizedWeight))


def _choose_layouts(model: torch.nn.Module, tie: bool, dtype: torch.dtype, setting: str, native: bool):
    """The measured or forced layout (:func:`tpengine.backends.cpu.linear_layout.choose_layouts`) of every
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
               native: bool = True, quantization: str | QuantScheme | None = None, cpu_linear: str = "auto"):
    """Build and load this rank's model from ``model_dir`` (shard folder or full HF folder).

    Returns ``(model, plan, hf_config)``; ``model`` is the HF causal LM rebuilt by
    :func:`tpengine.model.surgery.build_model`, on ``tp.device`` in ``dtype``, its decoder stack's
    forward taking ``(input_ids [N], positions [N], ctx)``. ``pack`` (default: on the CPU) lets
    linear weights take oneDNN's layout instead of the plain one, per weight shape as
    ``cpu_linear`` says ("auto": measured, :mod:`tpengine.backends.cpu.linear_layout`; "plain";
    "packed"; the choices are ``model.linear_layouts``); ``native`` lets the fused
    ops use the CPU C kernels. ``quantization`` ("int8", "int4" or None) stores the
    column/row-parallel linears' weights quantized (:mod:`tpengine.quant.weights`; at tp > 1
    int8 all-reduces each row-parallel weight's row absmax while loading, so every rank loads
    the same files in the same order). A quantized folder (:mod:`tpengine.quant.checkpoint`)
    needs no ``quantization``: its weights are loaded as stored (``quantization``, if given,
    must say the same). ``model.weight_bytes`` is the bytes of weights this rank holds.

    Raises:
        CheckpointMismatchError: a shard folder for another tp/config or with a bad hash.
        UserError: no folder, a missing or unreadable ``config.json`` or ``manifest.json``
            (:func:`tpengine.model.checkpoint.check_model_folder`); ``quantization`` off the CPU, or
            an int4 group the tp split would cut (:func:`tpengine.quant.weights.check_quantization`);
            a quantized folder that ``quantization`` disagrees with, a broken ``quantization.json``
            (:func:`check_stored_quantization`, :func:`tpengine.quant.checkpoint.read_table`).
        FileNotFoundError: a checkpoint file the folder or its index names is missing.
        RuntimeError: a weight assigned twice or never, or anything left on meta.
    """
    model_dir = Path(model_dir)
    check_model_folder(model_dir)  # UserError: no folder, no or a broken config.json or manifest.json
    hf_config = AutoConfig.from_pretrained(model_dir)
    sharded = is_shard_folder(model_dir)
    plan = check_manifest(model_dir, hf_config, tp) if sharded else ShardPlan.build(hf_config, tp.size)
    tie = bool(getattr(hf_config, "tie_word_embeddings", False))
    model = build_model(hf_config, plan, tp.rank, dtype, tp.device, native)
    table = read_table(model_dir)  # UserError: a broken quantization.json or manifest table
    if table is not None:
        linears = [n for n in checkpoint_targets(model, tie) if is_linear_weight(n, 2)]
        check_stored_quantization(model_dir, table, quantization, linears, hf_config, tp)
        quantization = None  # the folder's weights are used as stored
    quant = QuantScheme.of(quantization) if isinstance(quantization, str) else quantization
    if quant is not None:
        if tp.device.type != "cpu":
            raise UserError(f"--quantization {quant.name} runs on the CPU only in this version, not on {tp.device}")
        check_quantization(hf_config, tp.size, quant)
    pack = tp.device.type == "cpu" if pack is None else pack
    model.linear_layouts = {}
    if pack:
        model.linear_layouts = _choose_layouts(model, tie, dtype, cpu_linear, native)
        pack = lambda m: model.linear_layouts[tuple(m.weight.shape)].layout == "packed"  # noqa: E731
    model.weight_bytes = load_weights(model, rank_files(model_dir, sharded, tp), None if sharded else plan, tp.rank,
                                      tie, dtype, tp.device, pack, quant,
                                      _all_reduce_max if tp.size > 1 else None, table)
    head = getattr(model, "lm_head", None)
    for m in model.modules():  # plain weights measured faster through the GEMV / GEMM kernels at some rows
        choice = model.linear_layouts.get(tuple(m.weight.shape)) if getattr(m, "weight", None) is not None else None
        if not hasattr(m, "pack") or choice is None or (tie and m is head):
            continue
        takes = {"plain": True, "gemv": cpu_gemv.available(m.weight), "gemm": cpu_gemm.available(m.weight)}
        if choice.kernels and all(takes[k] for k in choice.kernels):
            m.kernels = choice.kernels
    model.head_layout = None
    if pack and tie and isinstance(head, ParallelLMHead) and head.weight is not None and head.quant is None:
        model.head_layout = choose_head(head.weight, cpu_linear, native)  # the tied head stays plain
        head.kernels = model.head_layout.kernels
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"rank {tp.rank}: still on the meta device after loading: {left}")
    model.quant_kernels = _choose_quant_kernels(model, native, tp.rank)
    model.row_max_choice = model.greedy_choice = None
    if tp.device.type == "cpu" and isinstance(head, ParallelLMHead):  # the greedy pick's block, measured
        model.row_max_choice = choose_row_max_block(head.shard_width, dtype)
        head.row_max_block = int(model.row_max_choice.name)
        if (native and head.quant is None and head.packed is None and head.weight is not None
                and dtype in (torch.bfloat16, torch.float16)):  # float32 keeps F.linear: HF's arithmetic
            model.greedy_choice = choose_greedy_path(head)
            head.greedy_mm = model.greedy_choice.name == "mm"
    return model, plan, hf_config


def _choose_quant_kernels(model: torch.nn.Module, native: bool, rank: int) -> dict[str, dict]:
    """Measure tpengine's int8/int4 kernels against torch's per quantized weight shape
    (:func:`tpengine.backends.cpu.cpu_qgemv.choose`) and set each weight's ``gemv_rows``; {} without
    ``native`` or quantized weights. Each rank measures its own shapes (no collective: ranks may
    hold different shapes, and either kernel computes the same products; the timings are cached
    per rank, so every later load makes the same choice)."""
    groups: dict[str, list] = {}
    for m in model.modules():
        if isinstance(m, QuantizedWeight) and native and m.native_ok:
            kind = type(m).__name__.removesuffix("Weight").lower()
            group = f"g{m.group_size}" if m.group_size else "per channel"
            groups.setdefault(f"{kind} {group} {m.in_features}->{m.out_features}", []).append(m)
    return cpu_qgemv.choose(groups, rank) if groups else {}
