"""The main job: run every request of a JSONL file through the engine, one output line each.

    python -m tpengine.run --prompts examples/prompts.jsonl --config configs/smollm2-135m.toml
    torchrun --nproc_per_node=2 -m tpengine.run --prompts file.jsonl --out out.jsonl

Every rank parses the arguments and validates the whole request file before the model loads,
so on bad input all ranks exit with code 2 before any collective. Rank 0 tokenizes, writes one
flushed record per finished request (``--out``, default rank 0's stdout), shows progress and a
summary on stderr (with every rank's peak resident memory). A file with no request lines (only
blank ones) loads no model: rank 0 prints ``no requests in PATH: nothing to do`` and leaves
``--out`` empty; with ``--skip-invalid`` and every line invalid, rank 0 writes only the error
records, also without a model. Exit codes: 0 done
(per-request errors are records, not failures), 2 bad input or settings (a
:class:`tpengine.errors.UserError`), 1 any other failure.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path
from typing import Annotated, Any

import typer
from torch.distributed.elastic.multiprocessing.errors import record

from tpengine.config import EngineConfig, load_config
from tpengine.engine.sampling_params import SAMPLING_KEYS, SamplingParams
from tpengine.errors import UserError
from tpengine.frontend.job import drive
from tpengine.frontend.requests import (
    parse_requests,
)
from tpengine.frontend.writer import OutputWriter, read_done
from tpengine.memory import gather_peak_rss


def resolve_model_dir(model: str, world_size: int) -> str:
    """``{model}-tp{world_size}`` when it holds pre-split shards (``manifest.json``), else ``model``."""
    shards = Path(f"{str(model).rstrip('/')}-tp{world_size}")
    return str(shards) if (shards / "manifest.json").is_file() else str(model)


def sampling_defaults(config_path: str | os.PathLike | None, **cli: Any) -> dict[str, Any]:
    """SamplingParams defaults: the config file's ``[sampling]`` table, then non-None ``cli``.

    Raises:
        UserError: an unknown ``[sampling]`` key or an invalid value (names both).
    """
    values: dict[str, Any] = {}
    if config_path is not None and Path(config_path).is_file():
        try:
            table = tomllib.loads(Path(config_path).read_text()).get("sampling", {})
        except tomllib.TOMLDecodeError as e:
            raise UserError(f"config file {str(config_path)!r} is not valid TOML: {e}") from None
        unknown = sorted(set(table) - set(SAMPLING_KEYS))
        if unknown:
            raise UserError(f"{config_path}: unknown [sampling] key(s) {unknown}; "
                             f"valid: {', '.join(SAMPLING_KEYS)}")
        values.update(table)
    values.update({k: v for k, v in cli.items() if v is not None})
    try:
        SamplingParams(**values)
    except (TypeError, ValueError) as e:
        raise UserError(f"invalid sampling default: {e}") from e
    return values


def prepare(prompts: Path, out: Path | None, config: Path | None, resume: bool, skip_invalid: bool,
            sampling_cli: dict[str, Any], engine_cli: dict[str, Any], world_size: int):
    """Everything before the model loads, identical on every rank: (EngineConfig, requests,
    errors, model name). Raises UserError for bad arguments, settings or (without --skip-invalid) lines."""
    if resume and out is None:
        raise UserError("--resume needs --out (the file whose finished ids are skipped)")
    if out is not None:
        if out.is_dir():
            raise UserError(f"--out {str(out)!r} is a folder; give a file path")
        if not out.parent.is_dir():
            raise UserError(f"--out {str(out)!r}: folder {str(out.parent)!r} does not exist")
        if out.exists() and prompts.exists() and out.resolve() == prompts.resolve():
            raise UserError(f"--out {str(out)!r} is the --prompts file; it would be overwritten")
    defaults = sampling_defaults(config, **sampling_cli)
    try:
        requests, errors = parse_requests(prompts, defaults)
    except OSError as e:
        raise UserError(f"cannot read --prompts {str(prompts)!r}: {e}") from e
    if errors and not skip_invalid:
        lines = "\n".join(str(e) for e in errors)
        raise UserError(f"{lines}\n{len({e.line for e in errors})} invalid line(s) in {prompts}; "
                         "fix them, or pass --skip-invalid to run the rest")
    try:
        cfg = load_config(config, **engine_cli)
    except (OSError, ValueError) as e:
        raise UserError(str(e)) from e
    model_name = Path(cfg.model).name
    cfg = cfg.replace(model=resolve_model_dir(cfg.model, world_size))
    if not Path(cfg.model).is_dir():
        raise UserError(f"model folder {cfg.model!r} does not exist (run `make model`, or pass --model)")
    return cfg, requests, errors, model_name


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def _opt(name: str, help: str = "") -> Any:
    return typer.Option(name, help=help)


def _out_file(out: Path | None, resume: bool) -> tuple[OutputWriter, tuple[set[str], set[int]]]:
    done = read_done(out) if resume else (set(), set())
    return OutputWriter(out, append=resume), done


@record
def run_engine(cfg: EngineConfig, requests, errors, out: Path | None, resume: bool, model_name: str) -> int:
    """Every rank: build the engine and run; rank 0 drives and writes; every rank reports its
    peak memory to rank 0 for the summary. Returns the exit code: 0, or 2 after one line naming
    the rank for a :class:`tpengine.errors.UserError` (the model folder does not fit the launch or
    the settings: ``CheckpointMismatchError``, a missing file, an unsupported architecture,
    ``max_model_len`` too large), which is not recorded as a failure's traceback. Any other
    failure propagates (exit 1; torchrun's summary names the rank and, through ``@record``, the
    exception)."""
    from tpengine.engine.llm_engine import LLMEngine

    try:
        try:
            engine = LLMEngine(cfg)
        except FileNotFoundError as e:  # a file the model folder lacks: the user's to fix
            raise UserError(str(e)) from e
    except UserError as e:  # bad settings or model folder: one line, no traceback
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        print(f"[tpengine rank {rank}/{world}] failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 2
    if engine.is_driver:
        drive(engine, requests, errors, *_out_file(out, resume), model_name)
    else:
        engine.generate([])
        gather_peak_rss()
    engine.shutdown()
    return 0


@app.command()
def main(
    prompts: Annotated[Path, _opt("--prompts", "JSONL request file")],
    out: Annotated[Path | None, _opt("--out", "output JSONL (default: stdout of rank 0)")] = None,
    model: Annotated[str | None, _opt("--model", "HF model folder (DIR-tpN shards used if present)")] = None,
    config: Annotated[Path | None, _opt("--config", "configs/NAME.toml")] = None,
    resume: Annotated[bool, _opt("--resume", "skip ids already in --out, append the rest")] = False,
    skip_invalid: Annotated[bool, _opt(
        "--skip-invalid", "invalid lines become error records (with id '<id>#line<N>' when the id is "
        "already taken, e.g. a duplicate; --resume never counts them as done)")] = False,
    max_tokens: Annotated[int | None, _opt("--max-tokens", "default max_tokens per request (16)")] = None,
    temperature: Annotated[float | None, _opt("--temperature", "default temperature (1.0; 0 = greedy)")] = None,
    max_model_len: Annotated[int | None, _opt("--max-model-len")] = None,
    block_size: Annotated[int | None, _opt("--block-size")] = None,
    max_num_seqs: Annotated[int | None, _opt("--max-num-seqs")] = None,
    kv_cache_gb: Annotated[float | None, _opt("--kv-cache-gb", "KV cache GiB per rank (CPU)")] = None,
    dtype: Annotated[str | None, _opt("--dtype", "auto (bf16 on CUDA), float32, bfloat16, float16")] = None,
    threads: Annotated[int | None, _opt("--threads", "intra-op threads per rank (default cores / tp)")] = None,
    max_num_batched_tokens: Annotated[int | None, _opt(
        "--max-num-batched-tokens", "most tokens computed in one step (default 2048); longer prompts are "
        "prefilled in chunks")] = None,
    enable_prefix_caching: Annotated[bool | None, typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="share the KV cache of prompt prefixes between requests (default on)")] = None,
    enable_chunked_prefill: Annotated[bool | None, typer.Option(
        "--enable-chunked-prefill/--no-enable-chunked-prefill",
        help="prefill a prompt longer than --max-num-batched-tokens in chunks (default on)")] = None,
) -> None:
    """Run every request in --prompts; one JSON line per request on --out."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    engine_cli = {"model": model, "max_model_len": max_model_len, "block_size": block_size,
                  "max_num_seqs": max_num_seqs, "kv_cache_gb": kv_cache_gb, "dtype": dtype, "threads": threads,
                  "max_num_batched_tokens": max_num_batched_tokens, "enable_prefix_caching": enable_prefix_caching,
                  "enable_chunked_prefill": enable_chunked_prefill}
    try:
        cfg, requests, errors, model_name = prepare(prompts, out, config, resume, skip_invalid,
                                                    {"max_tokens": max_tokens, "temperature": temperature},
                                                    engine_cli, world)
    except UserError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    if not requests:  # nothing for the model: every rank decides this alike, before any collective
        if rank == 0:
            try:
                if errors:  # --skip-invalid and every line invalid: just the error records
                    lines = len({e.line for e in errors})
                    print(f"no valid requests in {prompts}: writing {lines} error record(s), no model loaded",
                          file=sys.stderr)
                    drive(None, requests, errors, *_out_file(out, resume), model_name)
                else:
                    OutputWriter(out, append=resume).close()  # an empty --out (kept as is with --resume)
                    print(f"no requests in {prompts}: nothing to do", file=sys.stderr)
            except OSError as e:
                print(f"error: cannot write --out {str(out)!r}: {e}", file=sys.stderr)
                raise typer.Exit(2) from None
        raise typer.Exit(0)
    try:
        code = run_engine(cfg, requests, errors, out, resume, model_name)
    except Exception as e:
        print(f"[tpengine rank {rank}/{world}] failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    raise typer.Exit(code)


if __name__ == "__main__":
    app()
