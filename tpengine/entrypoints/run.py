"""The main job (``tpengine run``): run every request of a JSONL file through the engine, one output line each.

    tpengine run --prompts examples/prompts.jsonl --config configs/smollm2-135m.toml
    python -m tpengine.run --prompts examples/prompts.jsonl      # the same command
    torchrun --nproc_per_node=2 -m tpengine.run --prompts file.jsonl --out out.jsonl

Every rank parses the arguments, validates the whole request file, the config file and the
model folder before the model loads, so on bad input all ranks exit with code 2 before any
collective. Rank 0 then opens its output files, still before the load: ``--out`` is locked
(``fcntl.flock``) for the job's lifetime, so a second job on it fails at once (rank 0 exits 2 and
torchrun stops the other ranks), and it is never one of the inputs (by device and inode). Rank 0
prints a line before the load and one when the model is ready, tokenizes, writes one flushed
record per finished request (``--out``, default rank 0's stdout), shows progress and a summary on
stderr (with every rank's peak resident memory; ``--summary-json`` writes it as JSON). A file with
no request lines (only blank ones) loads no model: rank 0 prints ``no requests in PATH: nothing to
do`` and leaves ``--out`` empty; with ``--skip-invalid`` and every line invalid, rank 0 writes only
the error records, also without a model. Exit codes: 0 done (per-request errors are records, not
failures), 2 bad input or settings (a :class:`tpengine.errors.UserError`), 1 any other failure.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TextIO

import typer
from torch.distributed.elastic.multiprocessing.errors import record

from tpengine.config import EngineConfig
from tpengine.engine.memory import gather_peak_rss
from tpengine.entrypoints.flags import engine_options, option
from tpengine.entrypoints.model_checks import check_flags_against_model
from tpengine.entrypoints.setup import (
    build_engine,
    check_model,
    end_rank,
    failure_line,
    rank_and_world,
    read_chat_template,
    read_launch,
    settings_mistake_exit,
    start_rank,
)
from tpengine.errors import UserError
from tpengine.frontend.job import drive
from tpengine.frontend.progress import ProgressReporter
from tpengine.frontend.request_file import RequestFile
from tpengine.frontend.requests import RequestError
from tpengine.frontend.writer import OutputWriter, read_done


@dataclass
class PreparedJob:
    """What :func:`prepare` settles before the model loads.

    ``config``, ``requests``, ``errors`` and ``model_name`` (the served model's name, without
    ``-tpN``) are the same on every rank. ``writer`` is rank 0's open, locked ``--out`` (stdout
    without ``--out``) and None on other ranks; ``done`` is what ``--out`` already holds on rank 0
    with ``--resume`` (``read_done``: ids, invalid-line numbers), else empty sets;
    ``summary_file`` is rank 0's open ``--summary-json`` (None without it, and on other ranks);
    ``defaults_line``: what rank 0 prints about sampling defaults taken from the model, or None;
    ``chat_template``: ``--chat-template``'s template (None: the tokenizer's).
    """

    config: EngineConfig
    requests: RequestFile  # the valid requests, read from the file again as the engine takes them
    errors: list[RequestError]
    model_name: str
    writer: OutputWriter | None = None
    done: tuple[set[str], set[int]] = field(default_factory=lambda: (set(), set()))
    summary_file: TextIO | None = None
    defaults_line: str | None = None
    chat_template: str | None = None

    def close(self) -> None:
        """Close (and unlock) rank 0's files; idempotent."""
        if self.writer is not None:
            self.writer.close()
        if self.summary_file is not None:
            self.summary_file.close()

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Rank 0: write ``summary`` (``drive``'s dict) to ``--summary-json`` as one JSON object."""
        if self.summary_file is not None:
            self.summary_file.seek(0)
            self.summary_file.truncate()
            self.summary_file.write(json.dumps(summary, indent=1) + "\n")
            self.summary_file.close()


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one file: the same device and inode when both exist (a hard
    or symbolic link counts), else the same resolved path."""
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def _check_out_path(flag: str, path: Path, inputs: dict[str, Path | None]) -> None:
    """One output path of the job: not a folder, in an existing folder, not one of ``inputs``.
    Raises UserError naming ``flag``, the path and what is wrong."""
    if path.is_dir():
        raise UserError(f"{flag} {str(path)!r} is a folder; give a file path")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {str(path)!r}: folder {str(path.parent)!r} does not exist")
    for other, p in inputs.items():
        if p is not None and _same_file(path, p):
            raise UserError(f"{flag} {str(path)!r} is the {other} file {str(p)!r}; it would be overwritten")


def _open_summary(path: Path) -> TextIO:
    """``--summary-json`` opened for writing (kept as is until the summary is written)."""
    try:
        return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666), "w", encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot write --summary-json {str(path)!r}: {e.strerror or e}") from None


def prepare(prompts: Path, out: Path | None, config: Path | None, resume: bool, skip_invalid: bool,
            sampling_cli: dict[str, Any], engine_cli: dict[str, Any], world_size: int, rank: int = 0,
            summary_json: Path | None = None) -> PreparedJob:
    """Everything before the model loads: the settings, the requests, the model folder (when a
    request needs it: :func:`tpengine.model.checkpoint.check_model_folder`) and, on rank 0 last, the
    output files opened (``--out`` locked; truncated unless ``resume``). Every input is
    checked before any output file is touched.

    Raises:
        UserError: bad arguments, settings, config file or model folder; (without
            ``skip_invalid``) invalid lines; on rank 0 an ``--out`` that another job holds or that
            cannot be written. One message naming the value (for invalid lines: one line each).
    """
    if resume and out is None:
        raise UserError("--resume needs --out (the file whose finished ids are skipped)")
    inputs = {"--prompts": prompts, "--config": config}
    if out is not None:
        _check_out_path("--out", out, inputs)
    if summary_json is not None:
        _check_out_path("--summary-json", summary_json, {**inputs, "--out": out})
    try:
        launch = read_launch(config, engine_cli, world_size, sampling_cli, check_folder=False)
    except UserError:
        raise
    except (OSError, ValueError) as e:  # a missing config file, an invalid setting value
        raise UserError(str(e)) from e
    cfg, defaults = launch.config, launch.sampling
    if cfg.pooling:
        raise UserError("runner pooling: the batch job generates text; embeddings come from `tpengine serve "
                        "--runner pooling` (POST /v1/embeddings) or LLM(..., runner=\"pooling\").embed")
    try:
        requests = RequestFile(prompts, defaults)  # every line validated, one at a time; none kept
        errors = requests.errors
    except OSError as e:
        raise UserError(f"cannot read --prompts {str(prompts)!r}: {e}") from e
    if errors and not skip_invalid:
        lines = "\n".join(str(e) for e in errors)
        raise UserError(f"{lines}\n{len({e.line for e in errors})} invalid line(s) in {prompts}; "
                         "fix them, or pass --skip-invalid to run the rest")
    if requests:  # a job without valid requests loads no model
        check_model(cfg.model, missing_hint="run `make model`, or pass --model")
        check_flags_against_model(cfg.model, cfg.reasoning_parser)  # its tags, before any output is touched
    job = PreparedJob(cfg, requests, errors, launch.model_name, defaults_line=launch.defaults_line)
    if rank == 0:  # the summary file first: a --summary-json that cannot be written leaves --out untouched
        new_summary = summary_json is not None and not summary_json.exists()
        job.summary_file = _open_summary(summary_json) if summary_json is not None else None
        try:
            job.writer = OutputWriter(out, append=resume)  # UserError: locked by another job, or not writable
            job.done = read_done(out) if resume else (set(), set())
        except BaseException:
            job.close()
            if new_summary:
                summary_json.unlink(missing_ok=True)
            raise
    return job


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


@contextmanager
def stated_work(tokens: int | None) -> Iterator[None]:
    """While the engine loads, ``$TPENGINE_JOB_TOKENS`` = ``tokens`` (the most the job generates; None:
    unbounded, nothing stated): the platform's measuring in proportion to the job, none for a one-token
    job (:func:`tpengine.backends.cpu.measured.job_budget_s`). The variable's earlier value (the user's,
    or none) comes back after."""
    before = os.environ.get("TPENGINE_JOB_TOKENS")
    if tokens is not None and before is None:
        os.environ["TPENGINE_JOB_TOKENS"] = str(tokens)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TPENGINE_JOB_TOKENS", None)


@record
def run_engine(job: PreparedJob) -> int:
    """Every rank: build the engine and run; rank 0 drives and writes through ``job.writer``
    (and ``--summary-json``); every rank reports its peak memory to rank 0 for the summary.
    Returns the exit code: 0, or 2 after one line naming the rank for a
    :class:`tpengine.errors.UserError` (the model folder does not fit the launch or the
    settings: ``CheckpointMismatchError``, a missing file, an unsupported architecture,
    ``max_model_len`` too large), which is not recorded as a failure's traceback. Any other
    failure propagates (exit 1; torchrun's summary names the rank and, through ``@record``, the
    exception)."""
    rank, world = rank_and_world()
    try:
        try:
            with stated_work(job.requests.max_new_tokens):
                engine = build_engine(job.config, rank, world, job.defaults_line)
        except FileNotFoundError as e:  # a file the model folder lacks: the user's to fix
            raise UserError(str(e)) from e
    except UserError as e:  # bad settings or model folder: one line, no traceback
        print(failure_line(rank, world, e), file=sys.stderr, flush=True)
        job.close()
        return 2
    if engine.is_driver:
        if job.chat_template is not None:  # messages lines are templated on rank 0, as the engine takes them
            engine.tokenizer.chat_template = job.chat_template
        job.write_summary(drive(engine, job.requests, job.errors, job.writer, job.done, job.model_name))
    else:
        engine.generate([])
        gather_peak_rss()
    engine.shutdown()
    return 0


@app.command()
@engine_options
def main(
    prompts: Annotated[Path, option("--prompts", "JSONL request file: simple lines or OpenAI Batch lines", False)],
    out: Annotated[Path | None, option(
        "--out", "output JSONL, one record per request; locked while the job runs", "stdout of rank 0")] = None,
    config: Annotated[Path | None, option(
        "--config", "TOML file: an [engine] table of engine settings and a [sampling] table of request "
        "defaults (flags override it), e.g. configs/smollm2-135m.toml", "none")] = None,
    resume: Annotated[bool, option("--resume", "skip ids already in --out, append the rest", "off")] = False,
    skip_invalid: Annotated[bool, option(
        "--skip-invalid", "invalid lines become error records (with id '<id>#line<N>' when the id is "
        "already taken, e.g. a duplicate; --resume never counts them as done)", "off")] = False,
    summary_json: Annotated[Path | None, option(
        "--summary-json", "also write the run summary (requests, tokens, throughput, latency percentiles, "
        "peak memory per rank) to this file as JSON", "none")] = None,
    max_tokens: Annotated[int | None, option(
        "--max-tokens", "default max_tokens of a request that sets none",
        "16 (completions); chat: the rest of the context")] = None,
    temperature: Annotated[float | None, option(
        "--temperature", "default temperature of a request that sets none (0 = greedy)", "1.0")] = None,
    chat_template: Annotated[str | None, option(
        "--chat-template", "a Jinja chat template file (or the template text) used instead of the tokenizer's "
        "own, e.g. one that renders tools", "the tokenizer's")] = None,
    *,
    engine: dict[str, Any],
) -> None:
    """Run every request in --prompts; one JSON line per request on --out.

    Exit codes: 0 the job ran (a request's own failure is its error record), 2 a mistake found
    before the model loads (arguments, settings, config or request file, model folder, --out),
    or a setting the model cannot honour, 1 an internal failure."""
    rank, world = start_rank()
    try:
        template = read_chat_template(chat_template)
        job = prepare(prompts, out, config, resume, skip_invalid,
                      {"max_tokens": max_tokens, "temperature": temperature}, engine, world, rank, summary_json)
        job.chat_template = template
    except UserError as e:
        raise typer.Exit(settings_mistake_exit(rank, e, engine)) from None
    if not job.requests:  # nothing for the model: every rank decides this alike, before any collective
        if rank == 0:
            try:
                if job.errors:  # --skip-invalid and every line invalid: just the error records
                    lines = len({e.line for e in job.errors})
                    print(f"no valid requests in {prompts}: writing {lines} error record(s), no model loaded",
                          file=sys.stderr)
                    job.write_summary(drive(None, job.requests, job.errors, job.writer, job.done, job.model_name))
                else:  # an empty --out (kept as is with --resume), a summary of nothing
                    print(f"no requests in {prompts}: nothing to do", file=sys.stderr)
                    nothing = ProgressReporter(total=0, stream=io.StringIO())
                    job.write_summary(nothing.summary())
                    nothing.close()
            except OSError as e:
                print(f"error: cannot write --out {str(out)!r}: {e}", file=sys.stderr)
                raise typer.Exit(2) from None
            finally:
                job.close()
        raise typer.Exit(0)
    try:
        code = run_engine(job)
    except Exception as e:
        print(failure_line(rank, world, e), file=sys.stderr, flush=True)
        raise
    finally:
        job.close()
    end_rank(code)
    raise typer.Exit(code)


if __name__ == "__main__":
    app()
