"""``tpengine-shard verify DIR``: check a split checkpoint against its manifest and plan (and,
quantized, the stored parts against the manifest's quantization table)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from shard_tool.common import read_model_config, user_errors
from tpengine.config import WEIGHT_DTYPES
from tpengine.model.checkpoint import rank_file_name, read_manifest, sha256_file
from tpengine.model.tensor_file import CODE_OF

# safetensors dtype code of each weight dtype name (the code table is tpengine.model.tensor_file's)
DTYPE_CODES = {name: CODE_OF[getattr(torch, name)] for name in WEIGHT_DTYPES}


def verify_dir(shard_dir: Path) -> list[str]:
    """Check every rank file of the split checkpoint in ``shard_dir``: its sha256 against the
    manifest, its tensor names and shapes against the manifest, and each shape along the split
    dimension against the ShardPlan (the stored plan must also equal the one rebuilt from
    config.json, with the stored plan's expert layout). A mixture-of-experts folder split with
    expert parallelism holds in each rank file only the experts the plan gives that rank. A
    quantized folder's parts (``P.qweight``, ``P.scales``, ``P.zeros``) are checked against the
    manifest's ``"quantization"`` table: every listed weight stored as all its parts (no float
    ``P.weight``), each part of the format's dtype and of the shape the plan and its scheme give
    the rank (:func:`tpengine.model.quant.checkpoint.local_shapes`), no part of an unlisted
    weight. Returns one message per problem (empty list: all good); each message starts with the
    file (and tensor) it concerns.

    Raises:
        UserError: no readable manifest.json in ``shard_dir`` (missing, truncated, a key missing),
            or a broken config.json.
    """
    from safetensors import SafetensorError, safe_open

    from tpengine.errors import UserError
    from tpengine.model.plan import ShardPlan
    from tpengine.model.quant import checkpoint as QC
    from tpengine.model.surgery import expert_of, holds, kind_in, stage_holds

    shard_dir = Path(shard_dir)
    m = read_manifest(shard_dir)  # UserError: missing, truncated, another format, a key missing
    tp, pp = m["tp_size"], int(m.get("pp_size", 1))
    plan = ShardPlan.from_dict(m["plan"])
    errors: list[str] = []
    if plan.tp_size != tp:
        errors.append(f"manifest.json: plan.tp_size={plan.tp_size} but tp_size={tp}")
    if plan.pp_size != pp:
        errors.append(f"manifest.json: the plan has {plan.pp_size} pipeline stages but pp_size={pp}")
    config = read_model_config(shard_dir) if (shard_dir / "config.json").is_file() else None
    if config is not None:
        rebuilt = ShardPlan.build(config, tp, plan.expert_parallel, plan.pp_size,
                                  [b - a for a, b in plan.stages] or None)
        if rebuilt != plan:
            errors.append("manifest.json: stored plan differs from the plan built from config.json")
    # one file per TP rank, or per TP rank of every stage (stage-major): file index -> (stage, rank)
    want = {rank_file_name(e, tp * pp) if pp > 1 else rank_file_name(e, tp): e for e in range(tp * pp)}
    layers = int(getattr(config, "num_hidden_layers", 0) or 0) if config is not None else (
        plan.stages[-1][1] if plan.stages else 0)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    listed = {e["name"]: e for e in m["shard_files"]}
    if set(listed) != set(want):
        errors.append(f"manifest.json: shard_files {sorted(listed)} != expected {sorted(want)}")
    for extra in sorted(p.name for p in shard_dir.glob("rank-*.safetensors") if p.name not in want):
        errors.append(f"{extra}: not part of this tp_size={tp} checkpoint")
    code = DTYPE_CODES.get(m.get("dtype"))
    table: dict = {}
    if m.get("quantization") is not None:
        try:
            table = QC.parse_table(m["quantization"], "manifest.json")
        except UserError as e:
            errors.append(str(e))
    for fname, e in want.items():
        stage, r = divmod(e, tp)
        path = shard_dir / fname
        if not path.is_file():
            errors.append(f"{fname}: missing")
            continue
        digest = sha256_file(path)
        if fname in listed and digest != listed[fname]["sha256"]:
            errors.append(f"{fname}: sha256 {digest[:16]}... does not match manifest {listed[fname]['sha256'][:16]}...")
            continue
        expected: dict[str, Any] = m["tensors"].get(str(e), {})
        try:
            with safe_open(path, framework="pt") as f:
                names = f.keys()
                got = {n: (f.get_slice(n).get_shape(), f.get_slice(n).get_dtype()) for n in names}
        except (SafetensorError, OSError, ValueError) as e:  # a damaged file
            errors.append(f"{fname}: unreadable safetensors file ({e})")
            continue
        for n in sorted(set(expected) - set(got)):
            errors.append(f"{fname}: tensor {n} listed in manifest is missing")
        for n in sorted(set(got) - set(expected)):
            errors.append(f"{fname}: tensor {n} is not in the manifest")
        for w, e in sorted(table.items()):
            if not holds(plan, w, r):  # expert parallelism: another rank's expert
                continue
            if w in got:
                errors.append(f"{fname}: tensor {w} is stored float, but the quantization table lists it as "
                              f"{e.describe()}")
            for part in QC.PARTS[e.scheme]:
                if QC.part_name(w, part) not in got:
                    errors.append(f"{fname}: tensor {QC.part_name(w, part)} ({e.describe()}) is missing")
        for n in sorted(n for n in got if not holds(plan, n, r)):
            e = expert_of(n)
            owner = (f"rank {plan.expert_owner(e)}" if e < plan.num_experts
                     else f"no rank (experts 0..{plan.num_experts - 1})")
            errors.append(f"{fname}: tensor {n} is expert {e}'s, which the plan gives to {owner}")
        if pp > 1:
            for n in sorted(n for n in got if not stage_holds(plan, (QC.part_of(n) or (n,))[0], stage, layers, tied)):
                errors.append(f"{fname}: tensor {n} is not stage {stage}'s (layers {plan.stage_layers(stage, layers)})")
        for n in sorted(set(got) & set(expected)):
            shape, dt = list(got[n][0]), got[n][1]
            if shape != list(expected[n]):
                errors.append(f"{fname}: tensor {n} has shape {shape}, manifest says {expected[n]}")
                continue
            part = QC.part_of(n)
            if part is not None:
                errors += _check_part(fname, n, shape, dt, table.get(part[0]), part[1], plan, r)
                continue
            if code and dt in DTYPE_CODES.values() and dt != code:
                errors.append(f"{fname}: tensor {n} has dtype {dt}, manifest says {m['dtype']}")
            try:
                spec = plan.slice_spec(kind_in(plan, n, shape), n.endswith(".bias"), r)
            except ValueError as e:
                errors.append(f"{fname}: tensor {n}: {e}")
                continue
            if spec is not None:
                dim, start, end = spec
                if len(shape) <= dim or shape[dim] != end - start:
                    errors.append(
                        f"{fname}: tensor {n} has shape {shape}; the plan gives rank {r} "
                        f"size {end - start} along dim {dim}"
                    )
    return errors


def _check_part(fname: str, n: str, shape: list[int], dt: str, entry: Any, part: str, plan: Any,
                rank: int) -> list[str]:
    """Problems of the stored quantized part ``n`` (``shape``, safetensors dtype code ``dt``) of
    rank ``rank``'s file ``fname``: not in the quantization table, or of a dtype or shape other
    than the format's and the plan's for ``entry`` (a :class:`~tpengine.model.quant.checkpoint.QuantEntry`)."""
    from tpengine.errors import UserError
    from tpengine.model.quant import checkpoint as QC
    from tpengine.model.surgery import kind_in

    if entry is None:
        return [f"{fname}: tensor {n} is a quantized part, but the quantization table does not list "
                f"{QC.part_of(n)[0]}"]
    try:
        dtype, want = QC.local_shapes(plan, kind_in(plan, n, shape), entry, rank)[part]
    except (UserError, ValueError, KeyError) as e:
        return [f"{fname}: tensor {n}: {e}"]
    errors = []
    if dt != CODE_OF[dtype]:
        errors.append(f"{fname}: tensor {n} has dtype {dt}; {entry.describe()} stores {part} as {CODE_OF[dtype]}")
    if shape != list(want):
        errors.append(f"{fname}: tensor {n} has shape {shape}; the plan and {entry.describe()} give rank {rank} "
                      f"{list(want)}")
    return errors


def verify(shard_dir: Annotated[Path, typer.Argument(help="folder written by tpengine-shard split")]) -> None:
    """Re-hash every rank file and check names and shapes against the manifest and the plan."""
    with user_errors():
        errors = verify_dir(shard_dir)
        m = read_manifest(shard_dir)
    if errors:
        for e in errors[:20]:
            print(f"error: {e}", file=sys.stderr)
        if len(errors) > 20:
            print(f"error: ... and {len(errors) - 20} more", file=sys.stderr)
        raise typer.Exit(1)
    n = sum(len(t) for t in m["tensors"].values())
    quant = ""
    if m.get("quantization") is not None:
        from tpengine.model.quant.checkpoint import describe_table, parse_table

        quant = f", quantized {describe_table(parse_table(m['quantization'], 'manifest.json'))}"
    print(
        f"OK: {shard_dir}: {len(m['shard_files'])} rank files, {n} tensors, dtype {m['dtype']}{quant}, "
        "sha256, names and shapes match manifest and plan"
    )
