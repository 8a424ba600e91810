"""One request at a time through two source trees, side by side: TTFT and TPOT of the engine at tp=1.

``python -m benchmarks.ab_latency --before DIR --after DIR [--cache DIR] [--requests 8]
[--prompt-len 128] [--output-len 64] [--config bfloat16 --config bfloat16:int4 --config float32]``

For each ``dtype[:quantization]`` it loads ``benchmarks.bench_worker`` from each tree four times, in the
order before, after, after, before (so a drift of the machine during the run falls on both trees alike),
sends ``--requests`` latency requests of one random prompt to each load, and prints, per tree, the
smallest TPOT and TTFT over its two loads (ms; TPOT = (latency - TTFT) / (output_len - 1)) and
speed = before / after (above 1: the after tree is faster). Each tree gets its own choice cache
(``--cache``/before, ``--cache``/after), so neither reuses the other's measurements. It is
``benchmarks.ab`` narrowed to the single-request latency rows, where a shared VM's noise is smallest.

Raises RuntimeError if a worker dies before it answers."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MARK = "@@bench "
ORDER = ("before", "after", "after", "before")


def _load(tree: Path, cache: Path, model: str, dtype: str, quant: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree), "TPENGINE_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-m", "benchmarks.bench_worker", "--system", "engine", "--model", model,
            "--dtype", dtype, "--max-num-seqs", "2", "--max-model-len", "256", "--num-kv-blocks", "40",
            "--threads", str(os.cpu_count() or 1)]
    if quant:
        args += ["--quantization", quant]
    return subprocess.Popen(args, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, bufsize=1)


def _read(p: subprocess.Popen) -> dict:
    for line in p.stdout:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"the bench worker exited ({p.wait()}) before it answered")


def measure(tree: Path, cache: Path, model: str, dtype: str, quant: str, prompt: list[int],
            output_len: int, requests: int) -> tuple[float, float]:
    """One load of the worker in ``tree``: (min TPOT ms, min TTFT ms) over ``requests`` requests."""
    p = _load(tree, cache, model, dtype, quant)
    try:
        _read(p)  # loaded
        tpot, ttft = [], []
        for _ in range(requests):
            p.stdin.write(json.dumps({"cmd": "latency", "prompt": prompt, "output_len": output_len}) + "\n")
            p.stdin.flush()
            r = _read(p)
            ttft.append(r["ttft_s"] * 1000)
            tpot.append((r["latency_s"] - r["ttft_s"]) / (output_len - 1) * 1000)
        p.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
        p.stdin.flush()
        p.wait(timeout=60)
        return min(tpot), min(ttft)
    finally:
        if p.poll() is None:
            p.kill()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/tpengine-ab-cache"))
    ap.add_argument("--model", default=str(Path("models/smollm2-135m-instruct").resolve()))
    ap.add_argument("--config", action="append", help="dtype[:quantization]; default bfloat16, "
                    "bfloat16:int4, float32")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    a = ap.parse_args(argv)
    import torch

    prompt = torch.randint(0, 49152, (a.prompt_len,), generator=torch.Generator().manual_seed(3)).tolist()
    trees = {"before": a.before.resolve(), "after": a.after.resolve()}
    for spec in a.config or ["bfloat16", "bfloat16:int4", "float32"]:
        dtype, _, quant = spec.partition(":")
        best: dict[str, tuple[float, float]] = {}
        for name in ORDER:
            got = measure(trees[name], a.cache / name, a.model, dtype, quant, prompt, a.output_len, a.requests)
            print(f"{spec} {name}: TPOT {got[0]:.2f} ms, TTFT {got[1]:.1f} ms", flush=True)
            best[name] = tuple(map(min, zip(best.get(name, got), got)))
        (bt, bT), (at, aT) = best["before"], best["after"]
        print(f"{spec}: TPOT before {bt:.2f} after {at:.2f} ms (speed {bt / at:.3f}x); "
              f"TTFT before {bT:.1f} after {aT:.1f} ms (speed {bT / aT:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
