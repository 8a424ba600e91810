"""``tpengine-shard info MODEL_DIR [--tp N] [--pp P] [--enable-expert-parallel]``: print the ShardPlan of a
config and each rank's weight bytes (no weights read); a mixture-of-experts model's experts per rank; with
``--pp``, each pipeline stage's layers and every rank's bytes of its stage."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from shard_tool.common import UserError, read_model_config, user_errors
from tpengine.config import DTYPE_BYTES, KV_CACHE_DTYPES
from tpengine.model.families import check_config


def load_config(model_dir: Path):
    """The transformers config of ``model_dir`` (reads config.json, and manifest.json if any).

    Raises:
        UserError: no config.json in ``model_dir``, or a broken one (see
            :func:`shard_tool.common.read_model_config`).
    """
    return read_model_config(model_dir)


def config_dtype(config: Any) -> str:
    """Checkpoint dtype name from the config (``dtype`` / ``torch_dtype``), default float32."""
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    d = str(d).removeprefix("torch.")
    return d if d in DTYPE_BYTES else "float32"


def _expert_shapes(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]] | None:
    """transformers' fused experts of a MoE layer as tpengine's per-expert tensors:
    ``P.experts.gate_up_proj`` [experts, 2 x inter, hidden] -> ``P.experts.<e>.gate_proj.weight`` and
    ``...up_proj.weight`` [inter, hidden] each, ``P.experts.down_proj`` [experts, hidden, inter] ->
    ``P.experts.<e>.down_proj.weight`` [hidden, inter]; None for any other tensor."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj") or len(shape) != 3:
        return None
    if leaf == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": tuple(shape[1:]) for e in range(shape[0])}
    half = (shape[1] // 2, shape[2])
    return {f"{prefix}.{e}.{p}.weight": half for e in range(shape[0]) for p in ("gate_proj", "up_proj")}


def weight_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Full shape of every checkpoint tensor under tpengine's names, from a meta-device model built
    from ``config`` (no weights read or allocated). A tied lm_head.weight is left out, as split does;
    a MoE layer's fused experts count as its per-expert tensors (:func:`_expert_shapes`)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    from tpengine.model.families import fused_parts, unfuse

    tied = bool(getattr(config, "tie_word_embeddings", False))
    fused = fused_parts(config)  # a fused tensor (Phi-3's qkv_proj) counts as its parts, as split writes them
    out = {}
    for n, t in model.state_dict().items():
        if tied and n.split(".")[-2:] == ["lm_head", "weight"]:
            continue
        experts = _expert_shapes(n, tuple(t.shape))
        if experts is not None:
            out.update(experts)
            continue
        parts = unfuse(n, tuple(t.shape), fused)
        for name, _, rows in parts or [(n, 0, t.shape[0] if t.dim() else 0)]:
            out[name] = (rows, *t.shape[1:]) if parts else tuple(t.shape)
    return out


def rank_bytes(plan: Any, shapes: dict[str, tuple[int, ...]], dtype: str, quantized: dict | None = None) -> list[int]:
    """Weight bytes each rank holds (shard shapes from ``plan.slice_spec``, vocab padding
    included), for tensors of ``shapes`` stored as ``dtype``; a weight in ``quantized`` (name ->
    :class:`~tpengine.model.quant.checkpoint.QuantEntry`) as its quantized storage in memory: its
    qweight (int4: two values a byte, rows padded to the kernel's multiple of 16) and its
    scales (and zeros) in ``dtype``; grouped int8 (GGUF's Q8_0) as its two int4 halves (rows
    padded, a scale and a zero for each half, :class:`~tpengine.model.quant.weights.Int8Weight`);
    under expert parallelism a rank counts only its own experts."""
    from tpengine.model.surgery import holds, kind_in

    out = []
    for r in range(plan.tp_size):
        total = 0
        for name, shape in shapes.items():
            if not holds(plan, name, r):  # expert parallelism: another rank's expert
                continue
            if quantized and name in quantized:
                total += _quant_bytes(plan, kind_in(plan, name, shape), quantized[name], r, DTYPE_BYTES[dtype])
                continue
            spec = plan.slice_spec(kind_in(plan, name, shape), name.endswith(".bias"), r)
            local = list(shape)
            if spec is not None:
                local[spec[0]] = spec[2] - spec[1]
            numel = 1
            for s in local:
                numel *= s
            total += numel * DTYPE_BYTES[dtype]
        out.append(total)
    return out


def _quant_bytes(plan: Any, kind: str, entry: Any, rank: int, scale_bytes: int) -> int:
    """Bytes rank ``rank`` holds of one quantized ``kind`` weight (see :func:`rank_bytes`)."""
    from tpengine.model.quant.arith import INT4_ROW_MULTIPLE
    from tpengine.model.quant.checkpoint import local_shapes, weight_shape

    grouped8 = entry.scheme == "int8" and not entry.per_channel(weight_shape(plan, kind)[1])
    total = 0
    for part, (dt, (rows, cols)) in local_shapes(plan, kind, entry, rank).items():
        if entry.scheme == "int4" or grouped8:
            rows = -(-rows // INT4_ROW_MULTIPLE) * INT4_ROW_MULTIPLE
        # grouped int8 runs as two int4 weights: two scale-and-zero pairs for each stored scale
        total += rows * cols * (dt.itemsize if not dt.is_floating_point else scale_bytes * (4 if grouped8 else 1))
    return total


def _rng(a: tuple[int, int]) -> str:
    return f"{a[0]}:{a[1]}"


def _plan(config: Any, size: int, expert_parallel: bool):
    """The plan at tp ``size``, or None where the layout cannot split (more ranks than experts under
    expert parallelism, or than an expert's intermediate under tensor parallelism)."""
    from tpengine.model.plan import ShardPlan

    try:
        return ShardPlan.build(config, size, expert_parallel)
    except UserError:
        return None


def _max_mib(plan: Any, shapes: dict, dtype: str, quantized: dict | None) -> str:
    """The largest rank's weight MiB under ``plan``, or why there is none."""
    if plan is None:
        return "-"
    try:
        return f"{max(rank_bytes(plan, shapes, dtype, quantized)) / 2**20:.2f}"
    except UserError:  # a row split off the quantization's group boundaries
        return "cuts groups"


def _sizes_table(console, config: Any, shapes: dict, dtype: str, quantized: dict | None, experts: int) -> None:
    """Print every valid TP size's heads per rank, padded vocabulary and largest rank's MiB (a MoE
    model: with its experts split, and whole per rank under expert parallelism: "-" where that
    layout cannot split)."""
    from rich.table import Table

    from tpengine.model.plan import ShardPlan

    ep = ("max MiB/rank EP",) if experts else ()
    table = Table("tp", "q heads/rank", "kv heads/rank", "padded vocab", "max MiB/rank", *ep, box=None)
    for size in ShardPlan.valid_tp_sizes(config):
        plans = [_plan(config, size, False)] + ([_plan(config, size, True)] if experts else [])
        p = next((x for x in plans if x is not None), None)
        if p is None:
            continue  # neither layout of the experts splits this many ways
        table.add_row(str(size), ",".join(str(rp.num_q_heads) for rp in p.ranks),
                      ",".join(str(rp.num_kv_heads) for rp in p.ranks), str(p.padded_vocab_size),
                      *(_max_mib(x, shapes, dtype, quantized) for x in plans))
    console.print(f"valid TP sizes: 1..{ShardPlan.dims(config)['num_heads']}")
    console.print(table)


def info(
    model_dir: Annotated[Path, typer.Argument(help="model folder (only config.json is read)")],
    tp: Annotated[
        int | None, typer.Option("--tp", help="show the plan for this TP size (default: list valid sizes)")
    ] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="dtype for byte counts (default: config's)")] = None,
    kv_cache_gb: Annotated[float, typer.Option("--kv-cache-gb", help="KV cache budget per rank in GiB, as the "
                                               "engine's kv_cache_gb (for the memory estimate)")] = 1.0,
    max_num_batched_tokens: Annotated[int, typer.Option(
        "--max-num-batched-tokens", help="tokens of the largest step (for the activation estimate)")] = 8192,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", help="sequences per step (LM-head logits)")] = 64,
    block_size: Annotated[int, typer.Option("--block-size", help="KV cache block size in tokens")] = 16,
    kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype", help="the engine's KV cache storage: auto "
                                                "(the dtype) or int8 (codes and a float32 scale per head row)")
                              ] = "auto",
    enable_expert_parallel: Annotated[bool, typer.Option(
        "--enable-expert-parallel", help="a mixture-of-experts model's experts whole per rank (the plan of a "
        "launch with --enable-expert-parallel); default: every expert split")] = False,
    pp: Annotated[int, typer.Option("--pp", help="pipeline stages (with --tp): each stage's layers and each of "
                                    "its ranks' bytes, as the engine splits them")] = 1,
) -> None:
    """Print the ShardPlan as a table (ranges are half-open start:end), or the valid TP sizes; for a
    quantized folder, its quantization and the quantized weight bytes; for a mixture-of-experts
    model, each rank's experts and their share of each expert (and, listing the sizes, the largest
    rank's bytes with expert parallelism too)."""
    from rich.console import Console
    from rich.table import Table

    from tpengine.model.plan import ShardPlan

    console = Console(width=200) if not Console().is_terminal else Console()
    with user_errors():
        if dtype is not None and dtype not in DTYPE_BYTES:
            raise UserError(f"invalid dtype {dtype!r}: must be one of {', '.join(DTYPE_BYTES)}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UserError(f"invalid kv_cache_dtype {kv_cache_dtype!r}: must be one of {', '.join(KV_CACHE_DTYPES)}")
        config = load_config(model_dir)
        check_config(config)  # a model type or feature the engine would refuse, refused here too
        d = ShardPlan.dims(config)
        if tp is not None:  # UserError names the head (or expert) count and tp (or the layers and pp)
            plan = ShardPlan.build(config, tp, enable_expert_parallel, pp)
        dtype = dtype or config_dtype(config)
        shapes = weight_shapes(config)
        from tpengine.model.quant.checkpoint import describe_table, read_table

        quantized = read_table(model_dir)  # UserError: a broken quantization table
    console.print(
        f"{getattr(config, 'model_type', '?')}: {d['num_heads']} query heads, {d['num_kv_heads']} KV heads, "
        f"head_dim {d['head_dim']}, hidden {d['hidden_size']}, intermediate {d['intermediate_size']}, "
        f"vocab {d['vocab_size']}, {getattr(config, 'num_hidden_layers', '?')} layers, dtype {dtype}"
    )
    experts, expert_inter = ShardPlan.expert_dims(config)
    if experts:
        console.print(f"mixture of experts: {experts} experts of intermediate {expert_inter}, "
                      f"{config.num_experts_per_tok} routed per token")
    if quantized:
        console.print(f"quantized: {describe_table(quantized)} (the rest {dtype})")
    if tp is None:
        _sizes_table(console, config, shapes, dtype, quantized, experts)
        return
    if pp > 1:
        _stages_table(console, config, plan, shapes, dtype, quantized)
        return
    with user_errors():
        nbytes = rank_bytes(plan, shapes, dtype, quantized)
    layout = "" if not experts else (", experts whole per rank (expert parallel)" if plan.expert_parallel
                                     else ", every expert split (tensor parallel)")
    moe_cols = ("experts", "expert intermediate") if experts else ()
    table = Table(
        "rank", "q heads", "#q", "kv heads", "#kv", "q->kv (local)", "intermediate", *moe_cols, "vocab",
        "weight bytes", "MiB", box=None, title=f"tp={tp}, padded vocab {plan.padded_vocab_size}{layout}",
    )
    for rp, b in zip(plan.ranks, nbytes):
        moe = (_rng(rp.experts), _rng(rp.expert_intermediate)) if experts else ()
        table.add_row(
            str(rp.rank), _rng(rp.q_heads), str(rp.num_q_heads), _rng(rp.kv_heads), str(rp.num_kv_heads),
            ",".join(map(str, rp.q_to_kv)), _rng(rp.intermediate), *moe, _rng(rp.vocab), str(b), f"{b / 2**20:.2f}",
        )
    console.print(table)
    from tpengine.model.estimate import estimate

    mem = estimate(plan, nbytes, int(config.num_hidden_layers), DTYPE_BYTES[dtype], kv_cache_gb, block_size,
                   max_num_batched_tokens, max_num_seqs, kv_cache_dtype)
    est = Table("rank", "weights GiB", "KV cache GiB", "KV B/token", "runtime GiB", "total GiB", box=None,
                title=f"estimated peak memory per rank (kv_cache_gb {kv_cache_gb}, kv_cache_dtype {kv_cache_dtype}, "
                      f"{max_num_batched_tokens}-token steps, {max_num_seqs} seqs)")
    for m in mem:
        est.add_row(str(m.rank), f"{m.weights / 2**30:.2f}", f"{m.kv_cache / 2**30:.2f}", str(m.kv_per_token),
                    *(f"{x / 2**30:.2f}" for x in (m.runtime, m.total)))
    console.print(est)


def _stages_table(console, config: Any, plan: Any, shapes: dict, dtype: str, quantized: dict | None) -> None:
    """Per pipeline stage and TP rank (file ``stage x tp + rank`` of ``tpengine-shard split --pp``): the
    stage's layers and what it holds besides them, the rank's heads and weight bytes of its stage."""
    from rich.table import Table

    from tpengine.model.surgery import stage_holds

    layers, tied = int(config.num_hidden_layers), bool(getattr(config, "tie_word_embeddings", False))
    table = Table("stage", "rank", "file", "layers", "holds", "q heads", "kv heads", "weight bytes", "MiB", box=None,
                  title=f"pp={plan.pp_size} x tp={plan.tp_size}, padded vocab {plan.padded_vocab_size}")
    for stage in range(plan.pp_size):
        mine = {n: shape for n, shape in shapes.items() if stage_holds(plan, n, stage, layers, tied)}
        with user_errors():
            nbytes = rank_bytes(plan, mine, dtype, quantized)
        ends = [what for what, name in (("embedding", "model.embed_tokens.weight"), ("norm", "model.norm.weight"),
                                        ("LM head", "lm_head.weight")) if name in mine]
        for rp, b in zip(plan.ranks, nbytes):
            table.add_row(str(stage), str(rp.rank), str(stage * plan.tp_size + rp.rank),
                          _rng(plan.stage_layers(stage, layers)), ", ".join(ends) or "-", _rng(rp.q_heads),
                          _rng(rp.kv_heads), str(b), f"{b / 2**20:.2f}")
    console.print(table)
