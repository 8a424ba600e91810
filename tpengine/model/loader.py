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
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tpengine.backends import get_platform
from tpengine.backends.platform import ExecutionProfile
from tpengine.distributed import TPInfo, all_reduce_max
from tpengine.errors import UserError
from tpengine.model.families import expand_fused, fused_parts, renamed
from tpengine.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tpengine.model.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from tpengine.model.layers.moe import MoEBlock
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
from tpengine.model.surgery import build_model, checkpoint_targets, holds, kind_in, stage_holds
from tpengine.model.tensor_file import MAP_MIN_BYTES, TensorInfo, map_rows, read_header, read_rows

# the linears --quantization stores quantized with its scheme, and the vocabulary layers (QuantScheme.vocab)
QUANTIZED_LAYERS = (ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear)
VOCAB_LAYERS = (VocabParallelEmbedding, ParallelLMHead)
# the layers that can hold a weight a quantized folder stores quantized
STORED_QUANT_LAYERS = QUANTIZED_LAYERS + VOCAB_LAYERS
# the layers whose plain weight may take its platform's layout or kernels (CPU: oneDNN's, the GEMV / GEMM)
PACKABLE_LAYERS = QUANTIZED_LAYERS + (ParallelLMHead,)


def _materialize(module: torch.nn.Module, attr: str, dtype: torch.dtype, device: torch.device,
                 staging: _Staging | None = None) -> torch.Tensor:
    """The real storage of ``module.<attr>``, allocated (uninitialised) on first use: from
    ``staging`` for a weight that will be replaced by its packed layout, else its own memory."""
    p = getattr(module, attr)
    if p.is_meta:  # (a parameter built in another dtype keeps it: a float32 norm weight in a bfloat16 model)
        data = staging.take(module, p.shape, dtype) if staging is not None else torch.empty(p.shape, dtype=p.dtype,
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


def _wanted(targets: dict, stored: dict[str, QuantEntry]) -> dict[str, tuple]:
    """Checkpoint name -> ``(target, part or None, entry or None)`` for every tensor to read: each
    target's own name, or for a weight ``stored`` quantized the names of its stored parts.

    Raises:
        UserError: a stored quantized weight of a layer that keeps float weights, or the parts of one
            merged layer stored in different schemes.
    """
    wanted: dict[str, tuple] = {}
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
    return wanted


class _Filler:
    """One load's state: where each checkpoint tensor goes (:func:`_wanted`), how many tensors each
    layer still waits for, and what is done with a layer once all its tensors are in (quantized,
    packed into its platform's layout, or its stored quantized parts assembled)."""

    def __init__(self, model: torch.nn.Module, wanted: dict[str, tuple], tie: bool, dtype: torch.dtype,
                 device: torch.device, pack, prepack, quant: QuantScheme | None, reduce_max, maps: bool = False):
        self.wanted, self.tie, self.dtype, self.device, self.maps = wanted, tie, dtype, device, maps
        self.quant, self.reduce_max, self.prepack = quant, reduce_max, prepack
        self.left: dict[int, int] = {}
        for t, _, _ in wanted.values():
            self.left[id(t.module)] = self.left.get(id(t.module), 0) + 1
        self.head = model.get_output_embeddings()
        self.qstored = {id(t.module): e for t, part, e in wanted.values() if part is not None}  # layer -> entry
        self.qparts = QuantParts(dtype)
        self.wants = pack if callable(pack) else (lambda m: pack)
        self.staging = (_Staging() if ((pack is not False and prepack is not None) or quant is not None)
                        and device.type == "cpu" else None)

    def scheme(self, m: torch.nn.Module) -> QuantScheme | None:
        """The scheme ``--quantization`` stores layer ``m`` in, or None (float)."""
        if self.quant is None:
            return None
        if isinstance(m, QUANTIZED_LAYERS):
            return self.quant
        return self.quant.vocab if isinstance(m, VOCAB_LAYERS) else None

    def packs(self, m: torch.nn.Module) -> bool:
        """Whether layer ``m``'s weight takes its platform's layout once loaded."""
        return (self.prepack is not None and isinstance(m, PACKABLE_LAYERS) and not (self.tie and m is self.head)
                and self.scheme(m) is None and id(m) not in self.qstored and self.wants(m))

    def dest(self, t, part, entry, info: TensorInfo, spec) -> torch.Tensor:
        """The tensor checkpoint tensor ``info`` is read into (the target's rows are narrowed by the caller).

        Raises:
            ValueError: a stored quantized part that is not 2-D.
        """
        if part is None:
            via = self.staging if t.attr == "weight" and (self.packs(t.module) or self.scheme(t.module)) else None
            return _materialize(t.module, t.attr, self.dtype, self.device, via)
        if len(info.shape) != 2:
            raise ValueError(f"checkpoint tensor {info.name!r} has shape {list(info.shape)}; the "
                             f"{entry.scheme} format stores {part} as a 2-D tensor")
        cols = spec[2] - spec[1] if spec is not None and spec[0] == 1 else info.shape[1]
        return self.qparts.dest(t.module, part, entry, info, cols)

    def mapped(self, fd: int, t, part, info: TensorInfo, spec) -> bool:
        """Whether checkpoint tensor ``info`` went in as a mapping of its pages (:func:`map_rows`) rather
        than read: where the load maps (``maps``), for a parameter of at least :data:`MAP_MIN_BYTES` that
        is the whole of one still unloaded CPU tensor in its checkpoint dtype, all of it or a row range
        (``spec`` on dim 0, no padding rows; a dim-1 ``spec`` of every column is all of it), that takes
        no packed layout or quantization (those read it into a staging buffer)."""
        p = getattr(t.module, t.attr) if part is None else None
        if (p is None or not self.maps or not p.is_meta or p.dim() == 0 or self.device.type != "cpu"
                or info.nbytes < MAP_MIN_BYTES
                or not info.dtype == p.dtype == self.dtype or t.start != 0 or t.rows != p.shape[0]
                or (t.attr == "weight" and (self.packs(t.module) or self.scheme(t.module)))):
            return False
        whole = spec is None or (spec[0] == 1 and spec[1] == 0 and spec[2] == info.shape[-1])  # (tp=1's row-parallel)
        start, end = (0, info.shape[0]) if whole else (spec[1], spec[2])
        if (not whole and spec[0] != 0) or end > info.shape[0] or (end - start, *info.shape[1:]) != tuple(p.shape):
            return False  # a column slice, padding rows or a shape mismatch: read (and checked) by _fill
        try:
            pages = map_rows(fd, info, end - start, start)
        except OSError:  # a file system that cannot map (some FUSE mounts): read it
            return False
        setattr(t.module, t.attr, torch.nn.Parameter(pages, requires_grad=False))
        return True

    def filled(self, m: torch.nn.Module, name: str) -> None:
        """One more tensor of layer ``m`` is in (``name``); once all are: assemble, quantize or pack it."""
        self.left[id(m)] -= 1
        if self.left[id(m)]:
            return
        if hasattr(m, "loaded"):  # a layer that finishes its own weights (a norm's offset)
            m.loaded()
        if id(m) in self.qstored:
            self.qparts.finish(m, name, self.qstored[id(m)])
        elif self.scheme(m) is not None:
            quantize_linear(m, self.scheme(m), self.reduce_max)  # new tensors: the staging buffer is free
        elif self.packs(m):
            if not m.pack(self.prepack) and self.staging is not None:  # not packed: a weight of its own
                m.weight.data = m.weight.data.clone()
        else:
            return
        if self.staging is not None:
            self.staging.give_back(m)


def _slice_of(plan: ShardPlan | None, name: str, info: TensorInfo, part, entry, rank: int):
    """``(spec, full)`` for :func:`_fill`: this rank's slice of checkpoint tensor ``name`` by ``plan``
    (None, None: the whole tensor, a shard folder's rank file)."""
    if plan is None:
        return None, None
    kind = kind_in(plan, name, info.shape)
    if part is not None:
        return part_slice(plan, kind, entry, part, rank)
    spec = plan.slice_spec(kind, name.endswith(".bias"), rank)
    return spec, None if spec is None else plan.full_size(kind)


def _whole(spec, info: TensorInfo) -> bool:
    """Whether ``spec`` (:func:`_slice_of`'s) takes all of tensor ``info``."""
    return spec is None or (spec[0] < len(info.shape) and spec[1] == 0 and spec[2] == info.shape[spec[0]])


def _merged_runs(infos: dict[str, TensorInfo], filler: _Filler, spec_of) -> dict[str, tuple[TensorInfo, list[str]]]:
    """For each merged parameter (q/k/v, gate/up) whose parts lie back to back in this file in its row
    order, each whole for this rank (``spec_of(name)``) and in one dtype: its first part's name -> one
    :class:`TensorInfo` spanning the parts, and the parts' names (for :meth:`_Filler.mapped` to map them
    as one tensor; only where the load maps)."""
    params: dict[tuple[int, str], list[tuple[int, str]]] = {}
    for name, (t, part, _) in filler.wanted.items() if filler.maps else ():
        if part is None and name in infos:
            params.setdefault((id(t.module), t.attr), []).append((t.start, name))
    runs = {}
    for parts in params.values():
        names = [n for _, n in sorted(parts)]
        if len(names) < 2:
            continue
        first, rows = infos[names[0]], 0
        for (start, name), nxt in zip(sorted(parts), names[1:] + [None]):
            info = infos[name]
            if (start != rows or info.dtype != first.dtype or info.shape[1:] != first.shape[1:] or not info.shape
                    or not _whole(spec_of(name), info)
                    or (nxt is not None and info.offset + info.nbytes != infos[nxt].offset)):
                break
            rows += info.shape[0]
        else:
            runs[names[0]] = (TensorInfo(names[0], first.dtype, (rows, *first.shape[1:]), first.offset,
                                         sum(infos[n].nbytes for n in names)), names)
    return runs


def _read_file(path: Path, filler: _Filler, plan: ShardPlan | None, rank: int, done: set[str],
               unexpected: list[str], fused: dict | None = None, hf_config=None, keeps=None) -> None:
    """Read every tensor of checkpoint file ``path`` that this rank keeps into its place (a fused
    tensor of ``fused``, :func:`tpengine.model.families.fused_parts`, as its parts; under ``hf_config``'s
    family's names, :func:`tpengine.model.families.renamed`; another rank's routed expert is skipped, and
    with ``keeps`` (a predicate on the name: a pipeline stage's tensors) any tensor it refuses).

    Raises:
        RuntimeError: a tensor that appears twice.
    """
    infos = renamed(expand_fused(read_header(path), fused or {}), hf_config)
    runs = _merged_runs(infos, filler, lambda n: _slice_of(plan, n, infos[n], None, None, rank)[0])
    in_run: set[str] = set()  # the later parts of a merged parameter mapped whole
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, info in infos.items():
            if name in in_run:
                continue
            if filler.tie and (name == "lm_head.weight" or (part_of(name) or ("",))[0] == "lm_head.weight"):
                continue
            if plan is not None and not holds(plan, (part_of(name) or (name,))[0], rank):
                continue  # expert parallelism: another rank's expert
            if keeps is not None and not keeps((part_of(name) or (name,))[0]):
                continue  # pipeline parallelism: another stage's tensor
            if name in done:
                raise RuntimeError(f"weight {name!r} appears twice in the checkpoint")
            if name not in filler.wanted:
                unexpected.append(name)
                continue
            t, part, entry = filler.wanted[name]
            spec, full = _slice_of(plan, name, info, part, entry, rank)
            if name in runs and filler.mapped(fd, replace(t, rows=runs[name][0].shape[0]), None, runs[name][0], None):
                for n in runs[name][1]:
                    done.add(n)
                    filler.filled(t.module, n)
                in_run.update(runs[name][1])
                continue
            if not filler.mapped(fd, t, part, info, spec):
                _fill(fd, info, filler.dest(t, part, entry, info, spec).narrow(0, t.start, t.rows), spec, full)
            done.add(name)
            filler.filled(t.module, name)
    finally:
        os.close(fd)


def load_weights(model: torch.nn.Module, files: list[Path], plan: ShardPlan | None, rank: int, tie: bool,
                 dtype: torch.dtype, device: torch.device, pack, quant: QuantScheme | None = None,
                 reduce_max=None, stored: dict[str, QuantEntry] | None = None, prepack=None,
                 fused: dict | None = None, hf_config=None, keeps=None, maps: bool = False) -> int:
    """Fill every parameter of ``model`` (from :func:`tpengine.model.surgery.build_model`) from
    ``files``: each checkpoint tensor's byte range for this rank (its ShardPlan slice, or the
    whole tensor when ``plan`` is None: a rank file of a shard folder) is read straight into the
    parameter that keeps it (cast to ``dtype``), so no weight is ever held twice and no file
    stays mapped (but for the weights a short job maps, ``maps``). With ``pack`` (a bool, or a
    predicate on the layer) and ``prepack`` (the platform's
    layout, :meth:`tpengine.backends.platform.Platform.prepack`), each linear layer's weight
    is replaced by that layout as soon as all its parts are in (a tied LM head keeps the
    embedding's plain rows).
    With ``quant``, each column/row-parallel linear's weight is instead quantized as soon as
    its parts are in (:func:`tpengine.model.quant.apply.quantize_linear`, ``reduce_max`` the
    all-reduce MAX of int8's row absmax; never packed), and its float weight dropped.
    ``stored`` (a quantized folder's table, weight name -> entry): each listed weight is read
    from its stored parts (:mod:`tpengine.model.quant.checkpoint`; this rank's slice per the format's
    TP rules) into its quantized storage, scales and zeros cast to ``dtype``. ``fused``: the family's
    fused checkpoint tensors (:func:`tpengine.model.families.fused_parts`), read as their parts;
    ``hf_config``: the model's config, whose family may name checkpoint tensors otherwise
    (:func:`tpengine.model.families.checkpoint_name`: Mixtral's experts); ``keeps``: a predicate on a
    checkpoint name, False for a tensor this rank skips (another pipeline stage's); ``maps``: large whole
    weights in the checkpoint's dtype are mapped instead of read (:meth:`_Filler.mapped`; a merged q/k/v or
    gate/up weight whose parts lie back to back in the file as one, :func:`_merged_runs`), on a platform whose
    :meth:`~tpengine.backends.platform.Platform.maps_weights` says so: a short CPU job). Returns the bytes of
    weights held (quantized ones as stored: values, scales and zeros).

    Raises:
        RuntimeError: a weight that appears twice, is never loaded, or has no place in the model.
        ValueError: a checkpoint tensor whose shape or dtype does not fit the plan or format.
        UserError: a stored quantized weight of a layer that keeps float weights, or the parts
            of one merged layer stored in different schemes.
    """
    wanted = _wanted(checkpoint_targets(model, tie), stored or {})
    filler = _Filler(model, wanted, tie, dtype, device, pack, prepack, quant, reduce_max, maps)
    done: set[str] = set()
    unexpected: list[str] = []
    for path in files:
        _read_file(path, filler, plan, rank, done, unexpected, fused, hf_config, keeps)
    if tie and filler.head is not None:  # (a pipeline stage before the last has no LM head)
        emb = model.get_input_embeddings()
        filler.head.weight = emb.weight
        if emb.quant is not None:  # a stored quantized tied embedding: one storage for both
            filler.head.quant = emb.quant
    missing = sorted(set(wanted) - done)
    if missing or unexpected:
        raise RuntimeError(f"rank {rank}: weights never loaded {missing}, unexpected {sorted(unexpected)}")
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        m.packed_bytes for m in model.modules() if isinstance(m, PACKABLE_LAYERS)) + sum(
        m.nbytes for m in model.modules() if isinstance(m, QuantizedWeight))


