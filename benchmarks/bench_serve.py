"""Benchmark: the OpenAI-compatible server under concurrent streaming clients, the shape of
``vllm bench serve``, against the offline batch job on the same workload in the same run.

    python -m benchmarks.bench_serve --out bench-serve.json                  (make bench-serve)
    python -m benchmarks.bench_serve --tp 1 --max-concurrency 1 --max-concurrency 16 --max-concurrency 64

Workload: ``--num-prompts`` requests of ``--input-len`` random prompt token ids (fixed ``--seed``),
exactly ``--output-len`` tokens out each (``ignore_eos``), greedy. In order:

1. offline reference: the batch job (``python -m tpengine.run``, under ``torchrun`` at tp > 1) on
   the same prompts as ``prompt_token_ids`` lines with the same engine flags; its output tokens/s
   from ``--summary-json`` (all output tokens / the engine's wall time, loading excluded);
2. the server (``python -m tpengine.serve``, same tp and engine flags) is started once, polled on
   ``GET /health``, sent one warm-up request, then for each ``--max-concurrency`` the prompts are run
   through ``POST /v1/completions`` (``stream``, ``stream_options.include_usage``) by at most that
   many concurrent asyncio clients (one ``aiohttp.ClientSession``, as ``vllm bench serve``), all
   requests issued at once.

Reported per concurrency (vLLM's definitions, ms): TTFT (request sent to its first non-empty text
chunk), TPOT ((latency - TTFT) / (output tokens - 1), per request), ITL (every gap between
consecutive text chunks; a chunk may carry more than one token when a token's text is held back
for a multi-byte character), E2E latency, each mean / p50 / p99; request throughput (requests /
wall time of the run), output tokens/s (all output tokens / wall time of the run) and its ratio to
the offline job's; the mean of ``tpengine:num_requests_running`` sampled from ``/metrics`` once a
second (the running batch). Every request must end with a usage chunk of exactly ``--output-len``
completion tokens, else the benchmark fails.

Prefix caching is off by default (``--enable-prefix-caching`` turns it on for both systems): random
prompts share no prefix, so caching would only let a later concurrency level reuse the blocks of an
earlier one.

The client runs on the same machine as the server: its CPU (HTTP, SSE parsing) competes with the
ranks, so on a machine with few cores the server's figures include the client's cost. The client
is kept light (raw SSE lines, one ``json.loads`` per chunk, no openai client objects).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

import benchmarks
from benchmarks import emit, subprocess_env
from benchmarks.bench import machine_info, random_prompts
from benchmarks.serve_client import RequestResult, run_clients
from tpengine.config import DEFAULT_MODEL_DIR

app = typer.Typer(add_completion=False)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_offline(prompts: list[list[int]], output_len: int, tp: int, engine_args: list[str], tmp: Path) -> dict:
    """The batch job on ``prompts`` (one ``prompt_token_ids`` line each, greedy, ``ignore_eos``):
    its ``--summary-json`` plus ``job_s`` (the whole command's wall time).

    Raises:
        RuntimeError: the job failed, or a request did not get exactly ``output_len`` tokens.
    """
    src, out, summary = tmp / "prompts.jsonl", tmp / "out.jsonl", tmp / "summary.json"
    with open(src, "w") as fh:
        for i, p in enumerate(prompts):
            fh.write(json.dumps({"id": f"r{i}", "prompt_token_ids": p, "max_tokens": output_len,
                                 "temperature": 0.0, "ignore_eos": True}) + "\n")
    cmd = [*benchmarks.launcher(tp, "tpengine.run"), "--prompts", str(src), "--out", str(out),
           "--summary-json", str(summary), *engine_args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    job_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the batch job failed (exit {proc.returncode}): {shlex.join(cmd)}\n{proc.stderr[-3000:]}")
    s = json.loads(summary.read_text())
    counts = [len(json.loads(line).get("token_ids") or []) for line in out.read_text().splitlines()]
    bad = [(i, n) for i, n in enumerate(counts) if n != output_len]
    if s["requests_ok"] != len(prompts) or len(counts) != len(prompts) or bad:
        raise RuntimeError(f"the batch job: {s['requests_ok']} of {len(prompts)} requests ok, "
                           f"{len(bad)} without exactly {output_len} output tokens (first: {bad[:3]})")
    return {**s, "job_s": round(job_s, 3)}


class ServerProcess:
    """``python -m tpengine.serve`` (torchrun at tp > 1) on 127.0.0.1:``port``, in its own process
    group, its stderr in ``log``; ready once ``GET /health`` answers 200."""

    def __init__(self, tp: int, port: int, engine_args: list[str], log: Path, timeout_s: float = 300.0):
        self.url, self.log_path, self.tp = f"http://127.0.0.1:{port}", log, tp
        cmd = [*benchmarks.launcher(tp, "tpengine.serve"), "--host", "127.0.0.1", "--port", str(port), *engine_args]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=self.log,
                                     start_new_session=True)
        import httpx2

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx2.get(self.url + "/health", timeout=2).status_code == 200:
                    self.ready_s = time.perf_counter() - t0
                    return
            except httpx2.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-3000:]

    def stop(self) -> int | None:
        """SIGTERM to the server's ranks (under torchrun its workers, as a process manager stopping the
        server would: rank 0 drains and stops the others, and torchrun exits with their code 0; a
        SIGTERM to torchrun itself makes it exit 1); SIGKILL to the group after 30 s. The exit code."""
        if self.proc.poll() is None:
            try:
                kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            except OSError:
                kids = []
            if self.tp > 1 and kids:
                for pid in map(int, kids):
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            else:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def stats_ms(values: list[float]) -> dict:
    """``mean``, ``p50``, ``p99`` of ``values`` (seconds) in ms (0 for none)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1e3
    return {"mean": round(float(a.mean()), 3), "p50": round(float(np.percentile(a, 50)), 3),
            "p99": round(float(np.percentile(a, 99)), 3)}


