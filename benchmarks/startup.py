"""Whole-process time of a one-request, one-token job: ``tpengine.entrypoints.run`` against Hugging Face
(``from_pretrained`` + ``generate``), same model folder and dtype, each in a fresh process.

    python -m benchmarks.startup                                   (SmolLM2 float32 and the 1.1B shape bfloat16)
    python -m benchmarks.startup --model models/smollm2-135m-instruct --dtype float32 --cache warm

Both sides pay everything a user's job pays: interpreter start, imports, tokenizer, loading the
weights, one prefill and the output. tpengine runs with each ``--cache`` state of
``$TPENGINE_CACHE_DIR`` (tpengine's C kernel build and its measured choices):

* ``warm``: the caller's cache, as a second job finds it (run once first, untimed, to fill it);
* ``choices``: a fresh cache holding only the warm one's C kernel builds: the choices are as on a
  machine's first job, under the user's measuring budget or, without one, the job's
  (:func:`tpengine.backends.cpu.measured.measure_budget_s`: a one-token job measures nothing new);
* ``cold``: a fresh, empty cache: the C kernels are built too (what a first job pays after an edit of
  them, or on a machine set up without ``make setup``, which builds them ahead).

Runs alternate (HF, then tpengine in each state) ``--rounds`` times and the best of each is reported
with the ratio tpengine / HF, and where tpengine's best run's time went (:func:`breakdown`, from when
its log lines came): interpreter start and imports up to the loading line, loading (weights, the C
build, the measured choices), and the rest (the first step, the output, the exit). The ``choices``
state's loading less the ``warm`` one's is what measuring costs; ``cold``'s less ``choices``' the C build. ``--model
synth:tinyllama-1.1b`` builds that random-weight shape once under ``models/``
(:mod:`benchmarks.synth_model`).
"""

from __future__ import annotations

import json
import os
import shutil
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

#: The cache states tpengine runs in (module docstring).
CACHE_STATES = ("warm", "choices", "cold")
#: The default runs: SmolLM2 in float32, the 1.1B shape in bfloat16 (issue 59's start-up rows).
DEFAULT_RUNS = (("models/smollm2-135m-instruct", "float32"), ("synth:tinyllama-1.1b", "bfloat16"))

app = typer.Typer(add_completion=False)


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, dict[str, float]]:
    """Seconds ``cmd`` took and when its stderr lines of interest came (seconds from the start:
    ``loading`` at tpengine's loading line, ``ready`` at its ``model ready`` line). Raises
    CalledProcessError with the stderr's tail on failure."""
    t0 = time.perf_counter()
    marks: dict[str, float] = {}
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env=env or subprocess_env()) as p:
        for line in p.stderr:
            lines.append(line)
            for mark, text in (("loading", "tpengine: loading "), ("ready", "tpengine: model ready")):
                if line.startswith(text) and mark not in marks:
                    marks[mark] = time.perf_counter() - t0
        rc = p.wait()
    if rc != 0:
        raise subprocess.CalledProcessError(rc, cmd, None, "".join(lines)[-3000:])
    return time.perf_counter() - t0, marks


def fresh_cache(warm: Path, into: Path, keep_builds: bool) -> Path:
    """An empty cache folder ``into`` (removed first), holding copies of ``warm``'s C kernel builds
    (``cpu_kernels-*.so``) with ``keep_builds``."""
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    if keep_builds:
        for so in warm.glob("cpu_kernels-*.so"):
            shutil.copy2(so, into / so.name)
    return into


def resolve_model(model: str) -> Path:
    """``model`` as a folder: ``synth:<shape>`` is :func:`benchmarks.synth_model.build_synth_model`'s
    folder under ``models/`` (built the first time)."""
    if not model.startswith("synth:"):
        return Path(model)
    from benchmarks.synth_model import build_synth_model
    from tpengine.config import DEFAULT_MODEL_DIR

    return Path(build_synth_model(model.removeprefix("synth:"), Path("models"), Path(DEFAULT_MODEL_DIR))["path"])