def _weight_shapes(model: torch.nn.Module, tie: bool) -> dict[tuple[int, int], int]:
    """Every packable weight shape of ``model`` (still on meta), with how many layers have it (a tied
    head's weight is the embedding's and is left out)."""
    head = model.get_output_embeddings()
    shapes: dict[tuple[int, int], int] = {}
    for m in model.modules():
        if isinstance(m, PACKABLE_LAYERS) and m.weight is not None and not (tie and m is head):
            shapes[tuple(m.weight.shape)] = shapes.get(tuple(m.weight.shape), 0) + 1
    return shapes


def _expert_shapes(model: torch.nn.Module) -> dict[tuple[int, int], int]:
    """The weight shapes of the mixture-of-experts blocks' experts (their ``gated_mlps`` but a shared
    expert) -> how many of them one token runs on this rank (``top_k``, at most the experts it holds)."""
    shapes: dict[tuple[int, int], int] = {}
    for m in model.modules():
        for expert in m.local if isinstance(m, MoEBlock) else ():
            for lin in (expert.gate_up_proj, expert.down_proj):
                shapes[tuple(lin.weight.shape)] = min(m.top_k, len(m.local))
    return shapes


@dataclass(frozen=True)
class LoadedModel:
    """This rank's loaded model: ``module`` (the HF causal LM rebuilt by
    :func:`tpengine.model.surgery.build_model`, its decoder stack
    :class:`~tpengine.model.layers.fused.DecoderStack`), the :class:`~tpengine.model.spec.ModelSpec` it
    came from (``shard_plan``, ``hf_config``), ``weight_bytes`` (bytes of weights this rank holds) and the
    :class:`~tpengine.backends.platform.ExecutionProfile` its platform measured when it bound the model."""

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
    or a shard folder or full HF folder, read with :meth:`ModelSpec.read`): with pipeline stages,
    stage ``tp.pp_rank``'s part only (:func:`tpengine.model.surgery.stage_holds`; another stage's
    tensors are never read).

    Returns a :class:`LoadedModel`, its ``module`` on ``tp.device`` in ``dtype``, the decoder stack's
    forward taking ``(input_ids [N], positions [N], ctx)``. The steps: read the spec, build the model
    (:func:`tpengine.model.surgery.build_model`), check its quantization (:func:`_quantization`), ask
    ``tp.device``'s platform (:func:`tpengine.backends.get_platform`) for the weight layouts, load the
    weights (:func:`load_weights`), then let the platform measure and bind every layer
    (:meth:`tpengine.backends.platform.Platform.bind_model`: the ``profile``). ``pack`` (default True)
    lets linear weights take the platform's layout (the CPU's oneDNN layout) instead of the plain one, per
    weight shape as ``cpu_linear`` says ("auto": measured, :mod:`tpengine.backends.cpu.linear_layout`;
    "plain"; "packed"; the CPU's choices are in ``profile.linear_layouts``); ``cpu_kernels`` lets the
    layers use the CPU C kernels (``EngineConfig.cpu_kernels``). ``quantization`` ("int8", "int4" or None) stores the
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
    hf_config, tie = spec.hf_config, bool(getattr(spec.hf_config, "tie_word_embeddings", False))
    platform = get_platform(tp.device)
    plan = spec.shard_plan
    module = build_model(hf_config, plan, tp.rank, dtype, tp.device, cpu_kernels, tp.pp_rank)
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    keeps = (lambda name: stage_holds(plan, name, tp.pp_rank, layers, tie)) if plan.pp_size > 1 else None  # noqa: E731
    table, quant = _quantization(spec, module, tie, quantization, tp, platform.quantized_weights)
    pack = True if pack is None else pack
    head = module.get_output_embeddings()  # a tied head in float: the model's largest weight, timed first
    float_head = tie and head is not None and table is None and (quant is None or quant.vocab is None)
    layouts = platform.choose_layouts(_weight_shapes(module, tie), dtype, cpu_linear, cpu_kernels,
                                      _expert_shapes(module), module, tp.size,
                                      tuple(head.weight.shape) if float_head else None) if pack else {}
    packs = (lambda m: layouts[tuple(m.weight.shape)].layout != "plain") if layouts else False  # noqa: E731
    prepack = (lambda w: platform.prepack(w, layouts[tuple(w.shape)].layout)) if layouts else platform.prepack  # noqa: E731
    weight_bytes = load_weights(module, rank_files(spec.folder, spec.sharded, tp),
                                None if spec.sharded else spec.shard_plan, tp.rank, tie, dtype, tp.device, packs,
                                quant, all_reduce_max if tp.size > 1 else None, table, prepack,
                                None if spec.sharded else fused_parts(hf_config), hf_config, keeps,
                                platform.maps_weights())
    left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"rank {tp.rank}: still on the meta device after loading: {left}")
    profile = platform.bind_model(module, layouts, tie=tie, dtype=dtype, cpu_kernels=cpu_kernels,
                                  cpu_linear=cpu_linear, rank=tp.rank, pack=bool(pack), tp_size=tp.size)
    return LoadedModel(module, spec, weight_bytes, profile)


