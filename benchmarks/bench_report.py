"""Summaries and the rich table of :mod:`benchmarks.bench` (pure functions of the raw runs)."""

from __future__ import annotations

from benchmarks.machine import flags_text
from benchmarks.roofline import (
    ModelTensors,
    annotate,
    decode_bytes,
    float_precision,
    limits_cells,
    roofline_text,
    tpengine_precision,
)

SYSTEM_NAMES = {"hf": "HF generate"}


def _split(system: str) -> tuple[int, str | None]:
    """``(tp, quantization)`` of a system key ("tp2-int8" -> (2, "int8"), "tp1" -> (1, None))."""
    tp, _, quant = system.removeprefix("tp").partition("-")
    return int(tp), quant or None


def _name(system: str) -> str:
    if system in SYSTEM_NAMES:
        return SYSTEM_NAMES[system]
    tp, quant = _split(system)
    return f"tpengine tp={tp}" + (f" {quant}" if quant else "")


def summarize(runs: dict, latency_output_len: int) -> dict:
    """Per dtype and system, the best round: ``output_tok_s`` and ``total_tok_s`` (highest),
    ``ttft_ms`` and ``tpot_ms`` (lowest), ``threads`` (per rank), ``weight_bytes`` (per rank, when
    the worker reported them); plus, where HF ran, ``vs_hf`` (throughput ratio) and ``tpot_vs_hf``
    (TPOT ratio, < 1 is faster), and for tp > 1, ``tp_efficiency`` = its throughput / the tp=1
    throughput of the same weights (the same cores split over the ranks); for a quantized system
    ("tp1-int8", ...), ``tpot_vs_float`` and ``weights_vs_float`` = its TPOT and its largest rank's
    weight bytes / those of the same tp with float weights in the same dtype; for HF, ``attn`` and
    ``attn_latency`` = the attention implementation of its best throughput run and of its lowest
    TPOT. A system without throughput runs (a latency-only
    quantized row) has no throughput fields, ``vs_hf`` or ``tp_efficiency``."""
    out: dict = {}
    for dtype, systems in runs.items():
        rows = {}
        for s, r in systems.items():
            tpots = [(x["latency_s"] - x["ttft_s"]) / max(1, latency_output_len - 1) for x in r["latency"]]
            rows[s] = {"threads": r["threads"], "ttft_ms": round(min(x["ttft_s"] for x in r["latency"]) * 1e3, 3),
                       "tpot_ms": round(min(tpots) * 1e3, 3)}
            if r["throughput"]:  # (none for a latency-only row)
                best = max(r["throughput"], key=lambda x: x["output_tokens"] / x["elapsed_s"])
                rows[s].update({
                    "output_tok_s": round(best["output_tokens"] / best["elapsed_s"], 1),
                    "total_tok_s": round((best["output_tokens"] + best["prompt_tokens"]) / best["elapsed_s"], 1),
                    "elapsed_s": round(best["elapsed_s"], 4)})
                if "attn_implementation" in best:  # HF: the attention implementation it ran with
                    rows[s]["attn"] = best["attn_implementation"]
            fastest = r["latency"][tpots.index(min(tpots))] if r["latency"] else {}
            if "attn_implementation" in fastest:  # HF: that of its lowest TPOT
                rows[s]["attn_latency"] = fastest["attn_implementation"]
            if r.get("weight_bytes"):
                rows[s]["weight_bytes"] = r["weight_bytes"]
        hf = rows.get("hf")
        for s, row in rows.items():
            if hf and s != "hf":
                if "output_tok_s" in row and "output_tok_s" in hf:
                    row["vs_hf"] = round(row["output_tok_s"] / hf["output_tok_s"], 2)
                row["tpot_vs_hf"] = round(row["tpot_ms"] / hf["tpot_ms"], 2)
            if s == "hf":
                continue
            tp, quant = _split(s)
            tp1 = rows.get("tp1" + (f"-{quant}" if quant else ""))
            if tp1 and tp > 1 and "output_tok_s" in row and "output_tok_s" in tp1:
                row["tp_efficiency"] = round(row["output_tok_s"] / tp1["output_tok_s"], 2)
            plain = rows.get(f"tp{tp}")
            if quant and plain:
                row["tpot_vs_float"] = round(row["tpot_ms"] / plain["tpot_ms"], 2)
                if row.get("weight_bytes") and plain.get("weight_bytes"):
                    row["weights_vs_float"] = round(max(row["weight_bytes"]) / max(plain["weight_bytes"]), 3)
        out[dtype] = rows
    return out


