"""Whole-process time of a one-request, one-token job: ``tpengine.entrypoints.run`` against Hugging Face
(``from_pretrained`` + ``generate``), same model folder and dtype, each in a fresh process.

    python -m benchmarks.startup --model models/smollm2-135m-instruct --dtype float32

Both sides pay everything a user's job pays: interpreter start, imports, tokenizer, loading the
weights, one prefill and the output. Runs alternate (HF, tpengine, HF, ...) ``--rounds`` times
and the best of each is reported, with the ratio tpengine / HF.
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

from benchmarks import subprocess_env

HF_JOB = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, dtype = sys.argv[1], getattr(torch, sys.argv[2])
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
ids = tok("The capital of France is", return_tensors="pt")
out = model.generate(**ids, max_new_tokens=1, do_sample=False)
print(tok.decode(out[0, ids["input_ids"].shape[1]:]))
"""

app = typer.Typer(add_completion=False)


def timed(cmd: list[str]) -> float:
    """Seconds ``cmd`` took (raises CalledProcessError with its stderr on failure)."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env())
    if r.returncode != 0:
        raise subprocess.CalledProcessError(r.returncode, cmd, r.stdout, r.stderr[-3000:])
    return time.perf_counter() - t0


@app.command()
def main(
    model: Annotated[list[Path], typer.Option(help="model folder(s)")] = [Path("models/smollm2-135m-instruct")],  # noqa: B006
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16")] = "float32",
    rounds: Annotated[int, typer.Option(help="alternating rounds; best of each side")] = 3,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Print, per model, the best whole-process seconds of HF and tpengine and their ratio."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "one.jsonl"
        prompts.write_text(json.dumps({"id": "one", "prompt": "The capital of France is", "max_tokens": 1,
                                       "temperature": 0}) + "\n")
        for m in model:
            hf_cmd = [sys.executable, "-c", HF_JOB, str(m), dtype]
            tpe_cmd = [sys.executable, "-m", "tpengine.run", "--prompts", str(prompts), "--model", str(m),
                       "--dtype", dtype, "--out", str(Path(tmp) / "out.jsonl"), "--max-model-len", "512"]
            hf, tpe = [], []
            for _ in range(rounds):
                hf.append(timed(hf_cmd))
                (Path(tmp) / "out.jsonl").unlink(missing_ok=True)
                tpe.append(timed(tpe_cmd))
            row = {"model": str(m), "dtype": dtype, "hf_s": min(hf), "tpengine_s": min(tpe),
                   "ratio": min(tpe) / min(hf), "hf_all_s": hf, "tpengine_all_s": tpe}
            results.append(row)
            print(f"{m} {dtype}: HF {row['hf_s']:.2f} s, tpengine {row['tpengine_s']:.2f} s, "
                  f"tpengine / HF = {row['ratio']:.2f} (best of {rounds})", flush=True)
    if out:
        out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    app()