def _quantization(spec: ModelSpec, module: torch.nn.Module, tie: bool, quantization: str | QuantScheme | None,
                  tp: TPInfo, supported: bool) -> tuple[dict[str, QuantEntry] | None, QuantScheme | None]:
    """``(table, scheme)``: a quantized folder's table of stored weights (its weights are used as stored,
    so no scheme), or None and the scheme ``quantization`` asks for (None: float weights); ``supported``:
    whether the device's platform runs quantized weights.

    Raises:
        UserError: a broken ``quantization.json`` or manifest table, a folder ``quantization`` disagrees
            with, ``quantization`` off the CPU, or an int4 group the tp split would cut.
    """
    table = read_table(spec.folder)
    if table is not None:
        linears = [n for n in checkpoint_targets(module, tie) if is_linear_weight(n, 2)]
        check_stored_quantization(spec.folder, table, quantization, linears, spec.hf_config, tp,
                                  spec.shard_plan.expert_parallel)
        return table, None
    quant = QuantScheme.of(quantization) if isinstance(quantization, str) else quantization
    if quant is not None:
        if not supported:
            raise UserError(f"--quantization {quant.name} runs on the CPU only in this version, not on {tp.device}")
        check_quantization(spec.hf_config, tp.size, quant, spec.shard_plan.expert_parallel)
    return None, quant
