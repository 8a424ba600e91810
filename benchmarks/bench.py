"""Benchmark: tpengine at tp=1 and tp=2 against Hugging Face ``generate``, same model, same prompts.

    python -m benchmarks.bench --out bench-results.json            (make bench)
    python -m benchmarks.bench --dtype bfloat16 --num-prompts 16 --rounds 2

In the bfloat16 group, tpengine also runs at every tp with weight-only quantized weights
(``--quantization`` int8 and int4 by default: ``EngineConfig.quantization``, quantized at load,
bfloat16 activations): their latency (TPOT, what weight-only quantization is for), and their
throughput too with ``--quantized-throughput`` (off by default, so that ``make bench`` stays under
10 minutes); every engine row reports its weight bytes per rank (the engine's
``ModelRunner.weight_bytes``). The output names the CPU model, its AMX / AVX512-BF16 / AVX-512
flags and the torch version (:mod:`benchmarks.machine`).

For every dtype, each system loads once in its own process(es) (:mod:`benchmarks.bench_worker`;
tp=2 under torchrun, each rank with cores / tp intra-op threads, HF with all cores) and the
driver alternates them, so machine noise hits all of them:

* offline throughput (the shape of vLLM's throughput benchmark): ``--num-prompts`` requests of
  random prompt token ids (fixed seed), ``--input-len`` in, exactly ``--output-len`` out
  (``ignore_eos`` / ``min_new_tokens``), greedy; output tokens/s = all output tokens / wall time;
* latency: one request, ``--latency-input-len`` in, ``--latency-output-len`` out: TTFT (arrival
  to first token) and TPOT = (latency - TTFT) / (output tokens - 1), vLLM's definitions.

With ``--rounds`` > 1 each round runs the systems in the opposite order of the previous one and
the table shows the best round (highest throughput, lowest latency); the JSON keeps every run.

Before any worker starts, the run measures the machine's roofline once (:mod:`benchmarks.roofline`;
``--no-roofline`` skips it): the triad bandwidth of one process with all cores and of tp processes
of cores / tp threads, and the GEMM rate per dtype at the workload's shapes. Every row then gets
``floor_ms`` (the bytes a batch-1 decode step reads in its precision / its layout's bandwidth),
``tpot_vs_floor`` and, with a throughput run, ``flops_fraction`` (2 x matmul weights x tokens/s over
the GEMM rate); the JSON keeps the measured limits under ``roofline``.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Annotated

import torch
import typer

import benchmarks
from benchmarks import emit, subprocess_env
from benchmarks.bench_report import add_limits, render_table, summarize
from benchmarks.bench_worker import MARK
from benchmarks.hf_system import HF_ATTN
from benchmarks.machine import cpu_cores, machine_info, machine_line  # noqa: F401 -- re-exported
from benchmarks.roofline import gemm_shapes, mean_context, measure_roofline, model_tensors
from tpengine.config import DEFAULT_MODEL_DIR
from tpengine.errors import UserError
from tpengine.utils import cdiv

app = typer.Typer(add_completion=False)

#: The quantized rows' group (their activation dtype) and their default schemes.
QUANT_DTYPE = "bfloat16"
QUANT_DEFAULT = ("int8", "int4")


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn uniformly from ``[0, vocab)`` (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


class Worker:
    """A running :mod:`benchmarks.bench_worker` (one process, or a torchrun group at tp > 1)."""

    def __init__(self, name: str, args: list[str], tp: int, log: Path, module: str = "benchmarks.bench_worker",
                 env: dict[str, str] | None = None):
        """Start ``python -m module args`` (at tp > 1 under torchrun), stderr to ``log``, in ``env``
        (default :func:`benchmarks.subprocess_env`); ``module`` speaks :mod:`benchmarks.bench_worker`'s
        protocol (:mod:`benchmarks.peer_worker` does too)."""
        self.name, self.log_path = name, log
        base = benchmarks.launcher(tp, module)
        env = env if env is not None else subprocess_env()
        self.log = open(log, "w")
        self.proc = subprocess.Popen(base + args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env, bufsize=1)
        self.ready: dict | None = None

    def read(self) -> dict:
        """The next ``@@bench`` line. Raises RuntimeError (with the log's tail) if the worker died."""
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        self.proc.wait()
        self.log.flush()
        tail = self.log_path.read_text()[-4000:]
        raise RuntimeError(f"bench worker {self.name} exited with code {self.proc.returncode}:\n{tail}")

    def choices(self) -> list[str]:
        """The measured choices rank 0 logged while loading (its ``tpengine: ...`` lines: linear
        layouts, kernels, greedy path), without the ``model ready`` line."""
        self.log.flush()
        return [line.strip() for line in self.log_path.read_text().splitlines()
                if line.startswith("tpengine: ") and not line.startswith("tpengine: model ready")]

    def send(self, cmd: dict) -> None:
        """Write ``cmd`` as one JSON line to the worker (its answer is :meth:`read`'s)."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def ask(self, cmd: dict) -> dict:
        """:meth:`send` ``cmd``, then :meth:`read` the answer."""
        self.send(cmd)
        return self.read()

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()


def dtype_systems(dtype: str, hf: bool, tps: list[int], quant_systems: list[str]) -> list[str]:
    """One dtype group's systems in the order they run: HF (with ``hf``), tpengine at each of ``tps``
    and, in the :data:`QUANT_DTYPE` group only, the quantized rows ``quant_systems``."""
    return (["hf"] if hf else []) + [system_key(t) for t in tps] + (quant_systems if dtype == QUANT_DTYPE else [])


def system_key(tp: int, quantization: str | None = None) -> str:
    """The key of tpengine at ``tp`` with ``quantization`` weights: "tp1", "tp2-int8", ..."""
    return f"tp{tp}" + (f"-{quantization}" if quantization else "")


def parse_system(system: str) -> tuple[int, str | None]:
    """``(tp, quantization)`` of a :func:`system_key` ("tp2-int4" -> (2, "int4")); "hf" -> (1, None)."""
    if system == "hf":
        return 1, None
    tp, _, quant = system.removeprefix("tp").partition("-")
    return int(tp), quant or None


def worker_args(hf: bool, tp: int, model: str, dtype: str, cores: int, num_seqs: int, max_len: int,
                hf_batch_size: int, hf_attn: str, engine_args: tuple[str, ...] = (),
                quantization: str | None = None, job_tokens: int = 0) -> list[str]:
    """The :mod:`benchmarks.bench_worker` arguments of HF generate (``hf``; all ``cores``) or of the
    engine at ``tp`` (cores / tp threads per rank, ``num_seqs`` sequences of up to ``max_len``
    tokens, KV blocks of 16 for all of them at once, ``quantization`` int8 / int4 weights or None,
    ``job_tokens`` the output tokens of the throughput workload, stated while it loads as a batch job of that
    work states them (0: none), then ``engine_args``)."""
    common = ["--model", model, "--dtype", dtype]
    if hf:
        return common + ["--system", "hf", "--threads", str(cores), "--hf-batch-size", str(hf_batch_size),
                         "--hf-attn", hf_attn]
    blocks = num_seqs * cdiv(max_len, 16) + 4
    quant = ["--quantization", quantization] if quantization else []
    return common + ["--system", "engine", "--max-num-seqs", str(num_seqs), "--max-model-len", str(max_len),
                     "--num-kv-blocks", str(blocks), "--threads", str(max(1, cores // tp)), *quant,
                     *(["--job-tokens", str(job_tokens)] if job_tokens else []), *engine_args]


def _attn_label(attn: dict) -> str:
    """`` (sdpa)`` for an HF run with a given attention implementation, else empty."""
    return f" ({attn['attn']})" if attn else ""


def run_dtype(dtype: str, systems: list[str], model: str, cores: int, prompts, lat_prompt, output_len: int,
              lat_output_len: int, rounds: int, hf_batch_size: int, hf_attn: str, logdir: Path, echo,
              latency_only: frozenset[str] = frozenset()) -> dict:
    """Start every system for ``dtype``, one after the other (each loads and warms up alone: a dozen
    processes loading at once on a few cores stall one another's OpenMP barriers), alternate the
    measurements,
    return ``{system: {"threads", "weight_bytes", "load_s", "throughput": [runs], "latency": [runs]}}``
    (``systems``: "hf" and :func:`system_key` keys; ``weight_bytes``: per rank; the systems in
    ``latency_only`` have no throughput runs)."""
    max_len = max(max(map(len, prompts)) + output_len, len(lat_prompt) + lat_output_len)
    # --hf-attn auto: HF runs each implementation on the measured workload itself and its best runs are
    # reported: over >= 2 rounds in turn (round r: HF_ATTN[r % 2]); in one round both, one after the
    # other (a choice timed once on a smaller workload and cached picked eager at half sdpa's rate)
    auto = hf_attn == "auto"
    per_round = auto and rounds >= 2
    workers: dict[str, Worker] = {}
    try:
        for s in systems:
            tp, quant = parse_system(s)
            # a throughput system loads as the batch job of its workload would (its measuring budget); a
            # latency-only one states nothing (a job of a few tokens would keep its weights plain)
            work = 0 if s in latency_only else len(prompts) * output_len
            args = worker_args(s == "hf", tp, model, dtype, cores, len(prompts), max_len, hf_batch_size,
                               HF_ATTN[0] if auto else hf_attn, quantization=quant, job_tokens=work)
            workers[s] = w = Worker(f"{s}/{dtype}", args, tp, logdir / f"{s}-{dtype}.log")
            w.ready = w.read()
        results = {}
        for s, w in workers.items():
            results[s] = {"threads": w.ready["threads"], "weight_bytes": w.ready.get("weight_bytes"),
                          "load_s": w.ready["load_s"], "throughput": [], "latency": [], "choices": w.choices()}
            for line in results[s]["choices"]:  # what the engine measured and chose on this machine
                echo(f"  {dtype} {s}: {line}")
        for r in range(rounds):
            order = systems if r % 2 == 0 else systems[::-1]
            # HF's attention implementations this round ({} = the one it started with)
            attns = [{"attn": HF_ATTN[r % 2]}] if per_round else [{"attn": a} for a in HF_ATTN] if auto else [{}]
            for s in [s for s in order if s not in latency_only]:
                for attn in attns if s == "hf" else [{}]:
                    res = workers[s].ask({"cmd": "throughput", "prompts": prompts, "output_len": output_len, **attn})
                    results[s]["throughput"].append(res)
                    echo(f"  {dtype} round {r + 1} {s:>8}: {res['output_tokens'] / res['elapsed_s']:8.1f} output "
                         f"tok/s ({res['elapsed_s']:.1f} s){_attn_label(attn)}")
            for s in order:
                for attn in attns if s == "hf" else [{}]:
                    res = workers[s].ask({"cmd": "latency", "prompt": lat_prompt, "output_len": lat_output_len,
                                          **attn})
                    results[s]["latency"].append(res)
                    tpot = (res["latency_s"] - res["ttft_s"]) / max(1, lat_output_len - 1)
                    echo(f"  {dtype} round {r + 1} {s:>8}: TTFT {res['ttft_s'] * 1e3:7.1f} ms, TPOT "
                         f"{tpot * 1e3:6.2f} ms{_attn_label(attn)}")
        return results
    finally:
        for w in workers.values():
            w.close()


@app.command()
def main(
    model: Annotated[str, typer.Option(help="HF model folder")] = DEFAULT_MODEL_DIR,
    num_prompts: Annotated[int, typer.Option(help="throughput: number of requests")] = 64,
    input_len: Annotated[int, typer.Option(help="throughput: prompt tokens per request")] = 128,
    output_len: Annotated[int, typer.Option(help="throughput: output tokens per request")] = 128,
    latency_input_len: Annotated[int, typer.Option(help="latency: prompt tokens")] = 128,
    latency_output_len: Annotated[int, typer.Option(help="latency: output tokens (>= 2)")] = 64,
    dtype: Annotated[list[str], typer.Option(help="repeat for several; each against HF in the same dtype")] = None,
    tp: Annotated[list[int], typer.Option(help="tpengine tensor-parallel sizes; repeat for several")] = None,
    hf: Annotated[bool, typer.Option(help="include the HF generate baseline")] = True,
    hf_batch_size: Annotated[int, typer.Option(help="HF static batch size (0 = all prompts)")] = 0,
    hf_attn: Annotated[str, typer.Option(help="HF attn_implementation: auto (with >= 2 rounds sdpa and "
                                               "eager in turn, one round both; the best shown), sdpa, "
                                               "eager")] = "auto",
    quantization: Annotated[list[str], typer.Option(help="weight-only quantized tpengine rows, at each --tp, in "
                                                         "the bfloat16 group (bfloat16 activations): int8, int4; "
                                                         "repeat for several; none for none")] = None,
    quantized_throughput: Annotated[bool, typer.Option(help="also run the quantized rows' throughput workload "
                                                            "(by default they report latency only)")] = False,
    rounds: Annotated[int, typer.Option(help="alternating rounds; the best one is reported")] = 2,
    roofline: Annotated[bool, typer.Option(help="measure the machine's triad bandwidth and GEMM rates first: "
                                                "each row's weight-bandwidth floor and FLOP fraction")] = True,
    threads: Annotated[int, typer.Option(help="total cores to use (0 = the affinity mask)")] = 0,
    seed: Annotated[int, typer.Option(help="seed of the random prompts")] = 0,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Throughput and latency of tpengine (tp=1, tp=2; float and int8/int4 weights) and HF generate; prints a table."""
    from rich.console import Console

    console = Console(width=max(Console().width, 190))  # the table is 14 columns wide
    dtypes, tps = dtype or ["float32", "bfloat16"], tp or [1, 2]
    quants = [q for q in (quantization or list(QUANT_DEFAULT)) if q != "none"]
    if latency_output_len < 2 or output_len < 1 or min(num_prompts, input_len, latency_input_len, rounds) < 1:
        raise typer.BadParameter("lengths, --num-prompts and --rounds must be >= 1 (--latency-output-len >= 2)")
    if hf_attn not in ("auto", "sdpa", "eager"):
        raise typer.BadParameter(f"--hf-attn {hf_attn!r} is not one of auto, sdpa, eager")
    from transformers import AutoConfig

    from tpengine.config import DTYPES, QUANTIZATIONS
    from tpengine.model.plan import ShardPlan
    from tpengine.model.quant.weights import QuantScheme, check_quantization

    bad_dtypes = [d for d in dtypes if d not in DTYPES]
    if bad_dtypes:
        raise typer.BadParameter(f"--dtype {bad_dtypes[0]!r} is not one of {', '.join(DTYPES)}")
    bad_quants = [q for q in quants if q not in QUANTIZATIONS]
    if bad_quants:
        raise typer.BadParameter(f"--quantization {bad_quants[0]!r} is not one of {', '.join(QUANTIZATIONS)}, none")
    try:
        hf_config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(f"--model {model!r}: cannot read its config.json ({e})") from None
    for t in tps:  # the same check the engine and tpengine-shard make, before any worker starts
        try:
            ShardPlan.build(hf_config, t)
        except ValueError as e:
            raise typer.BadParameter(f"--tp {t}: {e}") from None
        for q in quants:
            try:
                check_quantization(hf_config, t, QuantScheme.of(q))
            except (ValueError, UserError) as e:
                raise typer.BadParameter(f"--tp {t} --quantization {q}: {e}") from None
    if quants and QUANT_DTYPE not in dtypes:
        console.print(f"--quantization {', '.join(quants)}: skipped, its rows run in the {QUANT_DTYPE} group "
                      f"(--dtype {QUANT_DTYPE})")
    vocab = hf_config.vocab_size
    cores = threads or cpu_cores()
    for t in tps:
        if t > cores:
            console.print(f"[yellow]warning:[/] --tp {t} runs {t} ranks on {cores} core(s): oversubscribed, "
                          f"1 thread per rank; its figures are not representative")
    prompts = random_prompts(num_prompts, input_len, vocab, seed)
    lat_prompt = random_prompts(1, latency_input_len, vocab, seed + 1)[0]
    quant_systems = [system_key(t, q) for q in quants for t in tps]
    machine = machine_info()
    console.print(f"machine: {machine_line(machine)}")
    t0 = time.perf_counter()
    limits = None
    if roofline:  # before any worker starts: tp=1 and HF run 1 process x all cores, tp=N N x cores / N
        limits = measure_roofline([(t, max(1, cores // t)) for t in dict.fromkeys([1, *tps])],
                                  gemm_shapes(hf_config, num_prompts, input_len), cores, console.print)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="tpengine-bench-") as logdir:
        for dt in dtypes:
            systems = dtype_systems(dt, hf, tps, quant_systems)
            console.print(f"[bold]{dt}[/]: starting {', '.join(systems)}")
            runs[dt] = run_dtype(dt, systems, model, cores, prompts, lat_prompt, output_len, latency_output_len,
                                 rounds, hf_batch_size or num_prompts, hf_attn, Path(logdir), console.print,
                                 frozenset() if quantized_throughput else frozenset(quant_systems))
    result = {
        "config": {"model": model, "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
                   "latency_input_len": latency_input_len, "latency_output_len": latency_output_len,
                   "dtypes": dtypes, "tp": tps, "rounds": rounds, "seed": seed, "cores": cores,
                   "hf_batch_size": hf_batch_size or num_prompts, "hf_attn": hf_attn, "quantization": quants,
                   "quantized_dtype": QUANT_DTYPE, "quantized_throughput": quantized_throughput},
        "machine": machine,
        "roofline": limits,
        "results": summarize(runs, latency_output_len),
        "runs": runs,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    if limits:
        add_limits(result["results"], limits, model_tensors(hf_config),
                   mean_context(latency_input_len, latency_output_len), cores)
    emit(console, render_table(result), result, out)


if __name__ == "__main__":
    app()
