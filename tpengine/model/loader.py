"""Build this rank's tensor-parallel model and load its weights.

Two sources: a shard folder written by ``tpengine-shard split`` (``manifest.json`` +
``rank-RR-of-NN.safetensors``: this rank reads only its own file), or a full HF folder, sliced on
the fly through :class:`tpengine.model.plan.ShardPlan` tensor by tensor. Each tensor's bytes for this
rank are read straight into the parameter of the final model that keeps them
(:mod:`tpengine.model.tensor_file`), so loading never holds a weight twice and maps no file.
Either may be quantized (:mod:`tpengine.model.quant.checkpoint`: a full folder's ``quantization.json``,
a split folder's manifest): a stored weight's parts are read into its quantized storage, never
through a float weight.
Afterwards nothing is left on the meta device, every weight was assigned exactly once, and tied
embeddings share storage.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tpengine.backends.cpu import cpu_gemm, cpu_gemv, cpu_qgemv, cpu_widen, linear_layout
from tpengine.backends.cpu.linear_layout import choose_head, choose_layouts
from tpengine.distributed import TPInfo
from tpengine.errors import UserError
from tpengine.model.layers.embedding import (
    ROW_MAX_KERNEL,
    ParallelLMHead,
    VocabParallelEmbedding,
    choose_greedy_path,
    choose_row_max_block,
)
from tpengine.model.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from tpengine.model.plan import ShardPlan
from tpengine.model.quant.apply import quantize_linear
from tpengine.model.quant.checkpoint import (
    PARTS,
    QuantEntry,
    is_linear_weight,
    part_name,
    part_of,
    part_slice,
    read_table,
)
from tpengine.model.quant.load import QuantParts, check_stored_quantization
from tpengine.model.quant.weights import QuantizedWeight, QuantScheme, check_quantization
from tpengine.model.shard_folder import rank_files
from tpengine.model.spec import ModelSpec
from tpengine.model.surgery import build_model, checkpoint_targets, kind_of
from tpengine.model.tensor_file import TensorInfo, read_header, read_rows

# the linears --quantization stores quantized with its scheme, and the vocabulary layers (QuantScheme.vocab)
QUANTIZED_LAYERS = (ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear)
VOCAB_LAYERS = (VocabParallelEmbedding, ParallelLMHead)
# the layers that can hold a weight a quantized folder stores quantized
STORED_QUANT_LAYERS = QUANTIZED_LAYERS + VOCAB_LAYERS
# the layers whose plain weight may take oneDNN's layout or tpengine's GEMV / GEMM kernels
PACKABLE_LAYERS = QUANTIZED_LAYERS + (ParallelLMHead,)


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
    its parts are in (:func:`tpengine.model.quant.apply.quantize_linear`, ``reduce_max`` the
    all-reduce MAX of int8's row absmax; never packed), and its float weight dropped.
    ``stored`` (a quantized folder's table, weight name -> entry): each listed weight is read
    from its stored parts (:mod:`tpengine.model.quant.checkpoint`; this rank's slice per the format's
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
    packs = lambda m: (isinstance(m, PACKABLE_LAYERS) and not (tie and m is head) and not quantizes(m)  # noqa: E731
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
        if emb.quant is not None:  # a stored quantized tied embedding: one storage for both
            head.quant = emb.quant
    missing = sorted(set(wanted) - done)
    if missing or unexpected:
        raise RuntimeError(f"rank {rank}: weights never loaded {missing}, unexpected {sorted(unexpected)}")
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        m.packed_bytes for m in model.modules() if isinstance(m, PACKABLE_LAYERS)) + sum(
        m.nbytes for m in model.modules() if isinstance(m, QuantizedWeight))


def _choose_layouts(model: torch.nn.Module, tie: bool, dtype: torch.dtype, setting: str, cpu_kernels: bool):
    """The measured or forced layout (:func:`tpengine.backends.cpu.linear_layout.choose_layouts`) of every
    packable weight shape of ``model`` (still on meta), counting the layers of each shape."""
    head = model.get_output_embeddings()
    shapes: dict[tuple[int, int], int] = {}
    for m in model.modules():
        if isinstance(m, PACKABLE_LAYERS) and m.weight is not None and not (tie and m is head):
            shapes[tuple(m.weight.shape)] = shapes.get(tuple(m.weight.shape), 0) + 1
    return choose_layouts(shapes, dtype, setting, cpu_kernels)


def _all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elementwise max over the tp ranks, in place (the default group; loading only)."""
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t


