"""Benchmark: speculative decoding off vs on, in one run (issues 39 and 59).

    python -m benchmarks.bench_spec --out bench-spec.json                (make bench-spec)
    python -m benchmarks.bench_spec --tp 1 --tp 2 --rounds 3
    python -m benchmarks.bench_spec --workload edit --no-draft           (the edit prompts alone)

For each ``--tp``, engines of the model (:mod:`benchmarks.bench_worker`, greedy, ``ignore_eos``), each
loaded once and measured in turn: ``off`` (no speculation), ``ngram`` (``--num-speculative-tokens`` k,
``--prompt-lookup-min`` / ``--prompt-lookup-max``; the engine's measured policy decides per batch size
and per request what to propose), and with ``--draft`` (default on) two draft-model engines proposing k
tokens at every step (``disable_by_batch_size`` 1: the mechanism's own cost, not the policy's choice):
``draft-self`` (the model as its own draft: every proposal right, the cost at its best) and
``draft-6l`` (its first 6 layers and its head, :mod:`benchmarks.truncate_model`: a weak draft).
Workloads (``--workload``, repeatable; default all; the draft engines run the batch-1 ones):

* **copy**: batch 1, each prompt of :data:`benchmarks.spec_prompts.TASKS` (rewrite a given code file or
  document with small edits) through the chat template, ``--copy-output-len`` tokens out: TPOT;
* **edit**: batch 1, each prompt of :data:`benchmarks.spec_prompts.EDIT_TASKS` (issue 59: work whose
  output repeats its prompt and itself but not verbatim: a table converted, a list continued with
  changed values, code with renamed names), ``--copy-output-len`` tokens out: TPOT;
* **random**: batch 1, a prompt of ``--random-len`` random token ids (nothing to copy),
  ``--random-output-len`` out: TPOT;
* **concurrent**: ``--num-concurrent`` random prompts of ``--random-len`` at once, ``--random-output-len``
  out each: output tokens/s.

TPOT = (latency - TTFT) / (output tokens - 1), vLLM's definition. Each round measures every batch-1
prompt on every engine back to back (the engines' order alternating between prompts and rounds, so
a shared machine's load falls on both sides alike), then the concurrent workload. Reported per
prompt and engine: its best TPOT, the speed against ``off`` (off's best / its best; and the median of
the rounds' paired ratios), its proposals' acceptance rate and mean acceptance length, whether its
tokens were ``off``'s in every round, and the prompt's **repeat share**: the share of its output
tokens that follow an earlier occurrence (prompt or output) of the two tokens before them as they did
there (:func:`repeat_share`; what any lookup could predict). Per workload: the mean over its prompts
(tokens/s for concurrent). Goals (n-gram; issues 39 and 59): every copy or edit prompt whose repeat
share is at least :data:`COPY_HEAVY` >= 2x, every prompt >= 0.95x, concurrent >= 0.95x.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from benchmarks import emit
from benchmarks.bench import Worker, cpu_cores, random_prompts, worker_args
from benchmarks.machine import machine_info, machine_line
from benchmarks.spec_prompts import EDIT_TASKS, TASKS
from tpengine.config import DEFAULT_MODEL_DIR

app = typer.Typer(add_completion=False)

WORKLOADS = ("copy", "edit", "random", "concurrent")
#: The speed each workload should reach with n-gram speculation (issues 39 and 59); a copy or edit
#: prompt's goal is the copy one when its repeat share is at least COPY_HEAVY, else NEVER_BELOW.
GOALS = {"copy": 2.0, "edit": 2.0, "random": 0.95, "concurrent": 0.95}
NEVER_BELOW = 0.95
COPY_HEAVY = 0.8


def tpot_s(res: dict, n: int) -> float:
    """TPOT (s) of a latency result of ``n`` output tokens."""
    return (res["latency_s"] - res["ttft_s"]) / (n - 1)


def acceptance(stats: list[dict]) -> tuple[float | None, float | None]:
    """(acceptance rate, mean acceptance length) over speculative counters ``stats``."""
    drafts = sum(s.get("spec_num_drafts", 0) for s in stats)
    proposed = sum(s.get("spec_num_draft_tokens", 0) for s in stats)
    accepted = sum(s.get("spec_num_accepted_tokens", 0) for s in stats)
    return (accepted / proposed if proposed else None), (1 + accepted / drafts if drafts else None)


def repeat_share(prompt: list[int], output: list[int]) -> float:
    """The share of ``output``'s tokens that follow an earlier occurrence of the two tokens before
    them (in ``prompt`` + ``output``) as they did there: the output that repeats earlier text."""
    ids, seen, hits = prompt + output, set(), 0
    for i in range(2, len(ids)):
        if i >= len(prompt) and tuple(ids[i - 2:i + 1]) in seen:
            hits += 1
        seen.add(tuple(ids[i - 2:i + 1]))
    return hits / len(output) if output else 0.0


def prompt_goal(workload: str, share: float) -> float:
    """A batch-1 prompt's n-gram speed goal: the copy goal for a copy-heavy one, else NEVER_BELOW."""
    return GOALS[workload] if workload in ("copy", "edit") and share >= COPY_HEAVY else NEVER_BELOW


