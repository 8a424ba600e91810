"""Benchmark: pipeline parallel against tensor parallel and data parallel on the same cores (``make bench-pp``).

    python -m benchmarks.bench_pp --out bench-pp.json
    python -m benchmarks.bench_pp --dtype float32 --num-prompts 16 --output-len 32 --rounds 1

Three layouts of 2 ranks on the same cores (cores / 2 threads per rank), each one torchrun launch of
:mod:`benchmarks.pp_worker` over the same workload (``make bench``'s: ``--num-prompts`` random prompts of
``--input-len`` token ids, exactly ``--output-len`` out, greedy; then the first prompt alone, batch-1
latency):

* ``TP2``: one replica of tp=2 (two all-reduces of the hidden states per layer);
* ``PP2``: one replica of 2 pipeline stages of tp=1 (the hidden states and the residual sent once per
  step from stage 0 to stage 1, the sampled ids back);
* ``DP2``: two replicas of tp=1 (no activations between ranks).

Per layout: output tok/s (output tokens / the throughput command's wall time), TTFT p50 of that command,
batch-1 TTFT and TPOT, per-rank peak memory and weight bytes, the bytes moved between ranks per
generated token -- counted (the pipeline's transfers, :data:`tpengine.distributed.P2P_COUNTERS`; TP's
shared-memory all-reduces are not counted) and computed (TP: ``2L + 1`` all-reduces of
``hidden x elem`` bytes per token, the embedding's and two per layer, each rank's slot read by the
``T - 1`` others, plus each rank's 16-byte greedy pick per sampled row; PP: ``2 x hidden x elem`` per
token from stage to stage and an 8-byte id per sampled row back; DP: 0) -- and each rank's busy
fraction: its CPU time / (wall time x threads), and for PP also 1 - the time it waited to receive / wall
time. The output names the CPU (:mod:`benchmarks.machine`); with ``--rounds`` > 1 each round runs the
layouts in the opposite order and the table shows the best round.
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
from tpengine.config import DEFAULT_MODEL_DIR

app = typer.Typer(add_completion=False)

#: layout -> the worker's flags (every layout runs 2 ranks)
LAYOUTS = {"TP2": ["--tensor-parallel-size", "2"], "PP2": ["--pipeline-parallel-size", "2"],
           "DP2": ["--data-parallel-size", "2"]}
RANKS = 2


def run_layout(layout: str, prompts_file: Path, output_len: int, model: str, dtype: str, threads: int,
               tmp: Path) -> list[dict]:
    """One launch of ``layout``; every rank's JSON (:mod:`benchmarks.pp_worker`), in rank order.

    Raises:
        RuntimeError: the launch failed (with its log's tail).
    """
    out = tmp / layout
    out.mkdir(exist_ok=True)
    log = tmp / f"{layout}.log"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={RANKS}", "-m",
           "benchmarks.pp_worker", "--model", model, "--dtype", dtype, "--threads", str(threads), "--prompts",
           str(prompts_file), "--output-len", str(output_len), "--out", str(out), *LAYOUTS[layout]]
    with open(log, "w") as fh:
        code = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=fh, env=subprocess_env()).returncode
    if code:
        raise RuntimeError(f"{layout} exited with {code}:\n{log.read_text()[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


def computed_bytes(layout: str, hf_config, elem: int, prompt_tokens: int, output_tokens: int, requests: int) -> float:
    """Bytes moved between the ranks per generated token as the layout's arithmetic gives them (see the
    module docstring): per token processed (every prompt token, and every output token but each request's
    last), per sampled row (every output token)."""
    h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
    processed = prompt_tokens + output_tokens - requests
    if layout == "TP2":
        per_token, per_row = (2 * layers + 1) * h * elem * RANKS * (RANKS - 1), 16 * RANKS
    elif layout == "PP2":
        per_token, per_row = 2 * h * elem, 8
    else:
        return 0.0
    return (processed * per_token + output_tokens * per_row) / output_tokens


def summarize(layout: str, ranks: list[dict], hf_config, elem: int, requests: int) -> dict:
    """One layout's row from its ranks' JSON."""
    front = ranks[0]
    return {"output_tok_s": front["output_tokens"] / front["wall_s"], "ttft_p50_s": front["ttft_p50_s"],
            "latency_ttft_s": front["latency_ttft_s"], "latency_tpot_s": front["latency_tpot_s"],
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks], "weight_bytes": [r["weight_bytes"] for r in ranks],
            "counted_bytes_per_token": sum(r["sent_bytes"] for r in ranks) / front["output_tokens"],
            "computed_bytes_per_token": computed_bytes(layout, hf_config, elem, front["prompt_tokens"],
                                                       front["output_tokens"], requests),
            "busy_cpu": [r["cpu_s"] / (r["wall_s"] * r["threads"]) for r in ranks],
            "busy_not_waiting": [1 - r["recv_wait_s"] / r["wall_s"] for r in ranks],
            "threads": ranks[0]["threads"], "ranks": ranks}


def render_table(result: dict):
    """A ``rich.table.Table`` of ``result`` (the JSON this benchmark writes)."""
    from rich.table import Table

    c, m = result["config"], result["machine"]
    table = Table(title=f"{Path(c['model']).name} ({c['dtype']}, {c['layers']} layers): {c['num_prompts']} x "
                        f"{c['input_len']} -> {c['output_len']}; batch-1 latency",
                  caption=f"{machine_line(m)}; best of {c['rounds']} round(s), {result['total_s']:.0f} s in all")
    for col in ("layout", "output tok/s", "vs TP2", "TTFT p50 ms", "batch-1 TTFT / TPOT ms", "peak GiB/rank",
                "bytes/token counted", "bytes/token computed", "busy CPU/rank", "busy not waiting/rank"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    base = result["results"]["TP2"]["output_tok_s"]
    for name, r in result["results"].items():
        table.add_row(name, f"{r['output_tok_s']:.1f}", f"{r['output_tok_s'] / base:.2f}x",
                      f"{r['ttft_p50_s'] * 1000:.0f}",
                      f"{r['latency_ttft_s'] * 1000:.0f} / {r['latency_tpot_s'] * 1000:.1f}",
                      " / ".join(f"{b / 2**30:.2f}" for b in r["peak_rss_bytes"]),
                      f"{r['counted_bytes_per_token']:.0f}" if name == "PP2" else "-",
                      f"{r['computed_bytes_per_token']:.0f}",
                      " / ".join(f"{x:.2f}" for x in r["busy_cpu"]),
                      " / ".join(f"{x:.2f}" for x in r["busy_not_waiting"]) if name == "PP2" else "-")
    return table


@app.command()
def main(
    model: Annotated[str, typer.Option(help="model folder")] = DEFAULT_MODEL_DIR,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16")] = "bfloat16",
    num_prompts: Annotated[int, typer.Option(help="throughput: number of requests")] = 64,
    input_len: Annotated[int, typer.Option(help="prompt tokens per request")] = 128,
    output_len: Annotated[int, typer.Option(help="output tokens per request")] = 128,
    rounds: Annotated[int, typer.Option(help="rounds; the table shows the best")] = 1,
    out: Annotated[Path | None, typer.Option(help="write the results here as JSON")] = None,
) -> None:
    """Output tok/s, TTFT, TPOT, memory, bytes moved per token and busy fraction of TP=2 vs PP=2 vs D=2."""
    from rich.console import Console
    from transformers import AutoConfig

    console = Console(stderr=True)
    if min(num_prompts, input_len, output_len, rounds) < 1:
        raise typer.BadParameter("every count and length must be >= 1")
    started = time.time()
    info, cores = machine_info(), cpu_cores()
    console.print(machine_line(info))
    hf_config = AutoConfig.from_pretrained(model)
    elem = 2 if dtype in ("bfloat16", "float16") else 4
    threads = max(1, cores // RANKS)
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="tpengine-bench-pp-") as tmp:
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(random_prompts(num_prompts, input_len, hf_config.vocab_size, seed=0)))
        for rnd in range(rounds):
            for name in (list(LAYOUTS) if rnd % 2 == 0 else list(reversed(LAYOUTS))):
                ranks = run_layout(name, prompts_file, output_len, model, dtype, threads, Path(tmp))
                row = summarize(name, ranks, hf_config, elem, num_prompts)
                runs[name].append(row)
                console.print(f"round {rnd + 1} {name}: {row['output_tok_s']:.1f} tok/s, batch-1 TPOT "
                              f"{row['latency_tpot_s'] * 1000:.1f} ms")
    results = {name: max(rs, key=lambda r: r["output_tok_s"]) for name, rs in runs.items()}
    result = {"config": {"model": model, "dtype": dtype, "num_prompts": num_prompts, "input_len": input_len,
                         "output_len": output_len, "rounds": rounds, "layers": hf_config.num_hidden_layers,
                         "threads_per_rank": threads},
              "machine": info, "results": results, "total_s": time.time() - started}
    emit(console, render_table(result), result, out)


if __name__ == "__main__":
    app()