@dataclass(frozen=True)
class ExecutionProfile:
    """What loading measured and chose on this machine for this rank's weights (CPU; all empty
    elsewhere): ``linear_layouts`` (weight shape -> :class:`~tpengine.backends.cpu.linear_layout.LayoutChoice`),
    ``head_layout`` (a tied LM head's paths per row bucket, or None), ``quant_kernels`` (quantized
    weight group -> :func:`tpengine.backends.cpu.cpu_qgemv.choose`'s entry), ``row_max_choice`` (the
    greedy pick's: a torch block or the C row argmax) and ``greedy_choice`` (a half-precision head's greedy path)."""

    linear_layouts: dict = field(default_factory=dict)
    head_layout: Any = None
    quant_kernels: dict = field(default_factory=dict)
    row_max_choice: Any = None
    greedy_choice: Any = None

    def describe(self, dtype: torch.dtype, head_shape: tuple[int, ...] | None) -> str | None:
        """The one line rank 0 logs about these choices, or None when nothing was measured."""
        if not self.linear_layouts:
            return None
        line = linear_layout.summary(self.linear_layouts, dtype)
        if self.quant_kernels:  # quantized weights: which kernel each shape takes at few rows
            line += "; quantized weights: " + cpu_qgemv.summary(self.quant_kernels)
        if self.head_layout is not None and self.head_layout.times_us and head_shape is not None:
            line += "; tied LM head " + self.head_layout.describe(head_shape)
        if self.row_max_choice is not None:
            line += "; greedy row max " + self.row_max_choice.describe()
        if self.greedy_choice is not None:
            line += "; greedy logits " + self.greedy_choice.describe()
        return line


@dataclass(frozen=True)
class LoadedModel:
    """This rank's loaded model: ``module`` (the HF causal LM rebuilt by
    :func:`tpengine.model.surgery.build_model`, its decoder stack
    :class:`~tpengine.model.layers.fused.DecoderStack`), the :class:`~tpengine.model.spec.ModelSpec` it
    came from (``shard_plan``, ``hf_config``), ``weight_bytes`` (bytes of weights this rank holds) and the
    :class:`ExecutionProfile` measured while loading."""

    module: torch.nn.Module
    spec: ModelSpec
    weight_bytes: int
    profile: ExecutionProfile

    @property
    def shard_plan(self) -> ShardPlan:
        """The launch's :class:`~tpengine.model.plan.ShardPlan`."""
        return self.spec.shard_plan

    @property
    def hf_config(self):
        """The model's ``transformers`` config."""
        return self.spec.hf_config


