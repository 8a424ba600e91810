"""``make bench`` of two source trees side by side, for a before/after comparison on a noisy machine.

    python -m benchmarks.ab --before /path/to/old-checkout --after . [--runs 2] [--out ab.json]

A whole ``make bench`` takes about ten minutes, and a shared VM's speed drifts over that long (HF
generate, the same code in both trees, has moved 0.80-1.09x between two such runs). So this runs
:mod:`benchmarks.bench` one group of rows at a time (float32 HF + tp=1, float32 tp=2, bfloat16 HF +
tp=1 with its int8 / int4 rows, bfloat16 tp=2 with its quantized rows), each group in the two trees
in turn as A B B A (``--runs 2``; A B B A A B B A for 4 ...), one round per call, and reports for
every row the best of each tree's runs with after/before speeds (above 1 = the after tree is faster).
The two trees' calls of one group are minutes apart rather than a whole bench apart.

Each tree is run with this interpreter and its own folder first on ``PYTHONPATH``, with the
bench's defaults for the workloads. HF runs with ``--hf-attn sdpa`` (no per-tree measured choice).
Each tree gets its own ``TPENGINE_CACHE_DIR`` under ``--cache`` (default: a fresh temporary folder),
so neither reads measured choices the other, or an older busy machine, wrote.
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

#: (label, bench arguments) of each group of rows, run as one call per tree.
GROUPS = [
    ("float32 hf + tp1", ["--dtype", "float32", "--tp", "1", "--hf"]),
    ("float32 tp2", ["--dtype", "float32", "--tp", "2", "--no-hf"]),
    ("bfloat16 hf + tp1 (+ int8, int4)", ["--dtype", "bfloat16", "--tp", "1", "--hf"]),
    ("bfloat16 tp2 (+ int8, int4)", ["--dtype", "bfloat16", "--tp", "2", "--no-hf"]),
]

#: The figures compared, and which way is better.
METRICS = (("output_tok_s", max), ("ttft_ms", min), ("tpot_ms", min))


def order(runs: int) -> list[str]:
    """The trees' turns for ``runs`` calls each: A B B A repeated (``runs`` = 2: before, after, after,
    before). Raises ValueError for ``runs`` < 1."""
    if runs < 1:
        raise ValueError(f"--runs {runs}: need at least 1")
    turns = []
    for i in range(runs):
        turns += ["before", "after"] if i % 2 == 0 else ["after", "before"]
    return turns


def best(results: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """``(dtype, system) -> {metric: best value}`` over bench JSON ``results`` objects
    (``{dtype: {system: {metric: value}}}``)."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for res in results:
        for dt, systems in res.items():
            for system, row in systems.items():
                o = out.setdefault((dt, system), {})
                for k, better in METRICS:
                    v = row.get(k)
                    if isinstance(v, (int, float)):
                        o[k] = better(o[k], v) if k in o else v
    return out


def table(before: dict, after: dict) -> tuple[list[str], float]:
    """Markdown rows comparing :func:`best`'s ``before`` and ``after``, and the worst speed (after /
    before for tok/s, before / after for latencies; above 1 = after faster)."""
    lines = ["| dtype | system | tok/s before | after | speed | TTFT ms before | after | speed "
             "| TPOT ms before | after | speed |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    worst = float("inf")
    for key in sorted(before, key=lambda k: (k[0] != "float32", k[1] != "hf", k[1])):
        if key not in after:
            continue
        x, y, cells = before[key], after[key], []
        for k, _ in METRICS:
            if k in x and k in y and x[k] > 0 and y[k] > 0:
                speed = y[k] / x[k] if k == "output_tok_s" else x[k] / y[k]
                worst = min(worst, speed)
                fmt = "{:.1f}" if k == "output_tok_s" else "{:.2f}"
                cells += [fmt.format(x[k]), fmt.format(y[k]), f"{speed:.2f}x"]
            else:
                cells += ["-", "-", "-"]
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return lines, worst


def main(before: Annotated[Path, typer.Option(help="the old source tree (a checkout with benchmarks/bench.py)")],
         after: Annotated[Path, typer.Option(help="the new source tree")] = Path("."),
         runs: Annotated[int, typer.Option(help="calls per tree and group (best one reported)")] = 2,
         cache: Annotated[Path, typer.Option(help="parent of the two trees' TPENGINE_CACHE_DIR "
                                                  "(default: a fresh temporary folder)")] = None,
         out: Annotated[Path, typer.Option(help="write every call's results and the table as JSON here")] = None,
         group: Annotated[list[str], typer.Option(help="run only the groups whose label contains this "
                                                       "(repeat for several; default: all)")] = None,
         ) -> None:
    """Run each group of ``make bench`` rows in both trees in turn and print the before/after table."""
    trees = {"before": before.resolve(), "after": after.resolve()}
    for name, tree in trees.items():
        if not (tree / "benchmarks" / "bench.py").is_file():
            raise typer.BadParameter(f"--{name} {tree}: no benchmarks/bench.py there")
    try:
        turns = order(runs)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    groups = [(label, args) for label, args in GROUPS if not group or any(g in label for g in group)]
    if not groups:
        raise typer.BadParameter(f"--group {group}: no group matches; the groups: {[g for g, _ in GROUPS]}")
    cache = (cache or Path(tempfile.mkdtemp(prefix="tpengine-ab-"))).resolve()
    calls, results = [], {"before": [], "after": []}
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="tpengine-ab-") as tmp:
        for label, args in groups:
            for i, name in enumerate(turns):
                path = Path(tmp) / f"{len(calls)}.json"
                env = {**os.environ, "PYTHONPATH": str(trees[name]), "TPENGINE_CACHE_DIR": str(cache / name)}
                cmd = [sys.executable, "-m", "benchmarks.bench", *args, "--rounds", "1", "--hf-attn", "sdpa",
                       "--out", str(path)]
                t0 = time.time()
                proc = subprocess.run(cmd, cwd=trees[name], env=env, capture_output=True, text=True)
                took = time.time() - t0
                print(f"{label}: {name} {i + 1}/{len(turns)} rc={proc.returncode} {took:.0f} s", flush=True)
                if proc.returncode != 0:
                    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
                    raise typer.Exit(1)
                res = json.loads(path.read_text())["results"]
                results[name].append(res)
                calls.append({"group": label, "tree": name, "seconds": round(took, 1), "results": res})
    lines, worst = table(best(results["before"]), best(results["after"]))
    print("\n".join(lines))
    print(f"worst {worst:.3f}; {len(calls)} calls in {time.time() - start:.0f} s")
    if out:
        out.write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "runs": runs, "calls": calls,
                                   "table": lines, "worst": worst}, indent=1))


if __name__ == "__main__":
    typer.run(main)
