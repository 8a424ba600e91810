"""Benchmark: batch-1 decode at a long context over an int8 KV cache against a bfloat16 one (issue 59, item 4).

    python -m benchmarks.bench_kv --out bench-kv.json                       (make bench-kv)
    python -m benchmarks.bench_kv --context 4096 --output-len 64 --rounds 3
    python -m benchmarks.bench_kv --weights bfloat16                         (the bfloat16 weights' row only)
    python -m benchmarks.bench_kv --no-engine                               (the attention kernels alone)

Two parts, each measuring the two caches side by side:

* **engine**: per ``--weights`` row (the model's weights in bfloat16, or quantized at load to ``int8`` /
  ``int4``; the activations bfloat16 throughout) the model at tp=1 in two :mod:`benchmarks.bench_worker`
  processes, one with ``kv_cache_dtype`` auto (bfloat16) and one with int8, each loaded and warmed up alone,
  then measured in turn (the order alternating between rounds, so a shared machine's load falls on both
  alike): one request of a ``--context``-token prompt (HumanEval's prompts and canonical solutions, one after
  another: real text) making ``--output-len`` greedy tokens. TPOT = (latency - TTFT) / (output tokens - 1),
  vLLM's definition; every round starts from an empty prefix cache, so TTFT is a whole prefill. Reported: the
  best and median TPOT per cache, the speed of int8 against bfloat16 (bfloat16's best / int8's best, and the
  median of the rounds' paired ratios; goal :data:`GOAL`), TTFT, the KV bytes per token, and the long-context
  quality check: how many of the int8 run's greedy tokens equal the bfloat16 run's before the first
  difference; and the row's **byte bound**: the speed int8 could reach if a step only read its bytes at one
  bandwidth, ``(W + b16 x L) / (W + b8 x L)`` (``W``: the loaded weights' bytes, the worker's
  ``weight_bytes``; ``b16`` / ``b8``: KV bytes per token of each cache; ``L``: the mean context of the
  measured steps, prompt + half the output) -- the weights bound the step, so the smaller they are the more
  the KV cache's halving can show.
* **kernel**: one decode step's attention alone (``cpu_paged.decode`` over every layer's cache of the
  model's shape at one rank, batch 1, ``--context`` keys, separate caches per layer so that the rows
  stream from memory as in a step), bfloat16 against int8, interleaved: best and median milliseconds a
  step and their ratio.

The load average is printed with the results: on a shared machine the figures are inflated and noisy.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Annotated

import torch
import typer

from benchmarks import emit
from benchmarks.bench import Worker, cpu_cores, worker_args
from benchmarks.machine import machine_info, machine_line
from tpengine.config import DEFAULT_MODEL_DIR

app = typer.Typer(add_completion=False)

#: The speed of batch-1 decode at a 4096-token context over the int8 cache against bfloat16 (issue 59).
GOAL = 1.3
CACHES = ("auto", "int8")
#: The weights rows: bfloat16, and quantized at load (``--quantization``).
WEIGHTS = ("bfloat16", "int8", "int4")


def long_prompt(tokenizer, n: int) -> list[int]:
    """``n`` token ids of real text: HumanEval's prompts and canonical solutions, one after another
    (repeated if they hold fewer tokens). Raises ValueError for ``n < 1``."""
    from benchmarks.humaneval import humaneval_problems

    if n < 1:
        raise ValueError(f"a prompt of {n} tokens: must be >= 1")
    text = "\n".join(p["prompt"] + p["canonical_solution"] for p in humaneval_problems())
    ids = tokenizer(text)["input_ids"]
    return (ids * (n // len(ids) + 1))[:n]


def kernel_times(num_layers: int, q_to_kv: list[int], head_dim: int, context: int, rounds: int,
                 block_size: int = 16) -> dict:
    """Milliseconds of one batch-1 decode step's attention over ``num_layers`` layers' caches of ``context``
    keys (``q_to_kv``: the query heads' KV heads, one rank's), bfloat16 against int8 (``cpu_paged.decode``,
    no RoPE or store), the two alternating ``rounds`` times (each timing the median of 5 steps):
    ``{cache: {"best_ms", "median_ms"}, "ratio": bfloat16 best / int8 best}``; None without the kernels."""
    from tpengine.backends import kv_quant
    from tpengine.backends.cpu import cpu_library, cpu_paged

    if cpu_library.missing("tpe_paged_decode_bf16", "tpe_paged_decode_i8_bf16") is not None:
        return None
    g = torch.Generator().manual_seed(0)
    hkv, nb = max(q_to_kv) + 1, -(-context // block_size) + 1
    qmap = torch.tensor(q_to_kv)
    index = cpu_paged.paged_index(torch.full((1,), -1), torch.randperm(nb - 1, generator=g)[None, : nb - 1],
                                  torch.tensor([context]))
    q = torch.randn(1, len(q_to_kv), head_dim, generator=g).to(torch.bfloat16)
    kv = torch.randn(1, hkv, head_dim, generator=g).to(torch.bfloat16)
    layers = {"auto": [], "int8": []}
    for _ in range(num_layers):
        kc, vc = (torch.randn(nb, block_size, hkv, head_dim, generator=g).to(torch.bfloat16) for _ in "kv")
        layers["auto"].append((kc, vc, None))
        (kq, ks), (vq, vs) = kv_quant.quantize(kc), kv_quant.quantize(vc)
        layers["int8"].append((kq, vq, (ks, vs)))

    def step(name: str) -> None:
        for kc, vc, scales in layers[name]:
            cpu_paged.decode(q, kv, kv, None, None, kc, vc, qmap, head_dim ** -0.5, index, kv_scales=scales)

    times: dict[str, list[float]] = {c: [] for c in CACHES}
    for name in CACHES:
        step(name)  # warm-up
    for r in range(rounds):
        for name in CACHES if r % 2 == 0 else CACHES[::-1]:
            runs = []
            for _ in range(5):
                t0 = time.perf_counter()
                step(name)
                runs.append(time.perf_counter() - t0)
            times[name].append(statistics.median(runs) * 1e3)
    out = {c: {"best_ms": round(min(t), 3), "median_ms": round(statistics.median(t), 3)} for c, t in times.items()}
    out["ratio"] = round(out["auto"]["best_ms"] / out["int8"]["best_ms"], 3)
    return out


def engine_runs(model: str, prompt: list[int], output_len: int, rounds: int, cores: int, logdir: Path,
                echo, weights: str = "bfloat16") -> dict:
    """The engine part (module docstring) for one ``weights`` row (:data:`WEIGHTS`): per cache
    ``{"tpot_s": [per round], "ttft_s": [...], "token_ids": [per round], "load_s", "weight_bytes"}``."""
    max_len = len(prompt) + output_len + 16
    workers, out = {}, {}
    try:
        for kv in CACHES:  # one at a time: each loads and warms up alone
            args = worker_args(False, 1, model, "bfloat16", cores, 1, max_len, 1, "auto",
                               engine_args=("--kv-cache-dtype", kv),
                               quantization=None if weights == "bfloat16" else weights)
            workers[kv] = Worker(kv, args, 1, logdir / f"bench-kv-{weights}-{kv}.log")
            ready = workers[kv].read()
            out[kv] = {"tpot_s": [], "ttft_s": [], "token_ids": [], "load_s": round(ready["load_s"], 1),
                       "weight_bytes": int(ready["weight_bytes"][0])}
            echo(f"{weights} weights, {kv} KV: ready in {ready['load_s']:.1f} s")
        for r in range(rounds):
            for kv in CACHES if r % 2 == 0 else CACHES[::-1]:
                res = workers[kv].ask({"cmd": "latency", "prompt": prompt, "output_len": output_len,
                                       "token_ids": True})
                tpot = (res["latency_s"] - res["ttft_s"]) / (output_len - 1)
                out[kv]["tpot_s"].append(tpot)
                out[kv]["ttft_s"].append(res["ttft_s"])
                out[kv]["token_ids"].append(res["token_ids"])
                echo(f"{weights} round {r + 1} {kv}: TPOT {tpot * 1e3:.2f} ms, TTFT {res['ttft_s']:.2f} s")
    finally:
        for w in workers.values():
            w.close()
    return out


def agreement(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share before their first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def byte_bound(weight_bytes: int, kv_bytes_per_token: dict, context: float) -> float:
    """The most int8 can speed a step that reads ``weight_bytes`` of weights and ``context`` tokens' KV
    (``kv_bytes_per_token``: per cache) at one bandwidth: ``(W + b16 x L) / (W + b8 x L)``."""
    w, a, b = weight_bytes, kv_bytes_per_token["auto"] * context, kv_bytes_per_token["int8"] * context
    return round((w + a) / (w + b), 3)


def summarize(runs: dict, kv_bytes_per_token: dict | None = None, context: float = 0) -> dict:
    """Per cache: best / median TPOT (ms), median TTFT (s); int8's speed against bfloat16 (best over best,
    and the median of the rounds' paired ratios); the greedy tokens int8 shares with bfloat16 (per round);
    with ``kv_bytes_per_token`` the row's :func:`byte_bound` at the mean ``context`` (and the weight bytes)."""
    out = {kv: {"tpot_best_ms": round(min(r["tpot_s"]) * 1e3, 3),
                "tpot_median_ms": round(statistics.median(r["tpot_s"]) * 1e3, 3),
                "ttft_median_s": round(statistics.median(r["ttft_s"]), 2), "load_s": r["load_s"]}
           for kv, r in runs.items()}
    a, b = runs["auto"], runs["int8"]
    out["speedup_best"] = round(min(a["tpot_s"]) / min(b["tpot_s"]), 3)
    out["speedup_paired_median"] = round(statistics.median(x / y for x, y in zip(a["tpot_s"], b["tpot_s"])), 3)
    out["goal"] = GOAL
    out["tokens_equal_before_first_difference"] = [agreement(x, y) for x, y in zip(a["token_ids"], b["token_ids"])]
    if kv_bytes_per_token is not None and "weight_bytes" in a:
        out["weight_bytes"] = a["weight_bytes"]
        out["byte_bound"] = byte_bound(a["weight_bytes"], kv_bytes_per_token, context)
    return out