def load_model(model: ModelSpec | str | Path, tp: TPInfo, dtype: torch.dtype = torch.float32,
               pack: bool | None = None, cpu_kernels: bool = True, quantization: str | QuantScheme | None = None,
               cpu_linear: str = "auto") -> LoadedModel:
    """Build and load this rank's model from ``model`` (a :class:`~tpengine.model.spec.ModelSpec`,
    or a shard folder or full HF folder, read with :meth:`ModelSpec.read`).

    Returns a :class:`LoadedModel`, its ``module`` on ``tp.device`` in ``dtype``, the decoder stack's
    forward taking ``(input_ids [N], positions [N], ctx)``. ``pack`` (default: on the CPU) lets
    linear weights take oneDNN's layout instead of the plain one, per weight shape as
    ``cpu_linear`` says ("auto": measured, :mod:`tpengine.backends.cpu.linear_layout`; "plain";
    "packed"; the choices are in ``profile.linear_layouts``); ``cpu_kernels`` lets the layers use the CPU
    C kernels (``EngineConfig.cpu_kernels``). ``quantization`` ("int8", "int4" or None) stores the
    column/row-parallel linears' weights quantized (:mod:`tpengine.model.quant.weights`; at tp > 1
    int8 all-reduces each row-parallel weight's row absmax while loading, so every rank loads
    the same files in the same order). A quantized folder (:mod:`tpengine.model.quant.checkpoint`)
    needs no ``quantization``: its weights are loaded as stored (``quantization``, if given,
    must say the same).

    Raises:
        tpengine.model.shard_folder.CheckpointMismatchError: a shard folder for another tp/config or with a bad hash.
        UserError: no folder, a missing or unreadable ``config.json`` or ``manifest.json``
            (:func:`tpengine.model.checkpoint.check_model_folder`); ``quantization`` off the CPU, or
            an int4 group the tp split would cut (:func:`tpengine.model.quant.weights.check_quantization`);
            a quantized folder that ``quantization`` disagrees with, a broken ``quantization.json``
            (:func:`check_stored_quantization`, :func:`tpengine.model.quant.checkpoint.read_table`).
        FileNotFoundError: a checkpoint file the folder or its index names is missing.
        RuntimeError: a weight assigned twice or never, or anything left on meta.
    """
    spec = model if isinstance(model, ModelSpec) else ModelSpec.read(model, tp)
    model_dir, hf_config, plan, sharded = spec.folder, spec.hf_config, spec.shard_plan, spec.sharded
    tie = bool(getattr(hf_config, "tie_word_embeddings", False))
    module = build_model(hf_config, plan, tp.rank, dtype, tp.device, cpu_kernels)
    table = read_table(model_dir)  # UserError: a broken quantization.json or manifest table
    if table is not None:
        linears = [n for n in checkpoint_targets(module, tie) if is_linear_weight(n, 2)]
        check_stored_quantization(model_dir, table, quantization, linears, hf_config, tp)
        quantization = None  # the folder's weights are used as stored
    quant = QuantScheme.of(quantization) if isinstance(quantization, str) else quantization
    if quant is not None:
        if tp.device.type != "cpu":
            raise UserError(f"--quantization {quant.name} runs on the CPU only in this version, not on {tp.device}")
        check_quantization(hf_config, tp.size, quant)
    pack = tp.device.type == "cpu" if pack is None else pack
    layouts = _choose_layouts(module, tie, dtype, cpu_linear, cpu_kernels) if pack else {}
    packs = (lambda m: layouts[tuple(m.weight.shape)].layout == "packed") if pack else False  # noqa: E731
    weight_bytes = load_weights(module, rank_files(model_dir, sharded, tp), None if sharded else plan, tp.rank,
                                tie, dtype, tp.device, packs, quant, _all_reduce_max if tp.size > 1 else None, table)
    head = module.get_output_embeddings()
    for m in module.modules():  # plain weights measured faster through the GEMV / GEMM kernels at some rows
        if not isinstance(m, PACKABLE_LAYERS) or m.weight is None or (tie and m is head):
            continue
        choice = layouts.get(tuple(m.weight.shape))
        if choice is None:
            continue
        takes = {"plain": True, "gemv": cpu_gemv.available(m.weight), "gemm": cpu_gemm.available(m.weight),
                 "widen": cpu_widen.available(m.weight)}
        if choice.kernels and all(takes[k] for k in choice.kernels):
            m.kernels = choice.kernels
    head_layout = None
    if pack and tie and isinstance(head, ParallelLMHead) and head.weight is not None and head.quant is None:
        head_layout = choose_head(head.weight, cpu_linear, cpu_kernels)  # the tied head stays plain
        head.kernels = head_layout.kernels
    left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"rank {tp.rank}: still on the meta device after loading: {left}")
    quant_kernels = _choose_quant_kernels(module, cpu_kernels, tp.rank)
    row_max_choice = greedy_choice = None
    if tp.device.type == "cpu" and isinstance(head, ParallelLMHead):  # the greedy pick's block, measured
        row_max_choice, head.row_max_block = choose_row_max_block(head.shard_width, dtype, cpu_kernels)
        head.row_max_kernel = row_max_choice.name == ROW_MAX_KERNEL
        if (cpu_kernels and head.quant is None and head.packed is None and head.weight is not None
                and dtype in (torch.bfloat16, torch.float16)):  # float32 keeps F.linear: HF's arithmetic
            greedy_choice = choose_greedy_path(head)
            head.greedy_mm = greedy_choice.name == "mm"
    for m in module.modules():  # every linear's implementation, bound now that its weight and choices are final
        if isinstance(m, PACKABLE_LAYERS):
            m.bind()
    return LoadedModel(module, spec, weight_bytes,
                       ExecutionProfile(layouts, head_layout, quant_kernels, row_max_choice, greedy_choice))


def _choose_quant_kernels(model: torch.nn.Module, cpu_kernels: bool, rank: int) -> dict[str, dict]:
    """Measure tpengine's int8/int4 kernels against torch's per quantized weight shape
    (:func:`tpengine.backends.cpu.cpu_qgemv.choose`) and set each weight's ``gemv_rows``; {} without
    ``cpu_kernels`` or quantized weights. Each rank measures its own shapes (no collective: ranks may
    hold different shapes, and either kernel computes the same products; the timings are cached
    per rank, so every later load makes the same choice)."""
    groups: dict[str, list] = {}
    for m in model.modules():
        if isinstance(m, QuantizedWeight) and cpu_kernels and m.kernels_take:
            kind = type(m).__name__.removesuffix("Weight").lower()
            group = f"g{m.group_size}" if m.group_size else "per channel"
            groups.setdefault(f"{kind} {group} {m.in_features}->{m.out_features}", []).append(m)
    return cpu_qgemv.choose(groups, rank) if groups else {}