def breakdown(marks: dict[str, float], total_s: float) -> dict[str, float] | None:
    """Where one tpengine job's ``total_s`` went, from :func:`timed`'s ``marks``: ``to_load_s``
    (interpreter, imports, settings, up to the loading line), ``load_s`` (to the ``model ready`` line:
    weights, the C build where the cache lacks it, the measured choices) and ``rest_s`` (the first
    step, the output, the exit); None where a line is missing."""
    if not {"loading", "ready"} <= set(marks):
        return None
    return {"to_load_s": round(marks["loading"], 2), "load_s": round(marks["ready"] - marks["loading"], 2),
            "rest_s": round(total_s - marks["ready"], 2)}


@app.command()
def main(
    model: Annotated[list[str], typer.Option(help="model folder(s), or synth:<shape> (benchmarks.synth_model); "
                                                  "default: SmolLM2 float32 and synth:tinyllama-1.1b bfloat16")] = [],  # noqa: B006
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16 (with --model; default per run)")] = "",
    cache: Annotated[list[str], typer.Option(help="tpengine's cache states: warm, choices, cold")] = [  # noqa: B006
        "warm", "choices", "cold"],
    rounds: Annotated[int, typer.Option(help="alternating rounds; best of each side")] = 3,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Print, per model, the best whole-process seconds of HF and tpengine per cache state and their ratio."""
    from tpengine.backends.cpu.cpu_library import cache_root

    bad = [c for c in cache if c not in CACHE_STATES]
    if bad or not cache:
        raise typer.BadParameter(f"--cache {bad[0] if bad else ''!r}: valid: {', '.join(CACHE_STATES)}")
    runs = [(m, dtype or "float32") for m in model] if model else list(DEFAULT_RUNS)
    warm_dir = cache_root()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "one.jsonl"
        prompts.write_text(json.dumps({"id": "one", "prompt": "The capital of France is", "max_tokens": 1,
                                       "temperature": 0}) + "\n")
        for name, dt in runs:
            m = resolve_model(name)
            hf_cmd = [sys.executable, "-c", HF_JOB, str(m), dt]
            tpe_cmd = [sys.executable, "-m", "tpengine.run", "--prompts", str(prompts), "--model", str(m),
                       "--dtype", dt, "--out", str(Path(tmp) / "out.jsonl"), "--max-model-len", "512"]
            # the user's budget (benchmarks.subprocess_env lifts it for the other benchmarks' workers)
            user = {"TPENGINE_MEASURE_BUDGET_S": os.environ.get("TPENGINE_MEASURE_BUDGET_S", "")}
            if "warm" in cache:  # fill the warm cache once, untimed, as an earlier job would have
                (Path(tmp) / "out.jsonl").unlink(missing_ok=True)
                timed(tpe_cmd, subprocess_env(TPENGINE_MEASURE_BUDGET_S="inf"))
            hf: list[float] = []
            tpe: dict[str, list[tuple[float, dict]]] = {c: [] for c in cache}
            for _ in range(rounds):
                hf.append(timed(hf_cmd)[0])
                for c in cache:
                    (Path(tmp) / "out.jsonl").unlink(missing_ok=True)
                    env = subprocess_env(**user)
                    if c != "warm":
                        env["TPENGINE_CACHE_DIR"] = str(fresh_cache(warm_dir, Path(tmp) / "cache", c == "choices"))
                    tpe[c].append(timed(tpe_cmd, env))
            row = {"model": str(m), "dtype": dt, "hf_s": round(min(hf), 3), "hf_all_s": hf, "tpengine": {}}
            for c, got in tpe.items():
                best_s, best_marks = min(got, key=lambda x: x[0])
                row["tpengine"][c] = {"s": round(best_s, 3), "ratio": round(best_s / min(hf), 3),
                                      "all_s": [s for s, _ in got], "breakdown": breakdown(best_marks, best_s)}
                print(f"{m} {dt} {c} cache: HF {min(hf):.2f} s, tpengine {best_s:.2f} s, tpengine / HF = "
                      f"{best_s / min(hf):.2f} (best of {rounds}); tpengine's {row['tpengine'][c]['breakdown']}",
                      flush=True)
            results.append(row)
    if out:
        out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    app()