def summarize_run(results: list[RequestResult], wall_s: float, output_len: int, input_len: int,
                  concurrency: int, running: list[float], offline_tok_s: float | None) -> dict:
    """One concurrency level's figures.

    Raises:
        RuntimeError: a request failed, or its usage chunk did not say exactly ``output_len`` tokens.
    """
    bad = [(i, r.error or f"{r.output_tokens} completion tokens, {len(r.chunk_s)} text chunks")
           for i, r in enumerate(results) if r.error or r.output_tokens != output_len or not r.chunk_s]
    if bad:
        raise RuntimeError(f"max_concurrency {concurrency}: {len(bad)} of {len(results)} requests did not get "
                           f"exactly {output_len} output tokens; first: {bad[:3]}")
    ttft = [r.chunk_s[0] for r in results]
    tpot = [(r.latency_s - r.chunk_s[0]) / (output_len - 1) for r in results] if output_len > 1 else []
    itl = [b - a for r in results for a, b in zip(r.chunk_s, r.chunk_s[1:])]
    out_tokens = sum(r.output_tokens for r in results)
    tok_s = out_tokens / wall_s
    return {"max_concurrency": concurrency, "completed": len(results), "wall_s": round(wall_s, 6),
            "input_tokens": input_len * len(results), "output_tokens": out_tokens,
            "request_throughput": round(len(results) / wall_s, 3), "output_tok_s": round(tok_s, 1),
            "vs_offline": None if offline_tok_s is None else round(tok_s / offline_tok_s, 3),
            "mean_running": round(float(np.mean(running)), 1) if running else None,
            "ttft_ms": stats_ms(ttft), "tpot_ms": stats_ms(tpot), "itl_ms": stats_ms(itl),
            "e2e_ms": stats_ms([r.latency_s for r in results])}


def render_table(result: dict):
    """A ``rich.table.Table`` of ``result`` (the JSON this benchmark writes)."""
    from rich.table import Table

    c, m, off = result["config"], result["machine"], result["offline"]
    ref = "no offline reference" if off is None else \
        f"offline batch job {off['output_tok_s']:.1f} output tok/s ({off['wall_s']:.1f} s)"
    table = Table(title=f"{c['model']} ({c['dtype']}, tp={c['tp']}): {c['num_prompts']} x ({c['input_len']} in -> "
                        f"{c['output_len']} out), streaming /v1/completions",
                  caption=f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}; {ref}; client on the same "
                          f"machine; {result['total_s']} s in all")
    cols = ("clients", "output tok/s", "/ offline", "req/s", "running", "TTFT mean", "TTFT p50", "TTFT p99",
            "TPOT mean", "TPOT p50", "TPOT p99", "ITL mean", "ITL p50", "ITL p99", "wall s")
    for col in cols:
        table.add_column(col, justify="right")
    for r in result["results"]:
        ratio = "-" if r["vs_offline"] is None else f"{r['vs_offline']:.2f}x"
        table.add_row(str(r["max_concurrency"]), f"{r['output_tok_s']:.1f}", ratio,
                      f"{r['request_throughput']:.2f}", "-" if r["mean_running"] is None else f"{r['mean_running']}",
                      *(f"{r[k][s]:.1f}" for k in ("ttft_ms", "tpot_ms", "itl_ms") for s in ("mean", "p50", "p99")),
                      f"{r['wall_s']:.1f}")
    return table


