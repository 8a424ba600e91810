"""Benchmark: the shared-prefix workload, tpengine with prefix caching on and off against HF ``generate``.

    python -m benchmarks.prefix_cache --out bench-prefix.json           (make bench-prefix)
    python -m benchmarks.prefix_cache --tp 1 --tp 2 --rounds 3

``--num-prompts`` requests, each the same ``--doc-len``-token "document" (random token ids, fixed
seed) followed by its own ``--question-len``-token question (random ids), ``--output-len`` tokens
out each (``ignore_eos`` / ``min_new_tokens``), greedy: the workload automatic prefix caching is
for (many questions about one document, a shared system prompt). Systems, each loaded once in its
own process(es) (:mod:`benchmarks.bench_worker`) and measured in turn: HF generate (one static
batch of all prompts unless ``--hf-batch-size``), and for each ``--tp`` tpengine with
``enable_prefix_caching`` on and off. Every engine command starts from an empty prefix cache, so
rounds measure the same work; with ``--rounds`` > 1 the order alternates and the table shows each
system's best round (highest output tokens/s), the JSON keeps every run.

Reported per system: output tokens/s (all output tokens / wall time), mean and p50 TTFT over the
requests (engine: each request's arrival to its first token; HF: the run's start to its batch's
first token), the prefix-cache hit rate (cached prompt tokens / prompt tokens, from the engine's
stats), the wall time, and on each caching-on row its throughput / the caching-off throughput.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks import emit
from benchmarks.bench import Worker, cpu_cores, machine_info, random_prompts, worker_args
from tpengine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MODEL_DIR

app = typer.Typer(add_completion=False)


def shared_prefix_prompts(num_prompts: int, doc_len: int, question_len: int, vocab: int,
                          seed: int) -> list[list[int]]:
    """``num_prompts`` prompts of ``doc_len + question_len`` token ids in ``[0, vocab)``: one document
    (seed ``seed``) shared by all, then a distinct question each (seed ``seed + 1``)."""
    doc = random_prompts(1, doc_len, vocab, seed)[0]
    return [doc + q for q in random_prompts(num_prompts, question_len, vocab, seed + 1)]


def system_name(system: str) -> str:
    """Table label of ``system`` ("hf", "tp1-cache", "tp1-nocache", ...)."""
    if system == "hf":
        return "HF generate"
    tp, mode = system.removeprefix("tp").split("-")
    return f"tpengine tp={tp}, cache {'on' if mode == 'cache' else 'off'}"


def summarize(runs: dict) -> dict:
    """Per system, its best round (highest output tokens/s): ``output_tok_s``, ``ttft_mean_ms``,
    ``ttft_p50_ms``, ``hit_rate`` (engine; None for HF), ``cached_prompt_tokens`` (engine),
    ``elapsed_s``, ``output_tokens``; on each caching-on row ``vs_no_cache`` = its output tokens/s
    / the same tp's caching-off output tokens/s."""
    rows = {}
    for s, r in runs.items():
        best = max(r["throughput"], key=lambda x: x["output_tokens"] / x["elapsed_s"])
        stats = best.get("stats")
        rows[s] = {"threads": r["threads"], "output_tok_s": round(best["output_tokens"] / best["elapsed_s"], 1),
                   "ttft_mean_ms": round(statistics.fmean(best["ttft_s"]) * 1e3, 3),
                   "ttft_p50_ms": round(statistics.median(best["ttft_s"]) * 1e3, 3),
                   "hit_rate": None if stats is None else round(stats["prefix_cache_hit_rate"], 4),
                   "cached_prompt_tokens": None if stats is None else stats["cached_prompt_tokens"],
                   "elapsed_s": round(best["elapsed_s"], 4), "output_tokens": best["output_tokens"]}
    for s, row in rows.items():
        off = rows.get(s.replace("-cache", "-nocache")) if s.endswith("-cache") else None
        if off:
            row["vs_no_cache"] = round(row["output_tok_s"] / off["output_tok_s"], 2)
    return rows


def render_table(result: dict):
    """A ``rich.table.Table`` of ``result`` (the JSON this benchmark writes)."""
    from rich.table import Table

    c, m = result["config"], result["machine"]
    table = Table(title=f"{c['model']} ({c['dtype']}): {c['num_prompts']} x ({c['doc_len']}-token shared document + "
                        f"{c['question_len']}-token question -> {c['output_len']} out)",
                  caption=f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}; best of {c['rounds']} round(s), "
                          f"max_num_batched_tokens {c['max_num_batched_tokens']}, {result['total_s']} s in all")
    for col in ("system", "threads/rank", "output tok/s", "on / off", "TTFT mean ms", "TTFT p50 ms",
                "hit rate", "wall s"):
        table.add_column(col, justify="left" if col == "system" else "right")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for s, r in result["results"].items():
        table.add_row(system_name(s), "/".join(map(str, r["threads"])), fmt(r["output_tok_s"], ".1f"),
                      fmt(r.get("vs_no_cache"), ".2f") + ("x" if "vs_no_cache" in r else ""),
                      fmt(r["ttft_mean_ms"], ".1f"), fmt(r["ttft_p50_ms"], ".1f"), fmt(r["hit_rate"], ".3f"),
                      fmt(r["elapsed_s"], ".2f"))
    return table


