"""Benchmark: data parallel against tensor parallel on the same cores (``make bench-dp``).

    python -m benchmarks.bench_dp --out bench-dp.json
    python -m benchmarks.bench_dp --dtype float32 --num-prompts 32 --rounds 1

Three layouts of the same cores, each one batch job (``tpengine run``, the launch a user runs:
``torchrun`` at 2 ranks) with ``--summary-json``:

* ``D1xT1``: one process with every core's thread;
* ``D1xT2``: one replica of tp=2 (cores / 2 threads per rank);
* ``D2xT1``: two replicas of tp=1 (cores / 2 threads each), the requests routed between them.

Two workloads: ``make bench``'s throughput one (``--num-prompts`` random prompts of ``--input-len``
token ids, exactly ``--output-len`` out, greedy): output tok/s (output tokens / the job's wall time
after the load) and TTFT p50; and ``make bench``'s prefix-cache one (``--prefix-prompts`` prompts of
one ``--doc-len``-token document + a 32-token question, ``--prefix-output-len`` out): the prefix-cache
hit rate, which shows whether the router keeps a shared prefix on the replicas that hold it. With
``--rounds`` > 1 each round runs the layouts in the opposite order of the previous one and the table
shows the best round. The output names the CPU (:mod:`benchmarks.machine`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks import emit, subprocess_env
from benchmarks.bench import random_prompts
from benchmarks.machine import cpu_cores, machine_info, machine_line
from benchmarks.prefix_cache import shared_prefix_prompts
from tpengine.config import DEFAULT_MODEL_DIR

app = typer.Typer(add_completion=False)

#: layout -> (ranks, the flags of that layout)
LAYOUTS = {"D1xT1": (1, []), "D1xT2": (2, ["--tensor-parallel-size", "2"]), "D2xT1": (2, ["--data-parallel-size", "2"])}


def run_job(layout: str, prompts: list[list[int]], output_len: int, model: str, dtype: str, cores: int,
            tmp: Path) -> dict:
    """One job of ``layout`` over ``prompts`` (greedy, exactly ``output_len`` tokens each); its summary.

    Raises:
        RuntimeError: the job failed (with its log's tail).
    """
    ranks, flags = LAYOUTS[layout]
    lines = tmp / f"{layout}-in.jsonl"
    lines.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": p, "max_tokens": output_len,
                                         "temperature": 0, "ignore_eos": True}) + "\n" for i, p in enumerate(prompts)))
    out, summary, log = tmp / f"{layout}-out.jsonl", tmp / f"{layout}-summary.json", tmp / f"{layout}.log"
    max_len = max(map(len, prompts)) + output_len
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={ranks}"]
    head = [sys.executable, "-m", "tpengine.run"] if ranks == 1 else [*torchrun, "-m", "tpengine.run"]
    cmd = [*head, "--prompts", str(lines), "--out", str(out), "--summary-json", str(summary), "--model", model,
           "--dtype", dtype, "--max-model-len", str(max_len), "--max-num-seqs", str(len(prompts)),
           "--kv-cache-gb", "2", "--threads", str(max(1, cores // ranks)), *flags]
    with open(log, "w") as fh:
        code = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=fh, env=subprocess_env()).returncode
    if code:
        raise RuntimeError(f"{layout} exited with {code}:\n{log.read_text()[-4000:]}")
    return json.loads(summary.read_text())


def render_table(result: dict):
    """A ``rich.table.Table`` of ``result`` (the JSON this benchmark writes)."""
    from rich.table import Table

    c, m = result["config"], result["machine"]
    table = Table(title=f"{Path(c['model']).name} ({c['dtype']}): {c['num_prompts']} x {c['input_len']} -> "
                        f"{c['output_len']}; prefix: {c['prefix_prompts']} x ({c['doc_len']} shared + 32) -> "
                        f"{c['prefix_output_len']}",
                  caption=f"{machine_line(m)}; best of {c['rounds']} round(s), {result['total_s']:.0f} s in all")
    for col in ("layout", "ranks x threads", "output tok/s", "vs D1xT1", "TTFT p50 ms", "prefix hit rate",
                "prefix output tok/s"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    base = result["results"]["D1xT1"]["output_tok_s"]
    for name, r in result["results"].items():
        table.add_row(name, f"{LAYOUTS[name][0]} x {r['threads']}", f"{r['output_tok_s']:.1f}",
                      f"{r['output_tok_s'] / base:.2f}x", f"{r['ttft_p50_s'] * 1000:.0f}",
                      f"{r['prefix_hit_rate']:.3f}", f"{r['prefix_output_tok_s']:.1f}")
    return table


@app.command()
def main(
    model: Annotated[str, typer.Option(help="model folder")] = DEFAULT_MODEL_DIR,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16")] = "bfloat16",
    num_prompts: Annotated[int, typer.Option(help="throughput: number of requests")] = 64,
    input_len: Annotated[int, typer.Option(help="throughput: prompt tokens per request")] = 128,
    output_len: Annotated[int, typer.Option(help="throughput: output tokens per request")] = 128,
    prefix_prompts: Annotated[int, typer.Option(help="prefix workload: number of requests")] = 16,
    doc_len: Annotated[int, typer.Option(help="prefix workload: tokens of the shared document")] = 512,
    prefix_output_len: Annotated[int, typer.Option(help="prefix workload: output tokens per request")] = 32,
    rounds: Annotated[int, typer.Option(help="rounds; the table shows the best")] = 2,
    out: Annotated[Path | None, typer.Option(help="write the results here as JSON")] = None,
) -> None:
    """Throughput and TTFT of D=2 x T=1 vs D=1 x T=2 vs D=1 x T=1 on the same cores, and the prefix-cache
    hit rate of the router."""
    from rich.console import Console
    from transformers import AutoConfig

    console = Console(stderr=True)
    if min(num_prompts, input_len, output_len, prefix_prompts, doc_len, prefix_output_len, rounds) < 1:
        raise typer.BadParameter("every count and length must be >= 1")
    started = time.time()
    info, cores = machine_info(), cpu_cores()
    console.print(machine_line(info))
    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts = random_prompts(num_prompts, input_len, vocab, seed=0)
    shared = shared_prefix_prompts(prefix_prompts, doc_len, 32, vocab, seed=0)
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="tpengine-bench-dp-") as tmp:
        for rnd in range(rounds):
            for name in (list(LAYOUTS) if rnd % 2 == 0 else list(reversed(LAYOUTS))):
                thr = run_job(name, prompts, output_len, model, dtype, cores, Path(tmp))
                pre = run_job(name, shared, prefix_output_len, model, dtype, cores, Path(tmp))
                runs[name].append({"output_tok_s": thr["output_tok_s"], "ttft_p50_s": thr["ttft_p50_s"],
                                   "wall_s": thr["wall_s"], "prefix_hit_rate": pre["prefix_cache_hit_rate"],
                                   "prefix_output_tok_s": pre["output_tok_s"]})
                console.print(f"round {rnd + 1} {name}: {thr['output_tok_s']:.1f} tok/s, TTFT p50 "
                              f"{thr['ttft_p50_s'] * 1000:.0f} ms; prefix hit rate {pre['prefix_cache_hit_rate']:.3f}")
    results = {}
    for name, rs in runs.items():
        best = max(rs, key=lambda r: r["output_tok_s"])
        results[name] = {**best, "threads": max(1, cores // LAYOUTS[name][0]), "rounds": rs}
    result = {"config": {"model": model, "dtype": dtype, "num_prompts": num_prompts, "input_len": input_len,
                         "output_len": output_len, "prefix_prompts": prefix_prompts, "doc_len": doc_len,
                         "prefix_output_len": prefix_output_len, "rounds": rounds},
              "machine": info, "results": results, "total_s": time.time() - started}
    emit(console, render_table(result), result, out)


if __name__ == "__main__":
    app()