def render_table(result: dict):
    """The results as a ``rich.table.Table``."""
    from rich.table import Table

    c, m = result["config"], result["machine"]
    table = Table(title=f"batch-1 decode at a {c['context']}-token context, {c['output_len']} tokens, bfloat16 "
                        f"activations, KV cache bfloat16 (auto) vs int8; goal int8 >= {GOAL}x; byte bound: "
                        f"(weights + bf16 KV) / (weights + int8 KV)",
                  caption=f"{machine_line(m)}; load average {result['load_before']} -> {result['load_after']}; "
                          f"{c['rounds']} rounds")
    for col in ("part", "cache", "KV B/token", "best", "median", "int8 speed", "byte bound", "note"):
        table.add_column(col, justify="left" if col in ("part", "cache", "note") else "right")
    k = result.get("kernel")
    for weights, e in (result.get("engine") or {}).items():
        for kv in CACHES:
            speed = f"{e['speedup_best']:.2f}x (paired {e['speedup_paired_median']:.2f}x)" if kv == "int8" else "-"
            bound = f"{e['byte_bound']:.2f}x" if kv == "int8" and "byte_bound" in e else "-"
            note = (f"weights {e.get('weight_bytes', 0) / 1e6:.0f} MB; TTFT {e[kv]['ttft_median_s']} s" + (
                f"; tokens = bf16's before the first difference: {e['tokens_equal_before_first_difference']}"
                if kv == "int8" else ""))
            table.add_row(f"engine TPOT ms, {weights} weights", kv, str(result["kv_bytes_per_token"][kv]),
                          f"{e[kv]['tpot_best_ms']:.2f}", f"{e[kv]['tpot_median_ms']:.2f}", speed, bound, note)
    if k is not None:
        for kv in CACHES:
            table.add_row("attention ms/step", kv, str(result["kv_bytes_per_token"][kv]), f"{k[kv]['best_ms']:.3f}",
                          f"{k[kv]['median_ms']:.3f}", f"{k['ratio']:.2f}x" if kv == "int8" else "-",
                          "2.00x" if kv == "int8" else "-", f"{c['num_layers']} layers, paged C kernel")
    return table


