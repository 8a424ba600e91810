"""Summary and table of :mod:`benchmarks.bench_scale` (pure functions of the workers' records)."""

from __future__ import annotations

import statistics

from tpengine.utils import GIB

#: Each rank's memory target: its weights + its KV cache + this much for everything else.
OVERHEAD_BYTES = GIB
SYSTEM_NAMES = {"hf": "HF generate", "tp1": "tpengine tp=1", "tp2": "tpengine tp=2",
                "tp1-shards": "tpengine tp=1, shards", "tp2-shards": "tpengine tp=2, shards"}


def summarize(record: dict) -> dict:
    """One system's result from its worker's ``@@bench`` record: ``status`` "ok", ``load_s``,
    ``ttft_ms`` / ``tpot_ms`` (mean over requests; ``*_median`` too), ``output_tok_s`` (all
    output tokens / wall time of the workload), ``elapsed_s``, ``output_tokens`` and per rank
    ``{"rank", "peak_rss_bytes", "load_peak_rss_bytes", "weight_bytes", "kv_bytes",
    "budget_bytes" (weights + KV + 1 GiB), "within_budget" (peak <= budget)}``."""
    ranks = []
    for r in sorted(record["ranks"], key=lambda r: r["rank"]):
        budget = r["weight_bytes"] + r["kv_bytes"] + OVERHEAD_BYTES
        peak = r["peak_rss_bytes"]
        ranks.append({**r, "budget_bytes": budget, "within_budget": None if peak is None else peak <= budget})
    ttft, tpot = record["ttft_s"], record["tpot_s"]
    out = {"status": "ok", "tp": record["tp"], "load_s": round(record["load_s"], 3),
           "ttft_ms": round(statistics.mean(ttft) * 1e3, 3), "ttft_ms_median": round(statistics.median(ttft) * 1e3, 3),
           "tpot_ms": round(statistics.mean(tpot) * 1e3, 3), "tpot_ms_median": round(statistics.median(tpot) * 1e3, 3),
           "output_tok_s": round(record["output_tokens"] / record["elapsed_s"], 2),
           "elapsed_s": round(record["elapsed_s"], 4), "output_tokens": record["output_tokens"],
           "prompt_tokens": record["prompt_tokens"], "warmup_s": round(record["warmup_s"], 3), "ranks": ranks}
    if "attn_implementation" in record:
        out["attn"] = record["attn_implementation"]
    return out


def render_table(result: dict):
    """A ``rich.table.Table`` of ``result`` (the JSON :mod:`benchmarks.bench_scale` writes): one
    row per rank, its peak resident memory beside its budget; speed columns on rank 0's row."""
    from rich.table import Table

    c, m = result["config"], result["machine"]
    table = Table(title=f"bench-scale: {c['requests']} x ({c['prompt_len']} in -> {c['output_len']} out), greedy, "
                        f"bfloat16; engine kv_cache_gb={c['kv_cache_gb']}, max_model_len={c['max_model_len']}",
                  caption=f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, torch {m['torch']}; "
                          f"peak = VmHWM per process; budget = weights + KV + 1 GiB per rank; "
                          f"{result['total_s']} s in all")
    for col in ("shape", "system", "rank", "peak GiB", "budget GiB", "peak<=budget", "load s", "TTFT ms",
                "TPOT ms", "output tok/s"):
        table.add_column(col, justify="left" if col in ("shape", "system") else "right")
    gib = lambda b: "-" if b is None else f"{b / GIB:.2f}"  # noqa: E731
    for shape, systems in result["results"].items():
        for s, r in systems.items():
            name = SYSTEM_NAMES.get(s, s) + (f" ({r['attn']})" if "attn" in r else "")
            if r["status"] != "ok":
                table.add_row(shape, name, "-", f"{r['status']}: {r['reason'].splitlines()[0][:120]}")
                continue
            for rk in r["ranks"]:
                first = rk["rank"] == 0
                ok = {True: "yes", False: "NO", None: "-"}[rk["within_budget"]]
                table.add_row(shape if first else "", name if first else "", str(rk["rank"]),
                              gib(rk["peak_rss_bytes"]), f"{gib(rk['weight_bytes'])} + {gib(rk['kv_bytes'])} + 1 = "
                              f"{gib(rk['budget_bytes'])}", ok,
                              f"{r['load_s']:.2f}" if first else "", f"{r['ttft_ms']:.1f}" if first else "",
                              f"{r['tpot_ms']:.2f}" if first else "", f"{r['output_tok_s']:.1f}" if first else "")
        table.add_section()
    return table