def summarize_prompts(t: int, runs: dict, prompts: list[tuple[str, str, list[int]]], lens: dict) -> list[dict]:
    """The per-prompt rows of one tp size: per batch-1 prompt and engine, its best TPOT (ms), the
    speed against ``off`` (off's best / its best, and the median of the rounds' paired ratios), its
    acceptance, whether its tokens equal off's in every round, and the prompt's repeat share."""
    rows = []
    for workload, name, ids in prompts:
        key, n = f"{workload}/{name}", lens[workload]
        off = runs["off"]["latency"][key]
        share = repeat_share(ids, off[0]["token_ids"])
        for side, run in runs.items():
            xs = run["latency"][key]
            best = min(tpot_s(x, n) for x in xs) * 1000
            paired = [tpot_s(o, n) / tpot_s(x, n) for o, x in zip(off, xs)]
            rate, mean = acceptance([x["stats"] for x in xs]) if side != "off" else (None, None)
            rows.append({"tp": t, "workload": workload, "prompt": name, "engine": side, "tpot_ms": best,
                         "speed": None if side == "off" else min(tpot_s(x, n) for x in off) * 1000 / best,
                         "paired_speed": None if side == "off" else statistics.median(paired),
                         "acceptance_rate": rate, "mean_acceptance_length": mean, "repeat_share": share,
                         "same_tokens": all(x["token_ids"] == off[0]["token_ids"] for x in xs + off),
                         "goal": prompt_goal(workload, share) if side == "ngram" else None})
    return rows


def summarize(t: int, runs: dict, prompt_rows: list[dict]) -> list[dict]:
    """The workload rows of one tp size: per workload and engine, the mean of its prompts' best TPOT
    (ms; concurrent: the best output tok/s), the speed against ``off`` and its proposals' acceptance."""
    rows = []
    for workload in WORKLOADS:
        values, stats = {}, {}
        for side, run in runs.items():
            mine = [r for r in prompt_rows if r["workload"] == workload and r["engine"] == side]
            if mine:
                values[side] = sum(r["tpot_ms"] for r in mine) / len(mine)
                stats[side] = [x["stats"] for k, xs in run["latency"].items() if k.startswith(workload + "/")
                               for x in xs]
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


