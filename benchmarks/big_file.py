"""Benchmark: a request file of any length. Rank 0's peak memory and the time to the first record,
for a small and a large file of short prompts, through the real job (``python -m tpengine.run``).

    python -m benchmarks.big_file --out bench-big-file.json                  (make bench-big-file)
    python -m benchmarks.big_file --lines 1000 --lines 100000 --max-tokens 2 --dtype bfloat16

Each file holds ``--lines`` simple lines ``{"id": "r<i>", "prompt": "Request <i>: say hello."}`` with
``max_tokens``. Per file: the job's wall time, the time from its start to the first record on
``--out`` (polled every 50 ms), records written, and rank 0's peak resident memory (from
``--summary-json``). Every line is validated before the model loads; requests are tokenized as the
engine takes them, so rank 0's memory should not grow with the file beyond the validation pass's
set of ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks import emit
from benchmarks.bench import machine_info
from tpengine.config import DEFAULT_MODEL_DIR

app = typer.Typer(add_completion=False)


def write_file(path: Path, lines: int, max_tokens: int) -> None:
    with open(path, "w") as fh:
        for i in range(lines):
            fh.write(json.dumps({"id": f"r{i}", "prompt": f"Request {i}: say hello.", "max_tokens": max_tokens,
                                 "temperature": 0.0}) + "\n")


def run_job(prompts: Path, model: str, extra: list[str]) -> dict:
    """Run the job on ``prompts``; its wall time, time to the first record, records and summary."""
    out, summary = prompts.with_suffix(".out.jsonl"), prompts.with_suffix(".summary.json")
    cmd = [sys.executable, "-m", "tpengine.run", "--prompts", str(prompts), "--out", str(out), "--model", model,
           "--summary-json", str(summary), *extra]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None:
        if first is None and out.is_file() and out.stat().st_size > 0:
            first = time.perf_counter() - start
        time.sleep(0.05)
    wall = time.perf_counter() - start
    stderr = proc.stderr.read()
    if proc.returncode != 0:
        raise RuntimeError(f"job failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    if first is None:
        first = wall
    with open(out, "rb") as fh:
        records = sum(1 for _ in fh)
    s = json.loads(summary.read_text())
    return {"wall_s": round(wall, 2), "first_record_s": round(first, 2), "records": records,
            "rank0_peak_rss_mib": round(s["peak_rss_bytes"][0] / 2**20, 1), "summary": s}


@app.command()
def main(
    lines: Annotated[list[int] | None, typer.Option("--lines", help="lines per file (repeatable)")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="max_tokens of every request")] = 2,
    model: Annotated[str, typer.Option("--model", help="model folder")] = DEFAULT_MODEL_DIR,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", help="the job's --max-num-seqs")] = 256,
    dtype: Annotated[str, typer.Option("--dtype", help="the job's --dtype")] = "bfloat16",
    out: Annotated[Path | None, typer.Option("--out", help="results JSON")] = None,
) -> None:
    """Run the job on files of ``--lines`` short prompts each (tp=1) and compare."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in lines or [1000, 100_000]:
            path = Path(tmp) / f"prompts-{n}.jsonl"
            write_file(path, n, max_tokens)
            r = run_job(path, model, ["--max-num-seqs", str(max_num_seqs), "--dtype", dtype])
            r["lines"] = n
            results.append(r)
    from rich.console import Console
    from rich.table import Table

    info = machine_info()
    table = Table(title=f"request files of short prompts, tp=1, {dtype}, max_tokens {max_tokens} ({info['cpu']})")
    for col in ("lines", "records", "first record s", "wall s", "rank 0 peak RSS MiB"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r["lines"]), str(r["records"]), str(r["first_record_s"]), str(r["wall_s"]),
                      str(r["rank0_peak_rss_mib"]))
    emit(Console(stderr=True), table,
         {"machine": info, "max_tokens": max_tokens, "max_num_seqs": max_num_seqs, "dtype": dtype, "runs": results},
         out)


if __name__ == "__main__":
    app()
