"""The one set-up path of every entry point: the batch job (:mod:`tpengine.entrypoints.run`), the
server (:mod:`tpengine.entrypoints.serve`) and the Python API (:class:`tpengine.entrypoints.llm.LLM`).

Each of them, in this order: takes rank and world size from torchrun's environment
(:func:`rank_and_world`); turns the config file and its flags or keyword settings into one frozen
:class:`tpengine.config.EngineConfig` whose ``model`` is the folder this launch loads (the
``{model}-tp{N}`` shard folder when it holds pre-split shards: :func:`resolve_model_dir`); checks
that folder (:func:`check_model`); merges the sampling defaults (the model's
``generation_config.json`` under the ``[sampling]`` table under the flags:
:func:`model_sampling_defaults`, :func:`sampling_defaults`) — all of it :func:`read_launch` —
and then, on every rank, builds the :class:`tpengine.engine.llm_engine.LLMEngine`, rank 0 first
printing the defaults line and the loading line (:func:`build_engine`). The entry points import
from here and never from each other. Under torchrun each of them first ties its rank's life to its
launcher (:func:`die_with_launcher`, through :func:`start_rank`), so no rank outlives a killed
``torchrun``.

Nothing here imports torch or the engine at import time, so ``tpengine run --help`` stays quick.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpengine.config import EngineConfig, load_config, read_config_file
from tpengine.entrypoints.generation_defaults import defaults_line, generation_defaults, merge_defaults
from tpengine.errors import UserError
from tpengine.model.checkpoint import check_model_folder
from tpengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tpengine.engine.data_parallel import DataParallelEngine
    from tpengine.engine.llm_engine import LLMEngine


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment (``RANK``, ``WORLD_SIZE``); (0, 1) without it."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_GUARD: dict[str, int] = {}  # "launcher": the pid die_with_launcher watches, once it is set up


def under_torchrun() -> bool:
    """Whether this process is a rank that ``torchrun`` (its elastic agent) started: the agent sets
    ``TORCHELASTIC_RUN_ID`` in every worker's environment. A plain ``tpengine run`` (tp=1, started
    by a shell) is not."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def die_with_launcher(poll_s: float = 0.5) -> bool:
    """Under torchrun, make this rank end (SIGKILL) once its launcher dies; elsewhere do nothing.

    torchrun starts each rank in a session of its own, so a ``kill -9`` of the launcher reaches no
    rank, and a rank blocked in a collective would live on. Two guards, set up once per process:

    - Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills this process when the thread
      that started it (torchrun's agent, which starts its workers from its main thread) exits. Then
      the parent pid is read again: a launcher that died before the ``prctl`` (a rank just started)
      already re-parented this process, and it ends at once.
    - a daemon thread that reads the parent pid every ``poll_s`` seconds and kills this process when
      it changed, for platforms without ``prctl`` and launchers whose worker-starting thread is not
      the launcher's life.

    SIGKILL and not SIGTERM: a rank of the server ignores SIGTERM (rank 0 drains and stops it), and
    a rank blocked in C code never runs a Python handler. Nothing is lost that was finished: rank 0
    appends and flushes ``--out`` one record at a time, and ``--resume`` cuts a torn last line
    (:func:`tpengine.frontend.writer.read_done`).

    Returns True when the guard is in place (now or by an earlier call), False when this process
    is not a torchrun rank (or its parent is already init, pid 1: nothing to watch).
    """
    if "launcher" in _GUARD:
        return True
    if not under_torchrun():
        return False
    launcher = os.getppid()
    if launcher == 1:  # torchrun as a container's init, or already gone: nothing to watch
        return False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the watchdog alone
            pass
    if os.getppid() != launcher:  # the launcher died before the prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    _GUARD["launcher"] = launcher

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="tpengine-launcher-watchdog", daemon=True).start()
    return True


def end_rank(code: int) -> None:
    """The last call of the batch job and the server on a rank that ran: after a clean run (``code``
    0) under torchrun, end the
    stopped ranks of this job on this host (:func:`tpengine.forensics.end_stopped_ranks`: a rank stopped
    after the job's last collective fails no collective, so nothing else would end it), flush stdout and
    stderr, and leave with ``os._exit(code)``: the interpreter's teardown with torch and gloo loaded
    takes seconds, and a rank stopped in that window, with its peers gone, would outlive the job.
    Otherwise it returns (the caller exits as usual; after a failure torchrun ends the other ranks).
    Every record and file was written and closed before this."""
    if code != 0 or not under_torchrun():
        return
    from tpengine import forensics

    forensics.end_stopped_ranks()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def settings_mistake_exit(rank: int, error: BaseException, engine: dict[str, Any] | None = None) -> int:
    """Report a mistake found before the model loads (arguments, settings, request file) and return
    the exit code, 2. Every rank reads the same inputs and finds the same mistake; rank 0 says it
    (``error: ...`` on stderr) and returns at once. Another rank under torchrun first waits, for up to
    ``dist_timeout_s`` (``engine``'s, else :class:`tpengine.config.EngineConfig`'s default): if it
    returned first, torchrun would end rank 0 (SIGTERM) before it wrote its line. Once rank 0 exits,
    torchrun ends the waiting rank; if the wait runs out, rank 0 did not find this mistake (e.g. a
    different file on another node) and this rank says it itself, naming its rank."""
    if rank == 0 or not under_torchrun():
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    wait_s = (engine or {}).get("dist_timeout_s")
    if not isinstance(wait_s, (int, float)) or isinstance(wait_s, bool) or wait_s <= 0:
        wait_s = EngineConfig.dist_timeout_s
    time.sleep(wait_s)
    print(f"error (rank {rank}): {error}", file=sys.stderr, flush=True)
    return 2


