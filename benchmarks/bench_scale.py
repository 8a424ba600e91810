"""``make bench-scale``: memory and speed of HF and tpengine on random-weight models of real shapes.

    python -m benchmarks.bench_scale --out bench-scale.json
    python -m benchmarks.bench_scale --shapes tinyllama-1.1b --systems tp1 --requests 4

For every shape (:data:`benchmarks.synth_model.SHAPES`) it builds ``<models-dir>/synth-<name>``
once (skipped when present), then runs each system in its own process(es) through
:mod:`benchmarks.scale_worker` -- ``hf`` (``from_pretrained`` + ``generate``), ``tp1`` and ``tp2``
(tpengine, tp=2 under ``torchrun --nproc_per_node=2``), all bfloat16 -- one after another, so
each process's peak resident memory (VmHWM) is its own. A system whose estimated memory
(weights + KV + 1 GiB per rank, summed over ranks) exceeds ``MemAvailable`` is skipped with the
reason ("skipped: needs X GiB, Y available"). It prints a table and writes JSON (``--out``):

``{"config": {...flags}, "machine": {...}, "shapes": {name: {"path", "built", "build_s", "files",
"largest_file_bytes", "weight_bytes", "params", "build_peak_rss_bytes" (this driver's VmHWM after
building it: cumulative over the shapes before), "config": {sizes}} | {"error"}},
"results": {name: {system: {"status": "ok", "tp", "load_s", "ttft_ms", "tpot_ms", "output_tok_s",
..., "ranks": [{"rank", "peak_rss_bytes", "weight_bytes", "kv_bytes", "budget_bytes",
"within_budget"}]} | {"status": "skipped" | "failed", "reason"}}}, "total_s"}``
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

import benchmarks
from benchmarks import emit, subprocess_env
from benchmarks.bench import machine_info
from benchmarks.bench_worker import MARK
from benchmarks.scale_report import GIB, OVERHEAD_BYTES, render_table, summarize
from benchmarks.scale_worker import vm_hwm_bytes
from benchmarks.synth_model import SHAPES, SynthShape, build_synth_model

SYSTEMS = {"hf": 1, "tp1": 1, "tp2": 2, "tp1-shards": 1, "tp2-shards": 2}  # system -> ranks
# a "-shards" system loads the tpengine-shard split folder <model>-tp<N> (made once) instead of the full folder
DEFAULT_SHAPES = "tinyllama-1.1b,llama-2-7b"

app = typer.Typer(add_completion=False)


def parse_list(flag: str, value: str, valid) -> list[str]:
    """``value`` split at commas; raises typer.BadParameter naming the first unknown item."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise typer.BadParameter(f"{flag} {value!r} is empty; valid: {', '.join(valid)}")
    for v in items:
        if v not in valid:
            raise typer.BadParameter(f"{flag} {v!r} is not one of {', '.join(valid)}")
    return items


def mem_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where it is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def estimated_bytes(shape: SynthShape, system: str, requests: int, tokens: int, kv_cache_gb: float) -> int:
    """What ``system`` should need on ``shape`` in all, bytes: per rank its share of the weights,
    its KV (engine: ``kv_cache_gb``; HF: ``requests`` x ``tokens`` tokens) and 1 GiB, times the ranks."""
    ranks = SYSTEMS[system]
    kv = shape.kv_bytes_per_token() * requests * tokens if system == "hf" else int(kv_cache_gb * GIB)
    return ranks * (shape.weight_bytes() // ranks + kv + OVERHEAD_BYTES)


SPLIT_JOB = """
import json, sys
from shard_tool.split import split_model
from benchmarks.scale_worker import vm_hwm_bytes
split_model(sys.argv[1], int(sys.argv[2]), sys.argv[3], dtype="bfloat16")
print(json.dumps({"peak_rss_bytes": vm_hwm_bytes()}))
"""


def ensure_shards(model: str, tp: int, timeout_s: float) -> dict:
    """The ``tpengine-shard split`` folder ``<model>-tp<tp>``, made once in its own process (so its
    peak memory is its own): ``{"path", "built", "split_s", "split_peak_rss_bytes",
    "largest_tensor_bytes"}``. Raises subprocess.CalledProcessError when the split fails."""
    from tpengine.model.checkpoint import checkpoint_files
    from tpengine.model.tensor_file import read_header

    out = Path(f"{model}-tp{tp}")
    largest = max(i.nbytes for f in checkpoint_files(model) for i in read_header(Path(model) / f).values())
    info = {"path": str(out), "built": False, "split_s": None, "split_peak_rss_bytes": None,
            "largest_tensor_bytes": largest}
    if (out / "manifest.json").is_file():
        return info
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", SPLIT_JOB, model, str(tp), str(out)], capture_output=True, text=True,
                       env=subprocess_env(), timeout=timeout_s, check=True)
    info.update(built=True, split_s=round(time.perf_counter() - t0, 2),
                split_peak_rss_bytes=json.loads(r.stdout.strip().splitlines()[-1])["peak_rss_bytes"])
    return info


