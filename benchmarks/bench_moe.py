"""``make bench-moe``: a mixture-of-experts model under tpengine (tp=1, tp=2, expert parallel at 2) beside HF
``generate``, and its dense-active twin's batch-1 TPOT (issue 56).

    python -m benchmarks.bench_moe --out bench-moe.json          (make bench-moe)
    python -m benchmarks.bench_moe --rounds 1 --num-prompts 16

The models are :mod:`benchmarks.moe_models`' (built under ``--models-dir`` on first use): a random-weight
Qwen3-MoE with SmolLM2-135M's shape, 16 experts of which 4 are routed per token, and the dense Qwen3 with
its active parameters. Every system runs in bfloat16 as :mod:`benchmarks.bench` runs its own, through the
same workers (:mod:`benchmarks.bench_worker`, one process or a torchrun group each, loaded once, warmed up,
then alternated round by round; best round reported):

* ``hf``: HF ``generate`` on the MoE (all cores; transformers' own MoE forward);
* ``tp1``, ``tp2``: tpengine on the MoE, every expert split over the ranks at tp=2;
* ``ep2``: tpengine on the MoE with ``--enable-expert-parallel`` at 2 ranks (8 whole experts each);
* ``dense``: tpengine tp=1 on the dense-active twin (latency only).

Throughput is vLLM's offline shape (``--num-prompts`` x ``--input-len`` -> ``--output-len``, greedy,
``ignore_eos``); latency one request (TTFT, TPOT = (latency - TTFT) / (tokens - 1)). Each row reports
its weight bytes per rank (``ModelRunner.weight_bytes``): EP=2 against TP=2 is the per-rank memory
the two layouts hold. The goals (:data:`GOALS`): the MoE's output tok/s at least 3x HF's, TP efficiency
(tp=2 or ep=2 throughput / tp=1) at least 0.85, the MoE's batch-1 TPOT at most 1.3x the dense-active
model's (a decode step reads only the routed experts).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks import emit
from benchmarks.bench import Worker, random_prompts, worker_args
from benchmarks.hf_system import HF_ATTN
from benchmarks.machine import cpu_cores, machine_info, machine_line
from benchmarks.moe_models import DENSE_NAME, EXPERT_INTERMEDIATE, MOE_NAME, NUM_EXPERTS, TOP_K, ensure_models

app = typer.Typer(add_completion=False)

DTYPE = "bfloat16"
#: system -> (model: "moe" or "dense", ranks, engine flags); "hf" is HF generate on the MoE
SYSTEMS = {"hf": ("moe", 1, ()), "tp1": ("moe", 1, ()), "tp2": ("moe", 2, ()),
           "ep2": ("moe", 2, ("--enable-expert-parallel",)), "dense": ("dense", 1, ())}
NAMES = {"hf": "HF generate (MoE)", "tp1": "tpengine tp=1", "tp2": "tpengine tp=2",
         "ep2": "tpengine EP=2 (--enable-expert-parallel)", "dense": "tpengine tp=1, dense-active Qwen3"}
#: the systems with latency runs only
LATENCY_ONLY = frozenset({"dense"})
#: issue 56's goals: (summary field, "min" or "max", bound)
GOALS = {"vs_hf": ("min", 3.0), "tp_efficiency": ("min", 0.85), "tpot_vs_dense": ("max", 1.3)}


def run_systems(args: dict[str, tuple[list[str], int]], prompts, lat_prompt, output_len: int, lat_output_len: int,
                rounds: int, per_round_attn: bool, logdir: Path, echo) -> dict:
    """Start each system of ``args`` (name -> (bench_worker arguments, ranks)), one after the other, then
    alternate the measurements round by round (even rounds in order, odd ones reversed; HF with
    ``per_round_attn`` runs :data:`HF_ATTN`'s implementations in turn). Returns ``{system: {"threads",
    "weight_bytes", "load_s", "throughput": [runs], "latency": [runs]}}``, as :func:`benchmarks.bench.run_dtype`.

    Raises:
        RuntimeError: a worker died (with its log's tail).
    """
    workers: dict[str, Worker] = {}
    try:
        for s, (a, tp) in args.items():
            workers[s] = w = Worker(s, a, tp, logdir / f"{s}.log")
            w.ready = w.read()
            echo(f"  {s}: loaded in {w.ready['load_s']:.1f} s")
        runs = {s: {"threads": w.ready["threads"], "weight_bytes": w.ready.get("weight_bytes"),
                    "load_s": w.ready["load_s"], "throughput": [], "latency": []} for s, w in workers.items()}
        order = list(workers)
        for r in range(rounds):
            systems = order if r % 2 == 0 else order[::-1]
            attn = {"attn": HF_ATTN[r % 2]} if per_round_attn else {}
            for s in [s for s in systems if s not in LATENCY_ONLY]:
                res = workers[s].ask({"cmd": "throughput", "prompts": prompts, "output_len": output_len,
                                      **(attn if s == "hf" else {})})
                runs[s]["throughput"].append(res)
                echo(f"  round {r + 1} {s:>5}: {res['output_tokens'] / res['elapsed_s']:8.1f} output tok/s "
                     f"({res['elapsed_s']:.1f} s)")
            for s in systems:
                res = workers[s].ask({"cmd": "latency", "prompt": lat_prompt, "output_len": lat_output_len,
                                      **(attn if s == "hf" else {})})
                runs[s]["latency"].append(res)
                tpot = (res["latency_s"] - res["ttft_s"]) / max(1, lat_output_len - 1)
                echo(f"  round {r + 1} {s:>5}: TTFT {res['ttft_s'] * 1e3:7.1f} ms, TPOT {tpot * 1e3:6.2f} ms")
        return runs
    finally:
        for w in workers.values():
            w.close()


def summarize(runs: dict, latency_output_len: int) -> dict:
    """Per system, its best round: ``output_tok_s`` (highest; none for a latency-only system),
    ``ttft_ms`` and ``tpot_ms`` (lowest), ``threads`` and ``weight_mib`` (per rank); and, against the
    others, ``vs_hf`` (throughput / HF's), ``tp_efficiency`` (tp2's and ep2's throughput / tp1's),
    ``tpot_vs_dense`` (TPOT / the dense-active model's) and ``tpot_vs_hf``."""
    rows: dict[str, dict] = {}
    for s, r in runs.items():
        tpots = [(x["latency_s"] - x["ttft_s"]) / max(1, latency_output_len - 1) for x in r["latency"]]
        row = {"threads": r["threads"], "ttft_ms": round(min(x["ttft_s"] for x in r["latency"]) * 1e3, 2),
               "tpot_ms": round(min(tpots) * 1e3, 3)}
        if r["throughput"]:
            row["output_tok_s"] = round(max(x["output_tokens"] / x["elapsed_s"] for x in r["throughput"]), 1)
        if r.get("weight_bytes"):
            row["weight_mib"] = [round(b / 2**20, 1) for b in r["weight_bytes"]]
        rows[s] = row
    hf, tp1, dense = rows.get("hf", {}), rows.get("tp1", {}), rows.get("dense", {})
    for s, row in rows.items():
        if s in ("hf", "dense"):
            continue
        if "output_tok_s" in row and "output_tok_s" in hf:
            row["vs_hf"] = round(row["output_tok_s"] / hf["output_tok_s"], 2)
        if hf:
            row["tpot_vs_hf"] = round(row["tpot_ms"] / hf["tpot_ms"], 2)
        if s != "tp1" and "output_tok_s" in row and "output_tok_s" in tp1:
            row["tp_efficiency"] = round(row["output_tok_s"] / tp1["output_tok_s"], 2)
        if dense:
            row["tpot_vs_dense"] = round(row["tpot_ms"] / dense["tpot_ms"], 2)
    return rows


def goals(rows: dict) -> list[dict]:
    """Each tpengine MoE row's figure against issue 56's :data:`GOALS`: ``{"system", "field", "value",
    "bound", "met"}``; the TPOT goal at tp=1, where the dense-active model runs."""
    out = []
    for s in ("tp1", "tp2", "ep2"):
        for field, (how, bound) in GOALS.items():
            value = rows.get(s, {}).get(field)
            if value is None or (field == "tpot_vs_dense" and s != "tp1"):
                continue
            out.append({"system": s, "field": field, "value": value, "bound": bound,
                        "met": value >= bound if how == "min" else value <= bound})
    return out


def render_table(result: dict):
    """A ``rich.table.Table`` of ``result`` (what :func:`main` writes)."""
    from rich.table import Table

    c, m = result["config"], result["machine"]
    table = Table(title=f"{c['model']} (bfloat16, {NUM_EXPERTS} experts, top {TOP_K}): {c['num_prompts']} x "
                        f"({c['input_len']} in -> {c['output_len']} out) throughput; 1 x ({c['latency_input_len']} "
                        f"in -> {c['latency_output_len']} out) latency",
                  caption=f"{machine_line(m)}; best of {c['rounds']} round(s), {result['total_s']} s in all")
    for col in ("system", "threads/rank", "weights MiB/rank", "output tok/s", "vs HF", "TP eff.", "TTFT ms",
                "TPOT ms", "TPOT vs HF", "TPOT vs dense"):
        table.add_column(col, justify="left" if col == "system" else "right")
    fmt = lambda v, spec, unit="": "-" if v is None else format(v, spec) + unit  # noqa: E731
    for s, r in result["results"].items():
        table.add_row(NAMES[s], "/".join(map(str, r["threads"])), "/".join(map(str, r.get("weight_mib", []))) or "-",
                      fmt(r.get("output_tok_s"), ".1f"), fmt(r.get("vs_hf"), ".2f", "x"),
                      fmt(r.get("tp_efficiency"), ".2f"), fmt(r["ttft_ms"], ".1f"), fmt(r["tpot_ms"], ".2f"),
                      fmt(r.get("tpot_vs_hf"), ".2f", "x"), fmt(r.get("tpot_vs_dense"), ".2f", "x"))
    return table


@app.command()
def main(
    models_dir: Annotated[Path, typer.Option(help="where the MoE and dense-active models are (built if missing)")]
    = Path("models"),
    num_prompts: Annotated[int, typer.Option(help="throughput: number of requests")] = 64,
    input_len: Annotated[int, typer.Option(help="throughput: prompt tokens per request")] = 128,
    output_len: Annotated[int, typer.Option(help="throughput: output tokens per request")] = 128,
    latency_input_len: Annotated[int, typer.Option(help="latency: prompt tokens")] = 128,
    latency_output_len: Annotated[int, typer.Option(help="latency: output tokens (>= 2)")] = 64,
    system: Annotated[list[str], typer.Option(help=f"repeat for several; default all: {', '.join(SYSTEMS)}")]
    = None,
    hf_attn: Annotated[str, typer.Option(help="HF attn_implementation: auto (sdpa and eager in turn over >= 2 "
                                              "rounds), sdpa, eager")] = "auto",
    rounds: Annotated[int, typer.Option(help="alternating rounds; the best one is reported")] = 2,
    threads: Annotated[int, typer.Option(help="total cores to use (0 = the affinity mask)")] = 0,
    seed: Annotated[int, typer.Option(help="seed of the random prompts")] = 0,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Throughput and latency of a MoE model under tpengine (tp=1, tp=2, EP=2) and HF generate, and the
    dense-active model's TPOT; prints a table and the goals."""
    from rich.console import Console

    console = Console(width=max(Console().width, 170))
    systems = system or list(SYSTEMS)
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise typer.BadParameter(f"--system {bad[0]!r} is not one of {', '.join(SYSTEMS)}")
    if latency_output_len < 2 or output_len < 1 or min(num_prompts, input_len, latency_input_len, rounds) < 1:
        raise typer.BadParameter("lengths, --num-prompts and --rounds must be >= 1 (--latency-output-len >= 2)")
    if hf_attn not in ("auto", *HF_ATTN):
        raise typer.BadParameter(f"--hf-attn {hf_attn!r} is not one of auto, {', '.join(HF_ATTN)}")
    moe, dense = ensure_models(models_dir)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(moe).vocab_size
    cores = threads or cpu_cores()
    prompts = random_prompts(num_prompts, input_len, vocab, seed)
    lat_prompt = random_prompts(1, latency_input_len, vocab, seed + 1)[0]
    max_len = max(input_len + output_len, latency_input_len + latency_output_len)
    per_round = hf_attn == "auto" and rounds >= 2
    args = {}
    for s in systems:
        model, tp, flags = SYSTEMS[s]
        args[s] = (worker_args(s == "hf", tp, str(moe if model == "moe" else dense), DTYPE, cores, num_prompts,
                               max_len, num_prompts, HF_ATTN[0] if per_round else hf_attn, engine_args=flags), tp)
    machine = machine_info()
    console.print(f"machine: {machine_line(machine)}")
    console.print(f"models: {moe} ({NUM_EXPERTS} experts of {EXPERT_INTERMEDIATE}, top {TOP_K}), {dense}; "
                  f"starting {', '.join(systems)}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tpengine-bench-moe-") as logdir:
        runs = run_systems(args, prompts, lat_prompt, output_len, latency_output_len, rounds, per_round,
                           Path(logdir), console.print)
    rows = summarize(runs, latency_output_len)
    result = {
        "config": {"model": MOE_NAME, "dense_model": DENSE_NAME, "models_dir": str(models_dir), "dtype": DTYPE,
                   "num_experts": NUM_EXPERTS, "top_k": TOP_K, "expert_intermediate": EXPERT_INTERMEDIATE,
                   "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
                   "latency_input_len": latency_input_len, "latency_output_len": latency_output_len,
                   "systems": systems, "rounds": rounds, "seed": seed, "cores": cores, "hf_attn": hf_attn},
        "machine": machine, "results": rows, "goals": goals(rows), "runs": runs,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    emit(console, render_table(result), result, out)
    for g in result["goals"]:
        how = ">=" if GOALS[g["field"]][0] == "min" else "<="
        console.print(f"goal {g['system']} {g['field']} {how} {g['bound']}: {g['value']} "
                      f"({'met' if g['met'] else 'not met'})")


if __name__ == "__main__":
    app()