def start_rank() -> tuple[int, int]:
    """The first call of every entry point: :func:`die_with_launcher` (under torchrun), then
    :func:`rank_and_world`'s (rank, world size)."""
    die_with_launcher()
    return rank_and_world()


def resolve_model_dir(model: str | os.PathLike, world_size: int, pp_size: int = 1) -> str:
    """``{model}-pp{pp_size}-tp{world_size}`` (with pipeline stages) or ``{model}-tp{world_size}`` when it
    holds pre-split shards (``manifest.json``), else ``model`` (a trailing ``/`` of ``model`` is ignored for
    the shard folder's name)."""
    base = str(model).rstrip("/")
    names = ([f"{base}-pp{pp_size}-tp{world_size}"] if pp_size > 1 else []) + [f"{base}-tp{world_size}"]
    for shards in map(Path, names):
        if (shards / "manifest.json").is_file():
            return str(shards)
    return str(model)


def check_model(folder: str | os.PathLike, missing_hint: str | None = None) -> None:
    """Check that ``folder`` is a model folder tpengine can read, before anything loads it
    (:func:`tpengine.model.checkpoint.check_model_folder`). ``missing_hint``: said in brackets
    after ``model folder '...' does not exist`` (the batch job's ``run `make model`, or pass --model``).

    Raises:
        UserError: one line naming the folder or file and what is wrong with it.
    """
    if missing_hint is not None and not Path(folder).exists():
        raise UserError(f"model folder {str(folder)!r} does not exist ({missing_hint})")
    check_model_folder(folder)


def sampling_defaults(config_path: str | os.PathLike | None, model_defaults: dict[str, Any] | None = None,
                      **cli: Any) -> dict[str, Any]:
    """SamplingParams defaults: non-None ``cli`` over the config file's ``[sampling]`` table over
    ``model_defaults`` (the model's generation_config.json:
    :func:`tpengine.entrypoints.generation_defaults.generation_defaults`).

    Raises:
        UserError: the config file's own faults (:func:`tpengine.config.read_config_file`: a missing
            file, an unknown table or key, ...) or an invalid value (naming both).
    """
    table: dict[str, Any] = {}
    if config_path is not None:
        try:
            table = read_config_file(config_path)["sampling"]
        except FileNotFoundError as e:
            raise UserError(str(e)) from None
    values = merge_defaults(model_defaults or {}, table, cli)
    try:
        SamplingParams(**values)
    except (TypeError, ValueError) as e:
        raise UserError(f"invalid sampling default: {e}") from e
    return values


def model_sampling_defaults(cfg: EngineConfig) -> tuple[dict[str, Any], str | None]:
    """(the SamplingParams defaults ``cfg.generation_config`` takes from the model folder
    ``cfg.model``, the line rank 0 prints about them or None).

    Raises:
        UserError: a bad ``--generation-config`` or generation_config.json (naming the file, the key
            and the value).
    """
    path, values = generation_defaults(cfg.generation_config, cfg.model)
    return values, defaults_line(path, values)


@dataclass(frozen=True)
class Launch:
    """What :func:`read_launch` settles before the model loads, the same on every rank.

    ``config``: the engine settings, ``model`` the folder this launch loads; ``model_name``: the
    model folder's name as given (without ``-tpN``: the name a run's records and the server
    report); ``sampling``: the SamplingParams defaults (flags over ``[sampling]`` over the model's
    generation_config.json); ``defaults_line``: what rank 0 prints about the model's defaults, or None.
    """

    config: EngineConfig
    model_name: str
    sampling: dict[str, Any]
    defaults_line: str | None