@app.command()
def main(
    model: Annotated[str, typer.Option(help="HF model folder")] = DEFAULT_MODEL_DIR,
    num_prompts: Annotated[int, typer.Option(help="requests per concurrency level")] = 256,
    input_len: Annotated[int, typer.Option(help="prompt tokens per request (random ids)")] = 128,
    output_len: Annotated[int, typer.Option(help="output tokens per request (ignore_eos)")] = 128,
    max_concurrency: Annotated[list[int], typer.Option(
        help="most requests in flight; repeat to sweep (e.g. 1, 16, 64)")] = None,
    tp: Annotated[int, typer.Option(help="tensor-parallel size of the server and the batch job")] = 2,
    dtype: Annotated[str, typer.Option(help="weights and KV cache: float32, bfloat16, float16")] = "bfloat16",
    max_num_seqs: Annotated[int, typer.Option(help="engine: most sequences in one step")] = 64,
    kv_cache_gb: Annotated[float, typer.Option(help="engine: GiB of KV cache per rank")] = 1.0,
    enable_prefix_caching: Annotated[bool, typer.Option(help="engine: prefix caching (both systems)")] = False,
    engine_args: Annotated[str, typer.Option(help="more engine flags for both systems, e.g. '--threads 1'")] = "",
    offline: Annotated[bool, typer.Option(help="run the offline batch job as the reference")] = True,
    seed: Annotated[int, typer.Option(help="seed of the prompts")] = 0,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Streaming clients against tpengine's server: throughput and TTFT / TPOT / ITL, against the batch job."""
    from rich.console import Console

    console = Console(width=max(Console().width, 160))
    levels = max_concurrency or [64]
    if min(num_prompts, input_len, output_len, tp, max_num_seqs, *levels) < 1:
        raise typer.BadParameter("--num-prompts, --input-len, --output-len, --tp, --max-num-seqs and "
                                 "--max-concurrency must be >= 1")
    from transformers import AutoConfig

    from tpengine.config import WEIGHT_DTYPES

    if dtype not in WEIGHT_DTYPES:
        raise typer.BadParameter(f"--dtype {dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    try:
        hf_config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(f"--model {model!r}: cannot read its config.json ({e})") from None
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and input_len + output_len > limit:
        raise typer.BadParameter(f"--input-len {input_len} + --output-len {output_len} = {input_len + output_len} "
                                 f"exceeds the model's max_position_embeddings {limit}")
    max_len = input_len + output_len
    flags = ["--model", model, "--dtype", dtype, "--max-model-len", str(max_len), "--max-num-seqs",
             str(max_num_seqs), "--kv-cache-gb", str(kv_cache_gb),
             "--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching",
             *shlex.split(engine_args)]
    prompts = random_prompts(num_prompts, input_len, hf_config.vocab_size, seed)
    name = Path(model).name
    bodies = [{"model": name, "prompt": p, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}} for p in prompts]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tpengine-bench-serve-") as tmp:
        tmp = Path(tmp)
        off = None
        if offline:
            console.print(f"offline: the batch job at tp={tp} on {num_prompts} prompts")
            off = run_offline(prompts, output_len, tp, flags, tmp)
            console.print(f"  {off['output_tok_s']:.1f} output tok/s ({off['wall_s']:.1f} s)")
        console.print(f"server: starting at tp={tp}")
        server = ServerProcess(tp, free_port(), flags, tmp / "server.log")
        runs = []
        try:
            console.print(f"  ready in {server.ready_s:.1f} s; warm-up request")
            warm, _, _ = asyncio.run(run_clients(server.url, [{**bodies[0], "max_tokens": 2}], 1))
            if warm[0].error or warm[0].output_tokens != 2:
                raise RuntimeError(f"the warm-up request failed: {warm[0].error or warm[0].output_tokens}")
            for c in levels:
                results, wall, running = asyncio.run(run_clients(server.url, bodies, c))
                row = summarize_run(results, wall, output_len, input_len, c, running, off and off["output_tok_s"])
                runs.append(row)
                ratio = "" if off is None else f"{row['vs_offline']:.2f}x offline, "
                console.print(f"  max_concurrency {c:>4}: {row['output_tok_s']:8.1f} output tok/s "
                              f"({ratio}{wall:.1f} s)")
        except BaseException:
            server.stop()
            console.print(server.log_path.read_text()[-3000:], markup=False)
            raise
        code = server.stop()
        if code != 0:
            console.print(f"[bold red]warning[/]: the server exited with code {code} after SIGTERM:")
            console.print(server.log_path.read_text()[-3000:], markup=False)
    result = {
        "config": {"model": model, "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
                   "max_concurrency": levels, "tp": tp, "dtype": dtype, "max_num_seqs": max_num_seqs,
                   "kv_cache_gb": kv_cache_gb, "enable_prefix_caching": enable_prefix_caching,
                   "engine_args": engine_args, "seed": seed},
        "machine": machine_info(),
        "offline": off,
        "server_ready_s": round(server.ready_s, 2),
        "server_exit_code": code,
        "results": runs,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    emit(console, render_table(result), result, out)


if __name__ == "__main__":
    app()