@app.command()
def main(
    model: Annotated[str, typer.Option(help="HF model folder")] = DEFAULT_MODEL_DIR,
    context: Annotated[int, typer.Option(help="prompt tokens (the context decode runs at)")] = 4096,
    output_len: Annotated[int, typer.Option(help="greedy tokens per request")] = 64,
    rounds: Annotated[int, typer.Option(help="measurements per cache (alternating)")] = 3,
    engine: Annotated[bool, typer.Option(help="the engine part (off: the kernel part only)")] = True,
    weights: Annotated[str, typer.Option(help=f"the engine part's weights rows, comma-separated, of "
                                              f"{', '.join(WEIGHTS)}")] = ",".join(WEIGHTS),
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Batch-1 decode TPOT at a long context, int8 KV cache against bfloat16; prints a table."""
    from rich.console import Console
    from transformers import AutoConfig, AutoTokenizer

    from tpengine.backends import kv_quant
    from tpengine.model.plan import ShardPlan

    if context < 16 or output_len < 2 or rounds < 1:
        raise typer.BadParameter(f"--context must be >= 16, --output-len >= 2, --rounds >= 1; got {context}, "
                                 f"{output_len}, {rounds}")
    rows = [w.strip() for w in weights.split(",") if w.strip()]
    if not rows or any(w not in WEIGHTS for w in rows):
        raise typer.BadParameter(f"--weights must name some of {', '.join(WEIGHTS)}; got {weights!r}")
    console = Console(width=max(Console().width, 160))
    machine, cores = machine_info(), cpu_cores()
    console.print(f"machine: {machine_line(machine)}")
    cfg = AutoConfig.from_pretrained(model)
    plan = ShardPlan.build(cfg, 1)
    rp, layers = plan.ranks[0], int(cfg.num_hidden_layers)
    load_before = round(os.getloadavg()[0], 2)
    result = {"config": {"model": model, "context": context, "output_len": output_len, "rounds": rounds,
                         "num_layers": layers, "tp": 1, "dtype": "bfloat16", "weights": rows},
              "machine": machine, "load_before": load_before,
              "kv_bytes_per_token": {kv: kv_quant.bytes_per_token(layers, rp.num_kv_heads, plan.head_dim, 2, kv)
                                     for kv in CACHES}}
    if engine:
        prompt = long_prompt(AutoTokenizer.from_pretrained(model), context)
        result["engine"] = {}
        with tempfile.TemporaryDirectory() as logdir:
            for w in rows:  # one weights row at a time: its two workers load, run and close
                result["engine"][w] = summarize(engine_runs(model, prompt, output_len, rounds, cores, Path(logdir),
                                                            console.print, w),
                                                result["kv_bytes_per_token"], context + output_len / 2)
    result["kernel"] = kernel_times(layers, list(rp.q_to_kv), plan.head_dim, context, max(rounds, 3))
    result["load_after"] = round(os.getloadavg()[0], 2)
    emit(console, render_table(result), result, out)


if __name__ == "__main__":
    app()
