"""``tpengine-shard split MODEL_DIR [--pp P] --tp N --out DIR [--quantize int8|int4] [--enable-expert-parallel]``:
HF folder -> per-rank safetensors (with ``--pp``, one file per TP rank of every pipeline stage, holding only
that stage's tensors: :func:`tpengine.model.surgery.stage_holds`).

Every shard is cut by :meth:`tpengine.model.plan.ShardPlan.shard` with the kind from
:func:`tpengine.model.surgery.kind_of`, and every stored part of a quantized weight by
:func:`tpengine.model.quant.checkpoint.slice_part`; this module holds no partition math. A
mixture-of-experts model's experts are laid out as the plan says (each expert's slice under tensor
parallelism; with ``expert_parallel`` whole experts, a rank's file holding only its own:
:func:`tpengine.model.surgery.holds`), under tpengine's tensor names
(:func:`tpengine.model.families.renamed`: Mixtral's ``w1``/``w3``/``w2`` as
``gate_proj``/``up_proj``/``down_proj``). Output layout: see docs/design.md, "Per-rank checkpoint
layout" and "Quantized weights".
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Annotated, Any

import typer

from shard_tool.common import UserError, atomic_dir, read_model_config, side_files, user_errors
from tpengine.config import WEIGHT_DTYPES
from tpengine.model.checkpoint import FORMAT_VERSION, INDEX_NAME, checkpoint_files, rank_file_name, sha256_file


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


def quantize_entry(config: Any, tp_size: int, quantize: str | None, group_size: int | None):
    """The :class:`~tpengine.model.quant.checkpoint.QuantEntry` pair ``(linears, embedding / LM head)``
    of ``split --quantize``, the same as ``--quantization`` makes (None without it): int8 per
    output channel, or int4 with ``group_size`` (default 32); the vocabulary layers by the
    scheme's ``vocab`` (``QuantScheme.vocab``: int8 per output channel under int8, int4 with
    coded zeros at group 32 under int4).

    Raises:
        UserError: an unknown scheme or int4 group size, ``group_size`` with int8, or an int4
            group the tp split would cut (:func:`tpengine.model.quant.weights.check_quantization`).
    """
    from tpengine.model.quant.checkpoint import QuantEntry
    from tpengine.model.quant.weights import QuantScheme, check_quantization

    if quantize is None:
        if group_size is not None:
            raise UserError("--group-size is given without --quantize int4")
        return None
    if quantize == "int8" and group_size is not None:
        raise UserError(f"--group-size {group_size} applies to --quantize int4 only (int8 has one scale per "
                        "output channel)")
    try:
        scheme = QuantScheme.of(quantize, group_size)
    except ValueError as e:
        raise UserError(str(e).replace("invalid quantization", "invalid --quantize")) from None
    check_quantization(config, tp_size, scheme)
    vocab = None if scheme.vocab is None else QuantEntry.of_scheme(scheme.vocab)
    return QuantEntry.of_scheme(scheme), vocab


def split_model(
    model_dir: Path, tp_size: int, out: Path, dtype: str | None = None, force: bool = False, progress=None,
    quantize: str | None = None, group_size: int | None = None, expert_parallel: bool = False, pp_size: int = 1,
) -> dict[str, Any]:
    """Split the HF checkpoint in ``model_dir`` into ``tp_size`` rank files under ``out``, or with ``pp_size``
    stages (the plan's even split, vLLM's rule) into ``pp_size x tp_size`` files, stage-major
    (``rank-<stage x tp + rank>-of-<pp x tp>``), each holding its stage's layers (the embedding in the
    first stage's, and the last's when tied; the final norm and the LM head in the last's); the manifest
    records ``pp_size``, the plan's stages and each file's ``stage`` and ``rank``.

    With ``quantize`` ("int8" or "int4", ``group_size`` input columns per int4 scale, default
    32), every column/row-parallel linear's weight ``P.weight`` (cast to ``dtype`` first), and
    the embedding's and an untied LM head's by the scheme's ``vocab`` (``QuantScheme.vocab``),
    is written as its quantized parts ``P.qweight``, ``P.scales`` (and ``P.zeros``), quantized
    whole and then sliced, vocabulary padding rows all 0
    (:func:`tpengine.model.quant.checkpoint.quantize_parts`: bit for bit what ``--quantization``
    makes on the fly at float32 activations); the manifest's
    ``"quantization"`` lists them. A folder that is already quantized (``quantization.json``,
    e.g. from ``convert --keep-quant``) has its stored parts sliced as they are. A mixture-of-experts
    model's experts follow the plan's layout, whole experts per rank with ``expert_parallel``
    (``EngineConfig.enable_expert_parallel``; the manifest's plan records it), each rank file
    holding only the experts its rank runs.

    Streams: one rank at a time, one tensor at a time, each rank file written tensor by tensor
    (:class:`tpengine.model.tensor_file.TensorFileWriter`), so peak memory stays within three copies of
    the largest tensor (the full tensor, its shard, the shard cast to ``dtype``) plus the runtime.
    Floating tensors are cast to ``dtype`` (default: the dtype of the first
    floating tensor in the checkpoint). Returns the manifest written to ``out/manifest.json``.

    Raises:
        UserError: missing or unreadable config/checkpoint files, an unwritable ``out``, bad dtype,
            a tied lm_head that differs from the embedding, or ``out`` already existing without ``force``;
            a bad ``quantize``/``group_size``, an int4 group the tp split would cut, or ``quantize``
            on a folder that is already quantized; more ranks than experts (``expert_parallel``) or
            than an expert's intermediate (from ShardPlan.build).
        ValueError: an invalid tp_size for this model (message from ShardPlan.build), or a
            weight whose module tpengine's layer table does not cover.
    """
    import torch

    from tpengine.model.families import check_config, expand_fused, fused_parts, renamed
    from tpengine.model.plan import ShardPlan
    from tpengine.model.quant import checkpoint as QC
    from tpengine.model.surgery import holds, kind_in, stage_holds
    from tpengine.model.tensor_file import TensorFileWriter, read_header, read_rows

    model_dir, out = Path(model_dir), Path(out)
    config = read_model_config(model_dir)  # UserError: no, a broken or an unreadable config.json
    check_config(config)  # UserError: a model type or feature the engine would refuse
    if dtype is not None and dtype not in WEIGHT_DTYPES:
        raise UserError(f"invalid dtype {dtype!r}: must be one of {', '.join(WEIGHT_DTYPES)}")
    if out.exists() and not force:
        raise UserError(f"output folder {str(out)!r} already exists; remove it or pass --force")
    plan = ShardPlan.build(config, tp_size, expert_parallel, pp_size)  # UserError: more stages than layers
    fused = fused_parts(config)  # a family's fused tensors (Phi-3's qkv_proj) are written as their parts
    entry, vocab_entry = quantize_entry(config, tp_size, quantize, group_size) or (None, None)
    stored = QC.read_table(model_dir) or {}  # an already quantized folder's weights
    if stored and entry is not None:
        raise UserError(f"{str(model_dir)!r} is already quantized ({QC.describe_table(stored)}); split it "
                        "without --quantize")
    files = checkpoint_files(model_dir)
    skip = _tied_skip(model_dir, files, bool(getattr(config, "tie_word_embeddings", False)))
    if dtype is None:
        dtype = _first_float_dtype(model_dir, files) or "float32"
    tdtype = getattr(torch, dtype)

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
    if pp_size > 1:
        manifest["pp_size"] = pp_size
    layers, tied = int(config.num_hidden_layers), bool(getattr(config, "tie_word_embeddings", False))
    quantized = {}  # weight name -> QuantEntry, of the output
    with atomic_dir(out, force=force) as tmp:
        for e in range(pp_size * tp_size):  # each stage's ranks, stage-major (one stage: e is the rank)
            stage, r = divmod(e, tp_size)
            rname = rank_file_name(e, pp_size * tp_size) if pp_size > 1 else rank_file_name(r, tp_size)
            entries = []  # (source file, tpengine's name, tensor info, kind, is_bias) in output order
            for fname in files:
                for name, info in renamed(expand_fused(read_header(model_dir / fname), fused), config).items():
                    # (expert parallel: this rank's experts; pipeline parallel: this stage's tensors)
                    if name not in skip and holds(plan, name, r) and stage_holds(plan, name, stage, layers, tied):
                        entries.append((fname, name, info, kind_in(plan, name, info.shape), name.endswith(".bias")))
            task = progress.add_task(f"file {e}/{pp_size * tp_size}", total=len(entries)) if progress else None
            declared = []  # (name, dtype, shape) of the rank file, in order
            for _, name, info, kind, bias in entries:
                part = QC.part_of(name)
                if part is not None and part[0] in stored:  # an already quantized weight's part
                    quantized[part[0]] = stored[part[0]]
                    declared.append((name, *QC.local_shapes(plan, kind, stored[part[0]], r)[part[1]]))
                elif entry is not None and (QC.is_linear_weight(name, len(info.shape)) or (
                        vocab_entry is not None and QC.is_vocab_weight(name, len(info.shape)))):
                    quantized[name] = entry if QC.is_linear_weight(name, len(info.shape)) else vocab_entry
                    declared += [(QC.part_name(name, p), *ds)
                                 for p, ds in QC.local_shapes(plan, kind, quantized[name], r).items()]
                else:
                    declared.append((name, tdtype if info.dtype.is_floating_point else info.dtype,
                                     plan.shard_shape(kind, bias, info.shape, r)))
            shapes = {n: tuple(shape) for n, _, shape in declared}
            out_dtype = {n: dt for n, dt, _ in declared}
            meta = {"format": "pt", "rank": str(r), "tp_size": str(tp_size)}
            if pp_size > 1:
                meta.update(stage=str(stage), pp_size=str(pp_size))
            writer = TensorFileWriter(tmp / rname, declared, metadata=meta)
            for fname, group in itertools.groupby(entries, key=lambda e: e[0]):
                fd = os.open(model_dir / fname, os.O_RDONLY)  # read, not mapped: no page stays resident
                try:
                    for _, name, info, kind, bias in group:
                        t = torch.empty(info.shape, dtype=info.dtype)  # one full tensor at a time
                        read_rows(fd, info, t)
                        part = QC.part_of(name)
                        if part is not None and part[0] in stored:
                            writer.write(name, QC.slice_part(plan, kind, stored[part[0]], part[1], t, r))
                        elif name in quantized:  # quantized whole, then sliced
                            parts = QC.quantize_parts(t.to(tdtype), quantized[name])
                            for p, value in parts.items():
                                writer.write(QC.part_name(name, p),
                                             QC.slice_part(plan, kind, quantized[name], p, value, r))
                            del parts
                        else:
                            writer.write(name, plan.shard(kind, bias, t, r).to(out_dtype[name]))
                        del t
                        if progress:
                            progress.advance(task)
                finally:
                    os.close(fd)
            writer.close()
            manifest["tensors"][str(e)] = {n: list(shp) for n, shp in shapes.items()}
            manifest["shard_files"].append({"name": rname, "rank": r, "sha256": sha256_file(tmp / rname),
                                            "bytes": (tmp / rname).stat().st_size, **({"stage": stage} if pp_size > 1
                                                                                      else {})})
        sources = list(files) + ([INDEX_NAME] if (model_dir / INDEX_NAME).is_file() else [])
        manifest["source_files"] = [{"name": s, "sha256": sha256_file(model_dir / s)} for s in sources]
        if quantized:
            manifest["quantization"] = QC.table_json(quantized)
        for p in side_files(model_dir):
            if p.name != QC.QUANT_FILE:  # the manifest holds the table of the rank files
                shutil.copy2(p, tmp / p.name)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    return manifest


def _first_float_dtype(model_dir: Path, files: dict[str, list[str]]) -> str | None:
    """The name of the first floating dtype among the checkpoint's tensors (header only)."""
    from tpengine.model.tensor_file import read_header

    for fname in files:
        for info in read_header(model_dir / fname).values():
            name = str(info.dtype).removeprefix("torch.")
            if name in WEIGHT_DTYPES:
                return name
    return None


def split(
    model_dir: Annotated[Path, typer.Argument(help="Hugging Face model folder (config.json + safetensors)")],
    tp: Annotated[int, typer.Option("--tp", help="tensor-parallel size (1..num_attention_heads)")],
    out: Annotated[Path, typer.Option("--out", help="output folder for the rank files and manifest")],
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="float32, bfloat16 or float16 (default: checkpoint's)")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="replace --out if it exists")] = False,
    pp: Annotated[int, typer.Option("--pp", help="pipeline stages (1..num_hidden_layers): one file per TP rank of "
                                    "each stage, holding that stage's layers (the even split, as the engine's)")] = 1,
    quantize: Annotated[str | None, typer.Option(
        "--quantize", help="store the column/row-parallel linears' weights quantized: int8 (per output "
        "channel) or int4 (group-wise scale and coded zero); the embedding / LM head the same way "
        "(int8 per output channel, int4 at group 32)")] = None,
    group_size: Annotated[int | None, typer.Option(
        "--group-size", help="int4: input columns per scale and zero, 32, 64, 128 or 256 (default 32)")] = None,
    enable_expert_parallel: Annotated[bool, typer.Option(
        "--enable-expert-parallel", help="a mixture-of-experts model's experts whole on each rank (each rank "
        "file only its own), for a launch with --enable-expert-parallel; default: every expert split")] = False,
) -> None:
    """Write one safetensors file per rank plus manifest.json (exactly what each rank loads)."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)  # the bar only on a terminal: a log or pipe gets the result lines alone
    with user_errors(), Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        m = split_model(model_dir, tp, out, dtype=dtype, force=force, progress=progress, quantize=quantize,
                        group_size=group_size, expert_parallel=enable_expert_parallel, pp_size=pp)
    counts = sorted({len(t) for t in m["tensors"].values()})  # expert parallel: uneven experts, uneven counts
    n = counts[0] if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    quant = ""
    if m.get("quantization"):
        from tpengine.model.quant.checkpoint import describe_table, parse_table

        quant = f", quantized {describe_table(parse_table(m['quantization'], 'manifest'))}"
    files = f"{pp * tp} rank files ({pp} stages x {tp} ranks)" if pp > 1 else f"{tp} rank files"
    print(f"wrote {files} ({n} tensors each, {m['dtype']}{quant}) and manifest.json to {out}")
