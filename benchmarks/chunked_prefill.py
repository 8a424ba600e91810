"""Benchmark: how long running requests stall while a long prompt is prefilled, with and without chunking.

    python -m benchmarks.chunked_prefill --out bench-chunked.json           (make bench-chunked)
    python -m benchmarks.chunked_prefill --chunk 512,2048 --rounds 3

At tp=1, ``--num-running`` requests (``--running-len``-token random prompts, ``--running-output-len``
tokens out, ``ignore_eos``, greedy) are started; after the first step at whose end each has
``--start-after`` tokens, one ``--long-len``-token prompt arrives (1 output token). Every
``engine.step()`` is timed; a running request's token is stamped at the end of the step that
sampled it. Configurations, all in one worker process (:mod:`benchmarks.bench_worker`, the engine
rebuilt and warmed up, also on a ``--long-len`` prompt, before each measurement; loading is not
measured): no chunking (``enable_chunked_prefill`` False, ``max_num_batched_tokens``
max(8192, max_model_len): the long prompt in one step) and chunked prefill with
``max_num_batched_tokens`` = each ``--chunk`` size.

Reported per configuration (best round of each figure with ``--rounds`` > 1): the worst and the p50
gap between consecutive tokens of a running request, the long prompt's TTFT (arrival to its first
token), the running requests' decode throughput (their tokens / first step's start to their last
token), and the longest step. The *suggested default* of ``max_num_batched_tokens`` is the chunk
size with the smallest worst gap among those whose long-prompt TTFT is within 10% of the
no-chunking TTFT (None if none is).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks import emit
from benchmarks.bench import Worker, cpu_cores, machine_info, random_prompts
from tpengine.config import DEFAULT_MODEL_DIR
from tpengine.utils import cdiv

app = typer.Typer(add_completion=False)

#: The long prompt's TTFT may exceed the no-chunking one by at most this fraction for a chunk size
#: to be suggested.
TTFT_TOLERANCE = 0.10
NO_CHUNK = "no-chunk"


def parse_chunks(text: str) -> list[int]:
    """``"256,512"`` -> ``[256, 512]`` (sorted, duplicates dropped).

    Raises:
        typer.BadParameter: an empty list, a non-integer or a size < 1, naming it.
    """
    sizes = set()
    for part in text.split(","):
        try:
            size = int(part.strip())
        except ValueError:
            raise typer.BadParameter(f"--chunk {text!r}: {part.strip()!r} is not an integer "
                                     "(comma-separated token counts >= 1)") from None
        if size < 1:
            raise typer.BadParameter(f"--chunk {text!r}: {size} must be >= 1")
        sizes.add(size)
    return sorted(sizes)


def config_name(chunk: int | None) -> str:
    """``None`` -> "no-chunk", 512 -> "chunk-512"."""
    return NO_CHUNK if chunk is None else f"chunk-{chunk}"


def summarize(runs: dict) -> dict:
    """Per configuration, the best round of each figure: ``worst_gap_ms`` and ``p50_gap_ms``
    (lowest), ``long_ttft_ms`` (lowest), ``decode_tok_s`` (highest), ``max_step_ms`` (lowest), with
    ``max_num_batched_tokens``, the first round's ``steps``, ``prefill_steps``, ``computed_tokens`` and
    number of ``gaps``, and ``ttft_vs_no_chunk`` (its long-prompt TTFT / the no-chunking one)."""
    rows = {}
    for name, rs in runs.items():
        rows[name] = {
            "max_num_batched_tokens": rs[0]["max_num_batched_tokens"],
            "enable_chunked_prefill": rs[0]["enable_chunked_prefill"],
            "worst_gap_ms": round(min(max(r["gaps_s"]) for r in rs) * 1e3, 3),
            "p50_gap_ms": round(min(statistics.median(r["gaps_s"]) for r in rs) * 1e3, 3),
            "long_ttft_ms": round(min(r["long_ttft_s"] for r in rs) * 1e3, 3),
            "decode_tok_s": round(max(r["running_tokens"] / r["decode_s"] for r in rs), 1),
            "max_step_ms": round(min(max(r["step_s"]) for r in rs) * 1e3, 3),
            "steps": rs[0]["stats"]["steps"], "prefill_steps": rs[0]["stats"]["prefill_steps"],
            "computed_tokens": rs[0]["stats"]["computed_tokens"], "gaps": len(rs[0]["gaps_s"]),
        }
    base = rows.get(NO_CHUNK)
    if base:
        for row in rows.values():
            row["ttft_vs_no_chunk"] = round(row["long_ttft_ms"] / base["long_ttft_ms"], 3)
    return rows


def suggested_default(rows: dict, tolerance: float = TTFT_TOLERANCE) -> int | None:
    """The chunk size (``max_num_batched_tokens``) with the smallest worst gap among the chunked
    rows whose long-prompt TTFT is at most ``(1 + tolerance)`` x the no-chunking one; None if
    none is (or no no-chunking row)."""
    base = rows.get(NO_CHUNK)
    if base is None:
        return None
    ok = [r for name, r in rows.items()
          if name != NO_CHUNK and r["long_ttft_ms"] <= (1 + tolerance) * base["long_ttft_ms"]]
    return min(ok, key=lambda r: (r["worst_gap_ms"], r["max_num_batched_tokens"]))["max_num_batched_tokens"] \
        if ok else None


def render_table(result: dict):
    """A ``rich.table.Table`` of ``result`` (the JSON this benchmark writes)."""
    from rich.table import Table

    c, m = result["config"], result["machine"]
    suggested = result["suggested_default"]
    table = Table(title=f"{c['model']} ({c['dtype']}), tp=1: {c['num_running']} running x ({c['running_len']} in -> "
                        f"{c['running_output_len']} out) while a {c['long_len']}-token prompt is prefilled",
                  caption=f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}; best of {c['rounds']} round(s), "
                          f"{result['total_s']} s in all; suggested default max_num_batched_tokens: "
                          + ("none within 10% of the no-chunking TTFT" if suggested is None else str(suggested)))
    for col in ("configuration", "tokens/step", "worst gap ms", "p50 gap ms", "long TTFT ms", "TTFT vs none",
                "decode tok/s", "max step ms"):
        # the configuration column never wraps: its label may carry "(suggested default)"
        table.add_column(col, justify="left" if col == "configuration" else "right", no_wrap=col == "configuration")
    for name, r in result["results"].items():
        label = "no chunking" if name == NO_CHUNK else f"chunked {r['max_num_batched_tokens']}"
        if suggested is not None and name == config_name(suggested):
            label += " (suggested default)"
        table.add_row(label, str(r["max_num_batched_tokens"]), f"{r['worst_gap_ms']:.1f}", f"{r['p50_gap_ms']:.1f}",
                      f"{r['long_ttft_ms']:.1f}", f"{r['ttft_vs_no_chunk']:.2f}x" if "ttft_vs_no_chunk" in r else "-",
                      f"{r['decode_tok_s']:.1f}", f"{r['max_step_ms']:.1f}")
    return table


@app.command()
def main(
    model: Annotated[str, typer.Option(help="HF model folder")] = DEFAULT_MODEL_DIR,
    num_running: Annotated[int, typer.Option(help="running (decoding) requests")] = 4,
    running_len: Annotated[int, typer.Option(help="prompt tokens of each running request")] = 32,
    running_output_len: Annotated[int, typer.Option(help="output tokens of each running request")] = 256,
    start_after: Annotated[int, typer.Option(help="the long prompt arrives once each running request has "
                                                  "this many tokens")] = 8,
    long_len: Annotated[int, typer.Option(help="tokens of the long prompt")] = 4096,
    chunk: Annotated[str, typer.Option(help="chunk sizes (max_num_batched_tokens), comma-separated")] =
        "256,512,1024,2048,4096",
    dtype: Annotated[str, typer.Option(help="weights and KV cache: float32, bfloat16, float16")] = "float32",
    rounds: Annotated[int, typer.Option(help="rounds (the order alternates); the best of each figure is "
                                             "reported")] = 1,
    threads: Annotated[int, typer.Option(help="cores to use (0 = the affinity mask)")] = 0,
    seed: Annotated[int, typer.Option(help="seed of the random prompts")] = 0,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Worst inter-token gap of running requests while a long prompt is prefilled, per chunk size."""
    from rich.console import Console

    console = Console(width=max(Console().width, 120))
    chunks = parse_chunks(chunk)
    if min(num_running, running_len, long_len, rounds) < 1:
        raise typer.BadParameter("--num-running, --running-len, --long-len and --rounds must be >= 1")
    if not 1 <= start_after < running_output_len:
        raise typer.BadParameter(f"--start-after {start_after} must be >= 1 and < --running-output-len "
                                 f"{running_output_len}")
    from transformers import AutoConfig

    from tpengine.config import WEIGHT_DTYPES

    if dtype not in WEIGHT_DTYPES:
        raise typer.BadParameter(f"--dtype {dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    try:
        hf_config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(f"--model {model!r}: cannot read its config.json ({e})") from None
    max_len = max(running_len + running_output_len, long_len + 2)  # the warm-up makes 2 tokens
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and max_len > limit:
        raise typer.BadParameter(f"--long-len {long_len} + 2 or --running-len {running_len} + --running-output-len "
                                 f"{running_output_len} exceeds the model's max_position_embeddings {limit}")
    vocab, cores = hf_config.vocab_size, threads or cpu_cores()
    running = random_prompts(num_running, running_len, vocab, seed)
    long_prompt = random_prompts(1, long_len, vocab, seed + 1)[0]
    warm_long = random_prompts(1, long_len, vocab, seed + 2)[0]  # other ids: no prefix-cache hit either way
    blocks = num_running * cdiv(running_len + running_output_len, 16) + cdiv(long_len + 2, 16) + 4
    args = ["--system", "engine", "--model", model, "--dtype", dtype, "--threads", str(cores), "--max-num-seqs",
            str(num_running + 1), "--max-model-len", str(max_len), "--num-kv-blocks", str(blocks)]
    configs = [None, *chunks]
    runs: dict[str, list[dict]] = {config_name(c): [] for c in configs}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tpengine-bench-chunked-") as logdir:
        w = Worker("engine", args, 1, Path(logdir) / "engine.log")
        try:
            w.ready = w.read()
            for r in range(rounds):
                for c in configs if r % 2 == 0 else configs[::-1]:
                    settings = {"enable_chunked_prefill": False, "max_num_batched_tokens": 0} if c is None else \
                        {"enable_chunked_prefill": True, "max_num_batched_tokens": c}
                    w.ask({"cmd": "configure", "warmup": [warm_long], **settings})
                    res = w.ask({"cmd": "interference", "running_prompts": running,
                                 "running_output_len": running_output_len, "long_prompt": long_prompt,
                                 "start_after": start_after})
                    runs[config_name(c)].append(res)
                    console.print(f"  round {r + 1} {config_name(c):>10}: worst gap "
                                  f"{max(res['gaps_s']) * 1e3:8.1f} ms, "
                                  f"long TTFT {res['long_ttft_s'] * 1e3:8.1f} ms")
        finally:
            w.close()
    rows = summarize(runs)
    result = {
        "config": {"model": model, "num_running": num_running, "running_len": running_len,
                   "running_output_len": running_output_len, "start_after": start_after, "long_len": long_len,
                   "chunks": chunks, "dtype": dtype, "rounds": rounds, "seed": seed, "cores": cores,
                   "ttft_tolerance": TTFT_TOLERANCE},
        "machine": machine_info(),
        "results": rows,
        "suggested_default": suggested_default(rows),
        "runs": runs,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    emit(console, render_table(result), result, out)


if __name__ == "__main__":
    app()