def run_systems(systems: list[str], model: str, dtype: str, cores: int, prompts: list[list[int]], output_len: int,
                rounds: int, hf_batch_size: int, hf_attn: str, max_num_batched_tokens: int, logdir: Path,
                echo) -> dict:
    """Start every system (loading in parallel), alternate the throughput runs, return
    ``{system: {"threads", "load_s", "throughput": [runs]}}``."""
    max_len = max(map(len, prompts)) + output_len
    workers: dict[str, Worker] = {}
    try:
        for s in systems:
            tp_s, _, mode = s.removeprefix("tp").partition("-")  # "hf", "tp1-cache", "tp2-nocache", ...
            tp = 1 if s == "hf" else int(tp_s)
            engine = ("--max-num-batched-tokens", str(max_num_batched_tokens),
                      "--enable-prefix-caching" if mode == "cache" else "--no-enable-prefix-caching")
            args = worker_args(s == "hf", tp, model, dtype, cores, len(prompts), max_len, hf_batch_size, hf_attn,
                               engine)  # blocks for all at once, even without sharing
            workers[s] = Worker(s, args, tp, logdir / f"{s}.log")
        runs = {}
        for s, w in workers.items():
            w.ready = w.read()
            runs[s] = {"threads": w.ready["threads"], "load_s": w.ready["load_s"], "throughput": []}
        for r in range(rounds):
            for s in systems if r % 2 == 0 else systems[::-1]:
                res = workers[s].ask({"cmd": "throughput", "prompts": prompts, "output_len": output_len})
                runs[s]["throughput"].append(res)
                hit = res.get("stats", {}).get("prefix_cache_hit_rate")
                echo(f"  round {r + 1} {s:>12}: {res['output_tokens'] / res['elapsed_s']:8.1f} output tok/s "
                     f"({res['elapsed_s']:.1f} s" + ("" if hit is None else f", hit rate {hit:.3f}") + ")")
        return runs
    finally:
        for w in workers.values():
            w.close()


@app.command()
def main(
    model: Annotated[str, typer.Option(help="HF model folder")] = DEFAULT_MODEL_DIR,
    num_prompts: Annotated[int, typer.Option(help="number of requests")] = 64,
    doc_len: Annotated[int, typer.Option(help="tokens of the document every prompt starts with")] = 1024,
    question_len: Annotated[int, typer.Option(help="tokens of each prompt's own question")] = 16,
    output_len: Annotated[int, typer.Option(help="output tokens per request")] = 64,
    dtype: Annotated[str, typer.Option(help="weights and KV cache: float32, bfloat16, float16")] = "float32",
    tp: Annotated[list[int], typer.Option(help="tpengine tensor-parallel sizes; repeat for several")] = None,
    hf: Annotated[bool, typer.Option(help="include the HF generate baseline")] = True,
    hf_batch_size: Annotated[int, typer.Option(help="HF static batch size (0 = all prompts)")] = 0,
    hf_attn: Annotated[str, typer.Option(help="HF attn_implementation: auto, sdpa, eager")] = "auto",
    max_num_batched_tokens: Annotated[int, typer.Option(help="engine tokens per step")] = \
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
    rounds: Annotated[int, typer.Option(help="alternating rounds; the best one is reported")] = 1,
    threads: Annotated[int, typer.Option(help="total cores to use (0 = the affinity mask)")] = 0,
    seed: Annotated[int, typer.Option(help="seed of the document (the questions: seed + 1)")] = 0,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Shared-prefix throughput and TTFT of tpengine with prefix caching on and off, and of HF generate."""
    from rich.console import Console

    console = Console(width=max(Console().width, 120))
    tps = tp or [1]
    if min(num_prompts, doc_len, question_len, output_len, rounds, max_num_batched_tokens) < 1:
        raise typer.BadParameter("--num-prompts, --doc-len, --question-len, --output-len, --rounds and "
                                 "--max-num-batched-tokens must be >= 1")
    if hf_attn not in ("auto", "sdpa", "eager"):
        raise typer.BadParameter(f"--hf-attn {hf_attn!r} is not one of auto, sdpa, eager")
    from transformers import AutoConfig

    from tpengine.config import WEIGHT_DTYPES
    from tpengine.model.plan import ShardPlan

    if dtype not in WEIGHT_DTYPES:
        raise typer.BadParameter(f"--dtype {dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    try:
        hf_config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(f"--model {model!r}: cannot read its config.json ({e})") from None
    for t in tps:
        try:
            ShardPlan.build(hf_config, t)
        except ValueError as e:
            raise typer.BadParameter(f"--tp {t}: {e}") from None
    limit = getattr(hf_config, "max_position_embeddings", None)
    total = doc_len + question_len + output_len
    if limit is not None and total > limit:
        raise typer.BadParameter(f"--doc-len {doc_len} + --question-len {question_len} + --output-len {output_len} "
                                 f"= {total} exceeds the model's max_position_embeddings {limit}")
    cores = threads or cpu_cores()
    prompts = shared_prefix_prompts(num_prompts, doc_len, question_len, hf_config.vocab_size, seed)
    systems = (["hf"] if hf else []) + [f"tp{t}-{m}" for t in tps for m in ("cache", "nocache")]
    t0 = time.perf_counter()
    console.print(f"[bold]{dtype}[/]: starting {', '.join(systems)}")
    with tempfile.TemporaryDirectory(prefix="tpengine-bench-prefix-") as logdir:
        runs = run_systems(systems, model, dtype, cores, prompts, output_len, rounds, hf_batch_size or num_prompts,
                           hf_attn, max_num_batched_tokens, Path(logdir), console.print)
    result = {
        "config": {"model": model, "num_prompts": num_prompts, "doc_len": doc_len, "question_len": question_len,
                   "output_len": output_len, "dtype": dtype, "tp": tps, "rounds": rounds, "seed": seed,
                   "cores": cores, "hf_batch_size": hf_batch_size or num_prompts, "hf_attn": hf_attn,
                   "max_num_batched_tokens": max_num_batched_tokens, "block_size": 16},
        "machine": machine_info(),
        "results": summarize(runs),
        "runs": runs,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    emit(console, render_table(result), result, out)


if __name__ == "__main__":
    app()