def run_system(system: str, model: str, args: list[str], log: Path, timeout_s: float) -> dict:
    """Run one system's worker to the end; its ``@@bench`` record, or ``{"status": "failed",
    "reason"}`` with the log's tail when it exits without one."""
    ranks = SYSTEMS[system]
    cmd = [*benchmarks.launcher(ranks, "benchmarks.scale_worker"), "--system", "hf" if system == "hf" else "engine",
           "--model", model]
    with open(log, "w") as err:
        try:
            proc = subprocess.run(cmd + args, stdout=subprocess.PIPE, stderr=err, text=True, env=subprocess_env(),
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "reason": f"timed out after {timeout_s} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return summarize(json.loads(line[len(MARK):]))
    tail = log.read_text()[-3000:]
    return {"status": "failed", "reason": f"worker exited with code {proc.returncode}:\n{tail}"}


@app.command()
def main(
    shapes: Annotated[str, typer.Option(help=f"comma-separated, of {', '.join(SHAPES)}")] = DEFAULT_SHAPES,
    systems: Annotated[str, typer.Option(help="comma-separated, of hf, tp1, tp2, tp1-shards, tp2-shards "
                                                  "(from a tpengine-shard split folder, made once)")] = "hf,tp1,tp2",
    requests: Annotated[int, typer.Option(help="requests, all submitted at once")] = 16,
    prompt_len: Annotated[int, typer.Option(help="prompt tokens per request (random ids, fixed seed)")] = 128,
    output_len: Annotated[int, typer.Option(help="output tokens per request (greedy, ignore_eos; >= 2)")] = 32,
    kv_cache_gb: Annotated[float, typer.Option(help="tpengine: KV cache GiB per rank")] = 0.25,
    max_model_len: Annotated[int, typer.Option(help="tpengine: prompt + output tokens")] = 512,
    models_dir: Annotated[Path, typer.Option(help="where synth-<shape> folders are built (once)")] = Path("models"),
    tokenizer_dir: Annotated[Path, typer.Option(help="the tokenizer files are copied from here")] =
        Path("models/smollm2-135m-instruct"),
    layers_per_file: Annotated[int, typer.Option(help="decoder layers per safetensors file (0: <= 1 GiB "
                                                      "files)")] = 0,
    seed: Annotated[int, typer.Option(help="seed of the weights and of the prompts")] = 0,
    timeout_s: Annotated[float, typer.Option(help="per system run, seconds")] = 3600.0,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Peak memory per rank, load time, TTFT, TPOT and output tokens/s of HF and tpengine tp=1/tp=2
    on random-weight models of named shapes; prints a table."""
    from rich.console import Console

    console = Console(width=max(Console().width, 160))
    shape_names = parse_list("--shapes", shapes, SHAPES)
    system_names = parse_list("--systems", systems, SYSTEMS)
    if min(requests, prompt_len) < 1 or output_len < 2:
        raise typer.BadParameter(f"--requests {requests} and --prompt-len {prompt_len} must be >= 1 and "
                                 f"--output-len {output_len} >= 2")
    if prompt_len + output_len > max_model_len:
        raise typer.BadParameter(f"--prompt-len {prompt_len} + --output-len {output_len} exceeds "
                                 f"--max-model-len {max_model_len}")
    if kv_cache_gb <= 0:
        raise typer.BadParameter(f"--kv-cache-gb {kv_cache_gb} must be > 0")
    t0 = time.perf_counter()
    built, results = {}, {}
    with tempfile.TemporaryDirectory(prefix="tpengine-bench-scale-") as logdir:
        for name in shape_names:
            shape = SHAPES[name]
            console.print(f"[bold]{name}[/]: {shape.num_params() / 1e9:.2f} B parameters, "
                          f"{shape.weight_bytes() / GIB:.2f} GiB in bfloat16")
            try:
                info = build_synth_model(name, models_dir, tokenizer_dir, layers_per_file=layers_per_file, seed=seed)
            except OSError as e:  # no disk space, a half-built folder, no tokenizer
                built[name] = {"error": str(e)}
                results[name] = {s: {"status": "skipped", "reason": f"cannot build: {e}"} for s in system_names}
                console.print(f"  [yellow]skipped[/]: {e}")
                continue
            built[name] = {**info, "build_peak_rss_bytes": vm_hwm_bytes(), "config": asdict(shape)}
            console.print(f"  {'built' if info['built'] else 'reusing'} {info['path']} ({info['files']} files, "
                          f"largest {info['largest_file_bytes'] / GIB:.2f} GiB, {info['build_s']} s)")
            args = ["--requests", str(requests), "--prompt-len", str(prompt_len), "--output-len", str(output_len),
                    "--vocab", str(shape.vocab_size), "--kv-cache-gb", str(kv_cache_gb),
                    "--max-model-len", str(max_model_len), "--seed", str(seed)]
            results[name] = {}
            for s in system_names:
                need, avail = estimated_bytes(shape, s, requests, prompt_len + output_len, kv_cache_gb), \
                    mem_available_bytes()
                if avail is not None and need > avail:
                    reason = f"needs {need / GIB:.1f} GiB, {avail / GIB:.1f} available"
                    results[name][s] = {"status": "skipped", "reason": reason}
                    console.print(f"  {s:>10}: skipped: {reason}")
                    continue
                model = info["path"]
                if s.endswith("-shards"):
                    split = ensure_shards(model, SYSTEMS[s], timeout_s)
                    built[name][f"split-tp{SYSTEMS[s]}"] = split
                    model = split["path"]
                    if split["built"]:
                        console.print(f"  split into {model} in {split['split_s']} s, peak "
                                      f"{split['split_peak_rss_bytes'] / GIB:.2f} GiB (largest tensor "
                                      f"{split['largest_tensor_bytes'] / GIB:.2f} GiB)")
                r = run_system(s, model, args, Path(logdir) / f"{name}-{s}.log", timeout_s)
                results[name][s] = r
                if r["status"] == "ok":
                    peaks = " / ".join(f"{k['peak_rss_bytes'] / GIB:.2f}" for k in r["ranks"])
                    console.print(f"  {s:>10}: load {r['load_s']:.1f} s, TTFT {r['ttft_ms']:.1f} ms, "
                                  f"TPOT {r['tpot_ms']:.2f} ms, {r['output_tok_s']:.1f} tok/s, peak {peaks} GiB")
                else:
                    console.print(f"  {s:>10}: [red]failed[/]: {r['reason']}")
    result = {
        "config": {"shapes": shape_names, "systems": system_names, "requests": requests, "prompt_len": prompt_len,
                   "output_len": output_len, "kv_cache_gb": kv_cache_gb, "max_model_len": max_model_len,
                   "dtype": "bfloat16", "models_dir": str(models_dir), "seed": seed},
        "machine": machine_info(),
        "shapes": built,
        "results": results,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    emit(console, render_table(result), result, out)
    if any(r["status"] == "failed" for systems_ in results.values() for r in systems_.values()):
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
