"""Benchmark: speculative decoding off vs on, in one run (issue 39).

    python -m benchmarks.bench_spec --out bench-spec.json                (make bench-spec)
    python -m benchmarks.bench_spec --tp 1 --tp 2 --rounds 3

For each ``--tp``, engines of the model (:mod:`benchmarks.bench_worker`, greedy, ``ignore_eos``), each
loaded once and measured in turn: ``off`` (no speculation), ``ngram`` (``--num-speculative-tokens`` k,
``--prompt-lookup-min`` / ``--prompt-lookup-max``; the engine's measured policy decides per batch size
whether proposing pays), and with ``--draft`` (default on) two draft-model engines proposing k tokens at
every step (``disable_by_batch_size`` 1: the mechanism's own cost, not the policy's choice):
``draft-self`` (the model as its own draft: every proposal right, the cost at its best) and
``draft-6l`` (its first 6 layers and its head, :mod:`benchmarks.truncate_model`: a weak draft).
Workloads (the draft engines run the two batch-1 ones):

* **copy**: batch 1, each prompt of :mod:`benchmarks.spec_prompts` (rewrite a given code file or
  document with small edits) through the chat template, ``--copy-output-len`` tokens out: TPOT;
* **random**: batch 1, a prompt of ``--random-len`` random token ids (nothing to copy),
  ``--random-output-len`` out: TPOT;
* **concurrent**: ``--num-concurrent`` random prompts of ``--random-len`` at once, ``--random-output-len``
  out each: output tokens/s.

TPOT = (latency - TTFT) / (output tokens - 1), vLLM's definition. Rounds alternate the two engines'
order; each cell is the best round. Reported per engine and workload: the value, the speed against
``off`` (off / it for TPOT, it / off for tokens/s; above 1 = speculation faster), and the acceptance
rate and mean acceptance length of its proposals. Issue 39's goals (n-gram): copy >= 2x, random >=
0.95x, concurrent >= 0.95x.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from benchmarks import emit
from benchmarks.bench import Worker, cpu_cores, random_prompts, worker_args
from benchmarks.machine import machine_info, machine_line
from benchmarks.spec_prompts import TASKS
from tpengine.config import DEFAULT_MODEL_DIR

app = typer.Typer(add_completion=False)

#: The speed each workload should reach with speculation (issue 39).
GOALS = {"copy": 2.0, "random": 0.95, "concurrent": 0.95}


def tpot_s(res: dict, n: int) -> float:
    """TPOT (s) of a latency result of ``n`` output tokens."""
    return (res["latency_s"] - res["ttft_s"]) / (n - 1)


def acceptance(stats: list[dict]) -> tuple[float | None, float | None]:
    """(acceptance rate, mean acceptance length) over speculative counters ``stats``."""
    drafts = sum(s.get("spec_num_drafts", 0) for s in stats)
    proposed = sum(s.get("spec_num_draft_tokens", 0) for s in stats)
    accepted = sum(s.get("spec_num_accepted_tokens", 0) for s in stats)
    return (accepted / proposed if proposed else None), (1 + accepted / drafts if drafts else None)


def summarize(t: int, runs: dict, copy_names: list[str], copy_len: int, random_len: int) -> list[dict]:
    """The table rows of one tp size: per workload and engine, its best value (copy: the mean over the
    prompts of each one's best TPOT, ms; random: best TPOT, ms; concurrent: best output tok/s), the speed
    against ``off`` and its proposals' acceptance."""
    def best_tpot(xs: list[dict], n: int) -> float:
        return min(tpot_s(x, n) for x in xs) * 1000

    rows = []
    for workload in ("copy", "random", "concurrent"):
        values, stats = {}, {}
        for side, run in runs.items():
            if workload == "copy":
                values[side] = sum(best_tpot(run["copy"][n], copy_len) for n in copy_names) / len(copy_names)
                stats[side] = [x["stats"] for n in copy_names for x in run["copy"][n]]
            elif workload == "random":
                values[side] = best_tpot(run["random"], random_len)
                stats[side] = [x["stats"] for x in run["random"]]
            elif run["concurrent"]:
                values[side] = max(x["output_tokens"] / x["elapsed_s"] for x in run["concurrent"])
                stats[side] = [x["stats"] for x in run["concurrent"]]
        for side, value in values.items():
            speed = None if side == "off" else (value / values["off"] if workload == "concurrent"
                                                else values["off"] / value)
            rate, mean = acceptance(stats[side]) if side != "off" else (None, None)
            rows.append({"tp": t, "workload": workload, "engine": side, "value": value, "speed": speed,
                         "acceptance_rate": rate, "mean_acceptance_length": mean})
    return rows


@app.command()
def main(
    model: Annotated[str, typer.Option(help="HF model folder")] = DEFAULT_MODEL_DIR,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16")] = "bfloat16",
    tp: Annotated[list[int], typer.Option(help="tensor-parallel sizes; repeat for several")] = None,
    num_speculative_tokens: Annotated[int, typer.Option(help="k: tokens proposed per step")] = 4,
    prompt_lookup_min: Annotated[int, typer.Option(help="shortest n-gram matched")] = 2,
    prompt_lookup_max: Annotated[int, typer.Option(help="longest n-gram matched")] = 4,
    copy_output_len: Annotated[int, typer.Option(help="copy workload: output tokens")] = 192,
    random_len: Annotated[int, typer.Option(help="random workloads: prompt tokens")] = 128,
    random_output_len: Annotated[int, typer.Option(help="random workloads: output tokens")] = 128,
    num_concurrent: Annotated[int, typer.Option(help="concurrent workload: requests at once")] = 32,
    rounds: Annotated[int, typer.Option(help="alternating rounds; the best one is reported")] = 2,
    draft: Annotated[bool, typer.Option(help="also the draft-model engines (the model itself, its first 6 "
                                             "layers)")] = True,
    threads: Annotated[int, typer.Option(help="total cores (0 = the affinity mask)")] = 0,
    out: Annotated[Path, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Speculative decoding off vs on: batch-1 TPOT on copy-heavy and random prompts, and throughput
    of concurrent random prompts."""
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoConfig, AutoTokenizer

    console = Console(stderr=True)
    tps, cores = tp or [1], threads or cpu_cores()
    if min(copy_output_len, random_output_len) < 2 or min(random_len, num_concurrent, rounds) < 1:
        raise typer.BadParameter("output lengths must be >= 2; prompt length, concurrency and rounds >= 1")
    tok = AutoTokenizer.from_pretrained(model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    copies = [(name, list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True)["input_ids"])) for name, text in TASKS]
    rand = random_prompts(num_concurrent + 1, random_len, vocab, seed=1)
    single, batch = rand[0], rand[1:]
    max_len = max(max(len(p) for _, p in copies) + copy_output_len, random_len + random_output_len)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
                       "prompt_lookup_min": prompt_lookup_min, "prompt_lookup_max": prompt_lookup_max})
    info = machine_info()
    console.print(f"machine: {machine_line(info)}; {dtype}, speculative config {spec}")
    result = {"machine": info, "config": {"model": model, "dtype": dtype, "speculative_config": json.loads(spec),
                                          "copy_output_len": copy_output_len, "random_len": random_len,
                                          "random_output_len": random_output_len, "num_concurrent": num_concurrent,
                                          "rounds": rounds}, "runs": {}}
    k = num_speculative_tokens
    sides = {"off": None, "ngram": spec}
    rows = []
    with tempfile.TemporaryDirectory(prefix="tpengine-bench-spec-") as logdir:
        if draft:
            from benchmarks.truncate_model import truncate

            weak = truncate(Path(model), 6, Path(logdir) / "draft-6l")
            for name, folder in (("draft-self", model), ("draft-6l", weak)):
                sides[name] = json.dumps({"model": str(folder), "num_speculative_tokens": k,
                                          "disable_by_batch_size": 1})
        for t in tps:
            workers = {}
            try:
                for side, cfg in sides.items():
                    extra = ("--speculative-config", cfg) if cfg else ()
                    args = worker_args(False, t, model, dtype, cores, num_concurrent, max_len, 0, "sdpa", extra)
                    workers[side] = Worker(f"tp{t}-{side}", args, t, Path(logdir) / f"tp{t}-{side}.log")
                    workers[side].ready = workers[side].read()  # one loads at a time
                runs = {side: {"copy": {n: [] for n, _ in copies}, "random": [], "concurrent": []} for side in workers}
                for r in range(rounds):
                    for side in list(workers) if r % 2 == 0 else list(workers)[::-1]:
                        w, run = workers[side], runs[side]
                        for name, prompt in copies:
                            run["copy"][name].append(w.ask({"cmd": "latency", "prompt": prompt,
                                                            "output_len": copy_output_len}))
                        run["random"].append(w.ask({"cmd": "latency", "prompt": single,
                                                    "output_len": random_output_len}))
                        line = ""
                        if not side.startswith("draft"):
                            run["concurrent"].append(w.ask({"cmd": "throughput", "prompts": batch,
                                                            "output_len": random_output_len}))
                            c = run["concurrent"][-1]
                            line = f", concurrent {c['output_tokens'] / c['elapsed_s']:.1f} tok/s"
                        copy_ms = [tpot_s(run["copy"][n][-1], copy_output_len) * 1000 for n, _ in copies]
                        console.print(f"  tp={t} round {r + 1} {side:>10}: copy TPOT "
                                      + "/".join(f"{x:.1f}" for x in copy_ms) + " ms, random TPOT "
                                      f"{tpot_s(run['random'][-1], random_output_len) * 1000:.1f} ms" + line)
            finally:
                for w in workers.values():
                    w.close()
            result["runs"][f"tp{t}"] = runs
            rows += summarize(t, runs, [n for n, _ in copies], copy_output_len, random_output_len)
    result["table"] = rows
    table = Table(title=f"speculative decoding (k={k}), {dtype}")
    for col in ("tp", "workload", "metric", "engine", "value", "speed vs off", "goal", "acceptance",
                "mean accepted length"):
        table.add_column(col, justify="right")
    for row in rows:
        metric = "output tok/s" if row["workload"] == "concurrent" else "TPOT ms"
        rate, mean = row["acceptance_rate"], row["mean_acceptance_length"]
        goal = GOALS[row["workload"]] if row["engine"] == "ngram" else None
        table.add_row(str(row["tp"]), row["workload"], metric, row["engine"], f"{row['value']:.1f}",
                      "-" if row["speed"] is None else f"{row['speed']:.2f}x", "-" if goal is None else f">= {goal}x",
                      "-" if rate is None else f"{rate:.3f}", "-" if mean is None else f"{mean:.2f}")
    emit(console, table, result, out)


if __name__ == "__main__":
    app()