def measure(workers: dict, prompts: list[tuple[str, str, list[int]]], lens: dict, batch: list[list[int]] | None,
            rounds: int, t: int, console) -> dict:
    """``rounds`` alternating rounds on ``workers`` (side -> Worker): every batch-1 prompt on every
    side back to back (the order reversed every other prompt and round), then the concurrent batch
    (``batch``, None: not run) on the non-draft sides. Returns side -> {"latency": {workload/name:
    [results]}, "concurrent": [results]}."""
    sides = list(workers)
    runs = {side: {"latency": {f"{w}/{n}": [] for w, n, _ in prompts}, "concurrent": []} for side in sides}
    for r in range(rounds):
        for i, (workload, name, ids) in enumerate(prompts):
            key, n, ms = f"{workload}/{name}", lens[workload], {}
            for side in sides if (r + i) % 2 == 0 else sides[::-1]:
                res = workers[side].ask({"cmd": "latency", "prompt": ids, "output_len": n, "token_ids": True})
                runs[side]["latency"][key].append(res)
                ms[side] = tpot_s(res, n) * 1000
            console.print(f"  tp={t} round {r + 1} {key}: TPOT " + ", ".join(
                f"{side} {v:.1f} ms" + ("" if side == "off" else f" ({ms['off'] / v:.2f}x)") for side, v in ms.items()))
        if batch is None:
            continue
        for side in [s for s in (sides if r % 2 == 0 else sides[::-1]) if not s.startswith("draft")]:
            c = workers[side].ask({"cmd": "throughput", "prompts": batch, "output_len": lens["random"]})
            runs[side]["concurrent"].append(c)
            console.print(f"  tp={t} round {r + 1} concurrent {side}: {c['output_tokens'] / c['elapsed_s']:.1f} tok/s")
    return runs


