"""``make eval-harness``: EleutherAI's lm-evaluation-harness (``lm-eval``) against ``tpengine serve``,
side by side with lm-eval's own ``hf`` backend on the same model, tasks and precision (float32).

Two small tasks shipped in ``benchmarks/eval_tasks/`` (local JSONL data, no hub):

* ``tpengine_capitals``, a loglikelihood (multiple-choice) task, through ``local-completions``
  with ``batch_size=4``: lm-eval sends token-id prompt lists with ``echo``, ``max_tokens`` 1 and
  ``logprobs`` 1, and scores each choice from the prompt logprobs;
* ``tpengine_arithmetic``, a generation task, through ``local-chat-completions`` with the chat
  template (greedy, stop strings).

lm-eval runs in its own virtual environment under ``$TPENGINE_CACHE_DIR`` (default
``~/.cache/tpengine``), installed on first use (torch from the local 2.13.0 wheel first, so pip
takes no CUDA build). Each ``--tp`` size starts a server on 127.0.0.1, runs both tasks, and stops
it. The table prints every score and whether it equals the ``hf`` backend's; the exit status is 1
when one does not.

Usage: ``python -m benchmarks.eval_harness [--tp 1,2] [--out eval-harness.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"
TASKS = REPO / "benchmarks" / "eval_tasks"
LM_EVAL = "lm-eval[api]==0.4.13"
#: (task, lm-eval model for the server, the server endpoint, batch size, chat template)
RUNS = [("tpengine_capitals", "local-completions", "/v1/completions", 4, False),
        ("tpengine_arithmetic", "local-chat-completions", "/v1/chat/completions", 1, True)]
METRICS = {"tpengine_capitals": ("acc,none", "acc_norm,none"), "tpengine_arithmetic": ("exact_match,last-number",)}

#: Run inside lm-eval's venv: argv[1] = JSON of simple_evaluate's arguments; prints the results.
RUNNER = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
kw = json.loads(sys.argv[1])
tm = TaskManager(include_path=kw.pop("include_path"))
out = lm_eval.simple_evaluate(task_manager=tm, **kw)
print("RESULTS " + json.dumps(out["results"]))
"""


def cache_dir() -> Path:
    return Path(os.environ.get("TPENGINE_CACHE_DIR") or Path.home() / ".cache" / "tpengine")


def lm_eval_python() -> Path:
    """The python of lm-eval's venv, created and installed on first use."""
    venv = cache_dir() / "lm-eval-venv"
    py = venv / "bin" / "python"
    stamp = venv / ".installed"  # holds the requirement it was installed with
    if not (stamp.is_file() and stamp.read_text() == LM_EVAL):
        print(f"eval-harness: installing {LM_EVAL} into {venv} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        subprocess.run([*pip, "torch==2.13.0"], check=True)  # the local CPU wheel: no CUDA download
        subprocess.run([*pip, LM_EVAL, "transformers", "accelerate"], check=True)
        stamp.write_text(LM_EVAL)
    return py


def evaluate(py: Path, **kw) -> dict:
    """One ``lm_eval.simple_evaluate`` in lm-eval's venv; its ``results`` dict."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([str(py), "-c", RUNNER, json.dumps({"include_path": str(TASKS), **kw})], cwd=REPO, env=env,
                       capture_output=True, text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULTS ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"lm-eval failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(line[len("RESULTS "):])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tp: int, port: int, log: Path) -> subprocess.Popen:
    """``tpengine serve`` at ``tp`` on ``port`` (float32), once ``/health`` answers."""
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", f"--nproc_per_node={tp}", "-m", "tpengine.serve", "--port", str(port),
           "--model", str(MODEL_DIR), "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-gb", "0.5"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not come up:\n{log.read_text()[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="1,2", help="comma-separated tp sizes for the server (default 1,2)")
    ap.add_argument("--out", default="eval-harness.json", help="where to write every score as JSON")
    args = ap.parse_args(argv)
    tps = [int(x) for x in args.tp.split(",")]
    py = lm_eval_python()
    name = MODEL_DIR.name
    scores: dict[str, dict[str, dict[str, float]]] = {}
    t0 = time.monotonic()
    for task, _, _, batch, chat in RUNS:
        res = evaluate(py, model="hf", model_args=f"pretrained={MODEL_DIR},dtype=float32", tasks=[task],
                       batch_size=batch, device="cpu", apply_chat_template=chat)
        scores.setdefault("hf", {})[task] = res[task]
    for tp in tps:
        port = free_port()
        proc = start_server(tp, port, cache_dir() / f"eval-harness-server-tp{tp}.log")
        try:
            for task, model, path, batch, chat in RUNS:
                margs = (f"model={name},base_url=http://127.0.0.1:{port}{path},num_concurrent=1,max_retries=1,"
                         + (f"tokenizer={MODEL_DIR},tokenizer_backend=huggingface,tokenized_requests=True"
                            if not chat else "tokenizer_backend=None"))
                res = evaluate(py, model=model, model_args=margs, tasks=[task], batch_size=batch,
                               apply_chat_template=chat)
                scores.setdefault(f"tpengine tp={tp}", {})[task] = res[task]
        finally:
            proc.terminate()
            proc.wait(60)
    ok = True
    print(f"\n| task | metric | hf (lm-eval backend) | {' | '.join(f'tpengine serve tp={tp}' for tp in tps)} |")
    print("|---|---|---:|" + "---:|" * len(tps))
    for task, _, _, _, _ in RUNS:
        for metric in METRICS[task]:
            want = scores["hf"][task][metric]
            cells = []
            for tp in tps:
                got = scores[f"tpengine tp={tp}"][task][metric]
                ok &= got == want
                cells.append(f"{got:.4f}" + ("" if got == want else " (differs)"))
            print(f"| {task} | {metric.split(',')[0]} | {want:.4f} | {' | '.join(cells)} |")
    Path(args.out).write_text(json.dumps(scores, indent=1) + "\n")
    print(f"\neval-harness: {'every score equals' if ok else 'SOME SCORE DIFFERS FROM'} the hf backend's; "
          f"{time.monotonic() - t0:.0f} s; scores in {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
