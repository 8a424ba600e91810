"""Benchmark: structured outputs' cost on the server: concurrent JSON-schema requests against the
same requests unconstrained, in one run (issue 37).

    python -m benchmarks.bench_structured --out bench-structured.json          (make bench-structured)

Workload: the first ``--num-prompts`` (prompt, schema) pairs of :mod:`benchmarks.structured_schemas`,
each prompt through the model's chat template, greedy, all sent at once through ``POST
/v1/completions`` (streamed, as ``benchmarks.bench_serve``) to one server (``--tp`` ranks, engine
flags after ``--``). In order:

1. grammar compile time per schema, in this process with the server's library choice
   (``StructuredOutputManager``, backend auto): cold (first compile) and cached (the same schema
   again), and the tokenizer-vocabulary set-up once;
2. a first constrained round (the server compiles each schema then: its cold cost is in the TTFT);
3. ``--rounds`` pairs of: the constrained requests (schemas cached), then the same prompts
   unconstrained with ``ignore_eos`` and ``max_tokens`` equal to each one's constrained output
   length, so both sides make exactly the same tokens.

Reported: output tokens/s (all output tokens / wall time of the round) and TPOT p50 (ms) per side,
the best round of each; the ratio constrained / unconstrained (issue 37's goal: >= 0.85); every
constrained output is checked against its schema (``jsonschema``) and the count of valid ones given.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks import emit
from benchmarks.bench_serve import ServerProcess, free_port, stats_ms
from benchmarks.machine import machine_info, machine_line
from benchmarks.serve_client import RequestResult
from benchmarks.structured_schemas import SCHEMAS
from tpengine.config import DEFAULT_MODEL_DIR

app = typer.Typer(add_completion=False)


async def _round(url: str, bodies: list[dict]) -> tuple[list[RequestResult], list[str], float]:
    """All ``bodies`` at once: results, texts (from a second, non-streamed field: the chunks' text
    joined) and the wall time (s)."""
    import aiohttp

    texts = [""] * len(bodies)

    async def one(i: int, session) -> RequestResult:
        r = RequestResult()
        t0 = time.perf_counter()
        async with session.post(url + "/v1/completions", json=bodies[i]) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return r
            async for raw in resp.content:
                if not raw.startswith(b"data: ") or raw[6:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(raw[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    r.chunk_s.append(time.perf_counter() - t0)
                    texts[i] += chunk["choices"][0]["text"]
                elif chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
        r.latency_s = time.perf_counter() - t0
        return r

    connector = aiohttp.TCPConnector(limit=len(bodies) + 1)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, session) for i in range(len(bodies))))
        wall = time.perf_counter() - t0
    for r in results:
        if r.error:
            raise RuntimeError(r.error)
    return list(results), texts, wall


def _side(results: list[RequestResult], wall: float) -> dict:
    tokens = sum(r.output_tokens or 0 for r in results)
    tpot = [(r.latency_s - r.chunk_s[0]) / (r.output_tokens - 1) for r in results
            if r.chunk_s and (r.output_tokens or 0) > 1]
    return {"output_tokens": tokens, "wall_s": round(wall, 3), "output_tok_s": round(tokens / wall, 2),
            "tpot_ms": stats_ms(tpot), "ttft_ms": stats_ms([r.chunk_s[0] for r in results if r.chunk_s])}


def compile_times(model: str, schemas: list[dict]) -> dict:
    """Cold and cached compile seconds per schema, and the vocabulary set-up, in ms."""
    from transformers import AutoTokenizer

    from tpengine.structured import StructuredOutputManager, StructuredOutputsParams

    tok = AutoTokenizer.from_pretrained(model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    m = StructuredOutputManager(tok, vocab, [tok.eos_token_id])
    t0 = time.perf_counter()
    m.check(StructuredOutputsParams(json={"type": "object"}))
    setup = time.perf_counter() - t0
    cold, cached = [], []
    for s in schemas:
        for out in (cold, cached):
            t0 = time.perf_counter()
            m.check(StructuredOutputsParams(json=s))
            out.append(time.perf_counter() - t0)
    m.close()
    return {"vocab_setup_ms": round(setup * 1e3, 2), "cold_ms": stats_ms(cold), "cached_ms": stats_ms(cached)}


@app.command()
def main(
    tp: Annotated[int, typer.Option(help="tensor-parallel ranks of the server")] = 2,
    num_prompts: Annotated[int, typer.Option(help="concurrent requests (<= 50)")] = 32,
    max_tokens: Annotated[int, typer.Option(help="most tokens of a constrained output")] = 256,
    rounds: Annotated[int, typer.Option(help="constrained / unconstrained round pairs (the best of each)")] = 2,
    model: Annotated[str, typer.Option(help="model folder")] = DEFAULT_MODEL_DIR,
    out: Annotated[Path | None, typer.Option(help="write the results here as JSON")] = None,
    engine_args: Annotated[list[str] | None, typer.Argument(help="engine flags for the server (after --)")] = None,
) -> None:
    import jsonschema
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoTokenizer

    console = Console()
    pairs = SCHEMAS[:num_prompts]
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q, _ in pairs]
    compiled = compile_times(model, [s for _, s in pairs])
    args = ["--model", model, *(engine_args or [])]
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(tp, free_port(), args, Path(tmp) / "server.log")
        try:
            asyncio.run(_round(server.url, [{"prompt": prompts[0], "max_tokens": 4, "stream": True}]))  # warm-up
            base = {"temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
            constrained = [{**base, "prompt": p, "max_tokens": max_tokens, "structured_outputs": {"json": s}}
                           for p, (_, s) in zip(prompts, pairs)]
            first, texts, wall = asyncio.run(_round(server.url, constrained))
            cold = _side(first, wall)
            lengths = [r.output_tokens for r in first]
            plain = [{**base, "prompt": p, "max_tokens": n, "ignore_eos": True} for p, n in zip(prompts, lengths)]
            sides: dict[str, list[dict]] = {"constrained": [], "unconstrained": []}
            for _ in range(rounds):
                res, texts_again, wall = asyncio.run(_round(server.url, constrained))
                assert texts_again == texts, "greedy constrained outputs changed between rounds"
                sides["constrained"].append(_side(res, wall))
                res, _, wall = asyncio.run(_round(server.url, plain))
                sides["unconstrained"].append(_side(res, wall))
        finally:
            server.stop()
    valid = 0
    for text, (_, schema) in zip(texts, pairs):
        try:
            checker = jsonschema.FormatChecker()
            jsonschema.Draft202012Validator(schema, format_checker=checker).validate(json.loads(text))
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    best = {k: max(v, key=lambda s: s["output_tok_s"]) for k, v in sides.items()}
    ratio = best["constrained"]["output_tok_s"] / best["unconstrained"]["output_tok_s"]
    result = {"machine": machine_info(), "tp": tp, "num_prompts": len(pairs), "engine_args": engine_args or [],
              "compile": compiled, "first_constrained_round": cold, "rounds": sides, "best": best,
              "ratio": round(ratio, 3), "valid": valid, "outputs": texts}
    table = Table(title=f"structured outputs, {len(pairs)} concurrent requests, tp={tp}; "
                        f"{machine_line(result['machine'])}")
    for col in ("side", "output tok/s", "TPOT p50 ms", "TTFT p50 ms", "tokens"):
        table.add_column(col)
    for name, s in [("constrained, first (cold compiles)", cold), *best.items()]:
        table.add_row(name, f"{s['output_tok_s']:.1f}", f"{s['tpot_ms']['p50']:.1f}", f"{s['ttft_ms']['p50']:.1f}",
                      str(s["output_tokens"]))
    console.print(f"constrained / unconstrained output tok/s: {ratio:.3f} (goal >= 0.85); valid JSON: "
                  f"{valid}/{len(pairs)}; compile per schema: cold p50 {compiled['cold_ms']['p50']:.2f} ms, cached "
                  f"p50 {compiled['cached_ms']['p50']:.3f} ms; vocabulary set-up {compiled['vocab_setup_ms']:.0f} ms")
    emit(console, table, result, out)


if __name__ == "__main__":
    app()