@app.command()
def main(
    model: Annotated[str, typer.Option(help="HF model folder")] = DEFAULT_MODEL_DIR,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16")] = "bfloat16",
    tp: Annotated[list[int], typer.Option(help="tensor-parallel sizes; repeat for several")] = None,
    workload: Annotated[list[str], typer.Option(help="workloads to run (copy, edit, random, concurrent); "
                                                     "repeat for several; default all")] = None,
    num_speculative_tokens: Annotated[int, typer.Option(help="k: tokens proposed per step")] = 4,
    prompt_lookup_min: Annotated[int, typer.Option(help="shortest n-gram matched")] = 2,
    prompt_lookup_max: Annotated[int, typer.Option(help="longest n-gram matched")] = 4,
    copy_output_len: Annotated[int, typer.Option(help="copy and edit workloads: output tokens")] = 192,
    random_len: Annotated[int, typer.Option(help="random workloads: prompt tokens")] = 128,
    random_output_len: Annotated[int, typer.Option(help="random workloads: output tokens")] = 128,
    num_concurrent: Annotated[int, typer.Option(help="concurrent workload: requests at once")] = 32,
    rounds: Annotated[int, typer.Option(help="alternating rounds; the best one is reported")] = 2,
    draft: Annotated[bool, typer.Option(help="also the draft-model engines (the model itself, its first 6 "
                                             "layers)")] = True,
    threads: Annotated[int, typer.Option(help="total cores (0 = the affinity mask)")] = 0,
    out: Annotated[Path, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Speculative decoding off vs on: batch-1 TPOT per prompt on copy-heavy, edit-like and random
    prompts, and throughput of concurrent random prompts."""
    from rich.console import Console
    from transformers import AutoConfig, AutoTokenizer

    console = Console(stderr=True)
    if not console.is_terminal:  # a log file: the per-prompt table's columns unwrapped
        console.width = 160
    tps, cores, loads = tp or [1], threads or cpu_cores(), workload or list(WORKLOADS)
    if min(copy_output_len, random_output_len) < 2 or min(random_len, num_concurrent, rounds) < 1:
        raise typer.BadParameter("output lengths must be >= 2; prompt length, concurrency and rounds >= 1")
    if bad := [w for w in loads if w not in WORKLOADS]:
        raise typer.BadParameter(f"unknown workload(s) {bad}; valid: {', '.join(WORKLOADS)}")
    tok = AutoTokenizer.from_pretrained(model)
    chat = [(w, name, list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=True)["input_ids"]))
            for w, tasks in (("copy", TASKS), ("edit", EDIT_TASKS)) if w in loads for name, text in tasks]
    rand = random_prompts(num_concurrent + 1, random_len, vocab_size := AutoConfig.from_pretrained(model).vocab_size,
                          seed=1)
    prompts = chat + ([("random", "random", rand[0])] if "random" in loads else [])
    batch = rand[1:] if "concurrent" in loads else None
    lens = {"copy": copy_output_len, "edit": copy_output_len, "random": random_output_len}
    max_len = max([len(p) + lens[w] for w, _, p in prompts] + [random_len + random_output_len])
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
                       "prompt_lookup_min": prompt_lookup_min, "prompt_lookup_max": prompt_lookup_max})
    info = machine_info()
    console.print(f"machine: {machine_line(info)}; {dtype}, speculative config {spec}; vocabulary {vocab_size}")
    result = {"machine": info, "config": {"model": model, "dtype": dtype, "speculative_config": json.loads(spec),
                                          "workloads": loads, "copy_output_len": copy_output_len,
                                          "random_len": random_len, "random_output_len": random_output_len,
                                          "num_concurrent": num_concurrent, "rounds": rounds}, "runs": {}}
    sides, prompt_rows, rows = {"off": None, "ngram": spec}, [], []
    with tempfile.TemporaryDirectory(prefix="tpengine-bench-spec-") as logdir:
        if draft:
            from benchmarks.truncate_model import truncate

            weak = truncate(Path(model), 6, Path(logdir) / "draft-6l")
            for name, folder in (("draft-self", model), ("draft-6l", weak)):
                sides[name] = json.dumps({"model": str(folder), "num_speculative_tokens": num_speculative_tokens,
                                          "disable_by_batch_size": 1})
        for t in tps:
            workers = {}
            try:
                for side, cfg in sides.items():
                    extra = ("--speculative-config", cfg) if cfg else ()
                    args = worker_args(False, t, model, dtype, cores, num_concurrent, max_len, 0, "sdpa", extra)
                    workers[side] = Worker(f"tp{t}-{side}", args, t, Path(logdir) / f"tp{t}-{side}.log")
                    workers[side].ready = workers[side].read()  # one loads at a time
                runs = measure(workers, prompts, lens, batch, rounds, t, console)
            finally:
                for w in workers.values():
                    w.close()
            result["runs"][f"tp{t}"] = runs
            mine = summarize_prompts(t, runs, prompts, lens)
            prompt_rows += mine
            rows += summarize(t, runs, mine)
    result["prompts"], result["table"] = prompt_rows, rows
    console.print(prompt_table(prompt_rows, num_speculative_tokens, dtype))
    emit(console, workload_table(rows, num_speculative_tokens, dtype), result, out)


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def prompt_table(rows: list[dict], k: int, dtype: str):
    """The per-prompt rows as a rich table."""
    from rich.table import Table

    table = Table(title=f"speculative decoding per batch-1 prompt (k={k}), {dtype}")
    for col in ("tp", "workload", "prompt", "repeat share", "engine", "TPOT ms", "speed vs off", "paired",
                "goal", "acceptance", "mean accepted length", "same tokens"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["tp"]), r["workload"], r["prompt"], f"{r['repeat_share']:.2f}", r["engine"],
                      f"{r['tpot_ms']:.1f}", _f(r["speed"], ".2f") + ("x" if r["speed"] else ""),
                      _f(r["paired_speed"], ".2f") + ("x" if r["paired_speed"] else ""),
                      "-" if r["goal"] is None else f">= {r['goal']}x", _f(r["acceptance_rate"], ".3f"),
                      _f(r["mean_acceptance_length"], ".2f"), "yes" if r["same_tokens"] else "NO")
    return table


def workload_table(rows: list[dict], k: int, dtype: str):
    """The workload rows as a rich table."""
    from rich.table import Table

    table = Table(title=f"speculative decoding (k={k}), {dtype}")
    for col in ("tp", "workload", "metric", "engine", "value", "speed vs off", "goal", "acceptance",
                "mean accepted length"):
        table.add_column(col, justify="right")
    for row in rows:
        metric = "output tok/s" if row["workload"] == "concurrent" else "TPOT ms"
        goal = GOALS[row["workload"]] if row["engine"] == "ngram" else None
        table.add_row(str(row["tp"]), row["workload"], metric, row["engine"], f"{row['value']:.1f}",
                      _f(row["speed"], ".2f") + ("x" if row["speed"] else ""), "-" if goal is None else f">= {goal}x",
                      _f(row["acceptance_rate"], ".3f"), _f(row["mean_acceptance_length"], ".2f"))
    return table


if __name__ == "__main__":
    app()
