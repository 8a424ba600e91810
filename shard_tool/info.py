"""``tpengine-shard info MODEL_DIR [--tp N]``: print the ShardPlan of a config (no weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from shard_tool.common import UserError, read_model_config, user_errors
from tpengine.config import DTYPE_BYTES
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


def weight_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Full shape of every checkpoint tensor, from a meta-device model built from ``config``
    (no weights read or allocated). A tied lm_head.weight is left out, as split does."""
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
    padded, a scale and a zero for each half, :class:`~tpengine.model.quant.weights.Int8Weight`)."""
    from tpengine.model.surgery import kind_in

    out = []
    for r in range(plan.tp_size):
        total = 0
        for name, shape in shapes.items():
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
) -> None:
    """Print the ShardPlan as a table (ranges are half-open start:end), or the valid TP sizes; for a
    quantized folder, its quantization and the quantized weight bytes."""
    from rich.console import Console
    from rich.table import Table

    from tpengine.model.plan import ShardPlan

    console = Console(width=200) if not Console().is_terminal else Console()
    with user_errors():
        if dtype is not None and dtype not in DTYPE_BYTES:
            raise UserError(f"invalid dtype {dtype!r}: must be one of {', '.join(DTYPE_BYTES)}")
        config = load_config(model_dir)
        check_config(config)  # a model type or feature the engine would refuse, refused here too
        d = ShardPlan.dims(config)
        if tp is not None:
            plan = ShardPlan.build(config, tp)  # ValueError names the head count and tp
        dtype = dtype or config_dtype(config)
        shapes = weight_shapes(config)
        from tpengine.model.quant.checkpoint import describe_table, read_table

        quantized = read_table(model_dir)  # UserError: a broken quantization table
    console.print(
        f"{getattr(config, 'model_type', '?')}: {d['num_heads']} query heads, {d['num_kv_heads']} KV heads, "
        f"head_dim {d['head_dim']}, hidden {d['hidden_size']}, intermediate {d['intermediate_size']}, "
        f"vocab {d['vocab_size']}, {getattr(config, 'num_hidden_layers', '?')} layers, dtype {dtype}"
    )
    if quantized:
        console.print(f"quantized: {describe_table(quantized)} (the rest {dtype})")
    if tp is None:
        table = Table("tp", "q heads/rank", "kv heads/rank", "padded vocab", "max MiB/rank", box=None)
        for size in ShardPlan.valid_tp_sizes(config):
            p = ShardPlan.build(config, size)
            try:
                mib = f"{max(rank_bytes(p, shapes, dtype, quantized)) / 2**20:.2f}"
            except UserError:  # a row split off the quantization's group boundaries
                mib = "cuts groups"
            table.add_row(
                str(size),
                ",".join(str(rp.num_q_heads) for rp in p.ranks),
                ",".join(str(rp.num_kv_heads) for rp in p.ranks),
                str(p.padded_vocab_size),
                mib,
            )
        console.print(f"valid TP sizes: 1..{d['num_heads']}")
        console.print(table)
        return
    with user_errors():
        nbytes = rank_bytes(plan, shapes, dtype, quantized)
    table = Table(
        "rank", "q heads", "#q", "kv heads", "#kv", "q->kv (local)", "intermediate", "vocab",
        "weight bytes", "MiB", box=None, title=f"tp={tp}, padded vocab {plan.padded_vocab_size}",
    )
    for rp, b in zip(plan.ranks, nbytes):
        table.add_row(
            str(rp.rank), _rng(rp.q_heads), str(rp.num_q_heads), _rng(rp.kv_heads), str(rp.num_kv_heads),
            ",".join(map(str, rp.q_to_kv)), _rng(rp.intermediate), _rng(rp.vocab), str(b), f"{b / 2**20:.2f}",
        )
    console.print(table)
    from tpengine.model.estimate import estimate

    mem = estimate(plan, nbytes, int(config.num_hidden_layers), DTYPE_BYTES[dtype], kv_cache_gb, block_size,
                   max_num_batched_tokens, max_num_seqs)
    est = Table("rank", "weights GiB", "KV cache GiB", "runtime GiB", "total GiB", box=None,
                title=f"estimated peak memory per rank (kv_cache_gb {kv_cache_gb}, {max_num_batched_tokens}-token "
                      f"steps, {max_num_seqs} seqs)")
    for m in mem:
        est.add_row(str(m.rank), *(f"{x / 2**30:.2f}" for x in (m.weights, m.kv_cache, m.runtime, m.total)))
    console.print(est)