def read_launch(config_path: str | os.PathLike | None, engine_settings: dict[str, Any], world_size: int,
                sampling_cli: dict[str, Any] | None = None, check_folder: bool = True) -> Launch:
    """The settings of a launch of ``world_size`` ranks, in this order: the config file
    ``config_path``'s ``[engine]`` table with the non-None ``engine_settings`` (flags, keyword
    settings) over it (:func:`tpengine.config.load_config`), the parallel layout
    (``tensor_parallel_size`` set: :meth:`tpengine.config.EngineConfig.parallel_sizes`), ``model``
    replaced by the folder this launch loads (:func:`resolve_model_dir` for the TP size), that folder
    checked (:func:`check_model`; the caller does it later when ``check_folder`` is False, as the
    batch job does only once it knows a request needs the model), the sampling defaults
    (:func:`model_sampling_defaults`, then :func:`sampling_defaults` with ``sampling_cli``).

    Raises:
        FileNotFoundError: ``config_path`` does not exist.
        UserError: a bad config file, setting name, model folder, generation_config.json or
            sampling default, or a world size that is not data_parallel_size x tensor_parallel_size
            (one line naming the value).
        ValueError: an invalid engine setting value.
    """
    cfg = load_config(config_path, **engine_settings)
    dp, tp = cfg.parallel_sizes(world_size)  # UserError: the world is not dp x tp
    model_name = Path(cfg.model).name
    cfg = cfg.replace(model=resolve_model_dir(cfg.model, tp, cfg.pipeline_parallel_size), tensor_parallel_size=tp)
    if check_folder:
        check_model(cfg.model)
    model_defaults, line = model_sampling_defaults(cfg)
    return Launch(cfg, model_name, sampling_defaults(config_path, model_defaults, **(sampling_cli or {})), line)


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a Jinja file's text, or the template itself when ``value`` holds Jinja
    (``{{`` or ``{%``), as vLLM reads it; None: the tokenizer's own.

    Raises:
        UserError: no such file (and no Jinja in the value), or a file that cannot be read.
    """
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--chat-template: cannot read {value}: {e}") from None
    if "{{" in value or "{%" in value:
        return value
    raise UserError(f"--chat-template: no such file: {value} (give a Jinja template file, or the template text)")


def loading_line(cfg: EngineConfig, world: int) -> str:
    """The line rank 0 prints before the model loads (the ready line follows when it has):
    ``tpengine: loading DIR (tp N, dtype D) ...``, or ``(dp D x tp N, ...)`` with several replicas (and
    ``pp P x`` before ``tp`` with pipeline stages)."""
    import torch

    dp, tp = cfg.parallel_sizes(world)
    dtype = str(cfg.torch_dtype("cuda" if torch.cuda.is_available() else "cpu")).removeprefix("torch.")
    pp = f"pp {cfg.pipeline_parallel_size} x " if cfg.pipeline_parallel_size > 1 else ""
    return f"tpengine: loading {cfg.model} ({f'dp {dp} x ' if dp > 1 else ''}{pp}tp {tp}, dtype {dtype}) ..."


def failure_line(rank: int, world: int, exc: BaseException) -> str:
    """The line a rank prints when it fails: ``[tpengine rank R/W] failed: TYPE: MESSAGE``; when it
    failed inside a collective (one timed out, a peer is gone), the rank first writes its forensics
    report and the line says where (:func:`tpengine.forensics.collective_failure`: on rank 0, the
    ranks that did not arrive, the step, the collective and the reports' folder)."""
    from tpengine import forensics

    what = forensics.collective_failure(exc)
    return f"[tpengine rank {rank}/{world}] failed: {what or f'{type(exc).__name__}: {exc}'}"


def build_engine(cfg: EngineConfig, rank: int, world: int, defaults_line: str | None = None,
                 announce_loading: bool = True) -> LLMEngine | DataParallelEngine:
    """Every rank: build the engine of ``cfg``; rank 0 first prints ``defaults_line`` (when not
    None) and, with ``announce_loading``, :func:`loading_line` on stderr. With several data-parallel
    replicas, each replica's driver gets a :class:`tpengine.engine.data_parallel.DataParallelEngine`
    over its replica's engine (the front's routes the requests; the others follow its ticks); a TP
    worker gets its plain engine. Either way ``engine.is_driver`` says whether this rank is the front.

    Raises:
        tpengine.errors.UserError: the model folder does not fit the launch or the settings
            (``CheckpointMismatchError``, an unsupported architecture, ``max_model_len`` beyond the
            model's limit, a KV budget too small).
        FileNotFoundError: a file the model folder lacks (a safetensors file, the tokenizer).
    """
    from tpengine.engine.data_parallel import DataParallelEngine
    from tpengine.engine.llm_engine import LLMEngine

    if rank == 0:
        if defaults_line is not None:
            print(defaults_line, file=sys.stderr, flush=True)
        if announce_loading:
            print(loading_line(cfg, world), file=sys.stderr, flush=True)
    engine = LLMEngine(cfg)
    return DataParallelEngine(engine) if engine.tp.dp_size > 1 and engine.tp.is_driver else engine