def add_limits(results: dict, roofline: dict, tensors: ModelTensors, context: float, cores: int) -> None:
    """Add each row's roofline figures in place (:func:`benchmarks.roofline.annotate`: ``floor_bytes``,
    ``floor_ms``, ``tpot_vs_floor``, ``flops_fraction``): ``results`` per dtype and system as
    :func:`summarize` returns them; HF in its dtype, tpengine in its dtype and quantization
    (:func:`benchmarks.roofline.tpengine_precision`), a row at tp against the bandwidth of tp
    processes of ``cores`` / tp threads, the KV cache at ``context`` tokens."""
    for dtype, rows in results.items():
        for s, row in rows.items():
            tp, quant = (1, None) if s == "hf" else _split(s)
            p = float_precision(dtype) if s == "hf" else tpengine_precision(dtype, quant)
            annotate(row, roofline, tensors, decode_bytes(tensors, p, context), p.compute, tp, max(1, cores // tp))


def render_table(result: dict):
    """A ``rich.table.Table`` of ``result`` (the JSON :mod:`benchmarks.bench` writes)."""
    from rich.table import Table

    c, m = result["config"], result["machine"]
    has_hf = any("hf" in rows for rows in result["results"].values())
    flags = f" ({flags_text(m['cpu_flags'])})" if "cpu_flags" in m else ""
    table = Table(title=f"{c['model']}: {c['num_prompts']} x ({c['input_len']} in -> {c['output_len']} out) "
                        f"throughput; 1 x ({c['latency_input_len']} in -> {c['latency_output_len']} out) latency",
                  caption=f"{m['cpu']}{flags}, {m['cores']} cores, torch {m['torch']}, transformers "
                          f"{m['transformers']}; best of {c['rounds']} round(s), {result['total_s']} s in all"
                          + ("; HF attn_implementation in brackets" if has_hf else "")
                          + "; vs float: the same tp's TPOT / weight bytes with float weights"
                          + ("; floor: a decode step's bytes / the triad bandwidth, FLOPs: of the GEMM rate; "
                             + roofline_text(result["roofline"]) if result.get("roofline") else ""))
    for col in ("dtype", "system", "threads/rank", "weights MiB/rank", "output tok/s", "vs HF", "TP eff.",
                "TTFT ms", "TPOT ms", "TPOT vs HF", "TPOT / weights vs float", "floor ms", "TPOT / floor",
                "FLOPs"):
        table.add_column(col, justify="left" if col in ("dtype", "system") else "right")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for dtype, rows in result["results"].items():
        for s, r in rows.items():
            attn = [r[k] for k in ("attn", "attn_latency") if k in r]
            if len(attn) == 2 and attn[0] != attn[1]:
                attn = [f"{attn[0]}; TPOT {attn[1]}"]
            name = _name(s) + (f" ({attn[0]})" if attn else "")
            weights = "-" if not r.get("weight_bytes") else f"{max(r['weight_bytes']) / 2**20:.1f}"
            vs_float = "-" if "tpot_vs_float" not in r else (
                f"{r['tpot_vs_float']:.2f}x / " + fmt(r.get("weights_vs_float"), ".2f") + "x")
            table.add_row(dtype, name, "/".join(map(str, r["threads"])), weights, fmt(r.get("output_tok_s"), ".1f"),
                          fmt(r.get("vs_hf"), ".2f") + ("x" if "vs_hf" in r else ""),
                          fmt(r.get("tp_efficiency"), ".2f"), fmt(r["ttft_ms"], ".1f"), fmt(r["tpot_ms"], ".2f"),
                          fmt(r.get("tpot_vs_hf"), ".2f") + ("x" if "tpot_vs_hf" in r else ""), vs_float,
                          *limits_cells(r))
        table.add_section()
    return table
