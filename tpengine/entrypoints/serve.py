"""The OpenAI-compatible server over the same tensor-parallel ranks as the batch job.

    tpengine serve --model DIR --host 127.0.0.1 --port 8000                  (tp=1)
    torchrun --nproc_per_node=2 -m tpengine.entrypoints.serve --model DIR --port 8000

Every rank builds the engine. Rank 0 runs the HTTP app (FastAPI on uvicorn) and, in a thread beside
it, the engine loop (:class:`tpengine.server.engine_loop.EngineLoop`); the other ranks follow its
broadcasts as in the batch job. SIGTERM or SIGINT: rank 0 stops accepting, lets in-flight requests
finish for up to ``--drain-timeout-s`` seconds, aborts the rest and sends STOP; every rank exits 0.
The other ranks ignore the signals (torchrun forwards them) and exit on STOP. If the engine fails
(a dead rank, a failed step) the server answers 503 and every rank exits non-zero.
Exit codes as the batch job's: 0, 2 a mistake found before the model loads (one ``error:`` line),
1 a failure.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from tpengine.entrypoints.flags import engine_options, option
from tpengine.entrypoints.model_checks import check_flags_against_model
from tpengine.entrypoints.setup import (
    build_engine,
    end_rank,
    failure_line,
    read_chat_template,
    read_launch,
    settings_mistake_exit,
    start_rank,
)
from tpengine.errors import UserError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a port in use is found at once.

    Raises:
        UserError: the address cannot be bound (naming host, port and the reason).
    """
    try:
        sock = socket.create_server((host, port), reuse_port=False)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def check_tool_flags(enable_auto: bool, parser: str | None) -> None:
    """``--enable-auto-tool-choice`` needs ``--tool-call-parser``, which must be a known parser.

    Raises:
        UserError: naming the flag and the valid parsers.
    """
    from tpengine.frontend.tool_parsers import TOOL_PARSERS

    if parser is not None and parser not in TOOL_PARSERS:
        raise UserError(f"--tool-call-parser: unknown parser {parser!r}; valid: {', '.join(TOOL_PARSERS)}")
    if enable_auto and parser is None:
        raise UserError(f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(TOOL_PARSERS)})")


def api_keys(flag: list[str] | None) -> list[str]:
    """The API keys the server requires: ``--api-key`` (each one given), else the environment's
    ``TPENGINE_API_KEY`` (one key), else none (no check). Empty strings are dropped, as vLLM does."""
    from tpengine.server.middleware import API_KEY_ENV

    return [k for k in (flag or [os.environ.get(API_KEY_ENV, "")]) if k]


def serve_rank0(engine, sock: socket.socket, model_name: str, defaults: dict[str, Any], drain_s: float,
                tool_parser: str | None = None, enable_auto_tool_choice: bool = False,
                keys: list[str] | None = None, metrics_prefix: str = "tpengine") -> int:
    """Rank 0: the app and the engine loop until a signal or an engine failure; ``keys``: the API keys
    every ``/v1`` route requires (none: open). Returns the exit code."""
    import uvicorn

    from tpengine.server.app import ServerState, build_app
    from tpengine.server.engine_loop import EngineLoop
    from tpengine.server.metrics import ServerMetrics

    metrics = ServerMetrics(model_name, metrics_prefix)
    loop = EngineLoop(engine, on_step=lambda stats, outs: metrics.observe_step(stats, outs, engine.replica_stats()))
    metrics.set_queue(engine.stats())
    cfg = engine.config
    metrics.set_cache_config({"block_size": cfg.block_size,
                              "cache_dtype": cfg.kv_cache_dtype if cfg.kv_cache_dtype != "auto" else cfg.dtype,
                              "enable_prefix_caching": cfg.enable_prefix_caching,
                              "gpu_memory_utilization": cfg.gpu_memory_utilization,
                              "num_gpu_blocks": engine.replica_stats()[0].num_total_blocks,
                              "engine": 0})
    state = ServerState(loop, engine.tokenizer, engine.vocab_size, engine.config.max_model_len, model_name,
                        metrics, defaults, int(time.time()), check_grammar=lambda c: engine.structured.check(c),
                        tool_parser=tool_parser, enable_auto_tool_choice=enable_auto_tool_choice,
                        reasoning_parser=engine.config.reasoning_parser,
                        runner="pooling" if engine.config.pooling else "generate")
    config = uvicorn.Config(build_app(state, keys or ()), log_level="warning", timeout_graceful_shutdown=drain_s + 3,
                            lifespan="off")
    server = uvicorn.Server(config)
    loop.start()

    async def watch() -> None:
        """An engine that died: answer 503 a moment, then stop the server. A shutdown (SIGTERM):
        after ``drain_s`` abort what is still running, so every open stream ends with its final
        chunk and ``[DONE]`` before uvicorn's own deadline closes the connections."""
        while not server.should_exit:
            if loop.dead is not None:
                await asyncio.sleep(1.0)
                server.should_exit = True
            await asyncio.sleep(0.25)
        await asyncio.sleep(drain_s)
        loop.abort_all()

    async def main() -> None:
        host, port = sock.getsockname()[:2]
        t = engine.tp
        layout = (f"dp {t.dp_size} x " if t.dp_size > 1 else "") + (f"pp {t.pp_size} x " if t.pp_size > 1 else "") \
            + f"tp {t.size}"
        auth = f", {len(keys)} API key(s) required on /v1" if keys else ""
        if engine.config.pooling:
            auth = f", runner pooling: {engine.config.pooler.pooling_type} pooling on /v1/embeddings" + auth
        print(f"tpengine: serving {model_name} on http://{host}:{port} ({layout}{auth})", file=sys.stderr,
              flush=True)
        watcher = asyncio.ensure_future(watch())
        await server.serve(sockets=[sock])
        watcher.cancel()

    # uvicorn handles SIGTERM / SIGINT while it serves (stop accepting, drain) and raises the signal
    # again afterwards under the handlers it found. Those set should_exit: a signal that comes before
    # uvicorn's handlers are in place stops the server as soon as it has started (it was lost when
    # they were a no-op), and the one raised again after the drain changes nothing, so it ends in exit 0
    def stop_serving(*_: Any) -> None:
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_serving)
    asyncio.run(main())
    if not loop.failed:
        loop.stop(drain_s)  # in-flight requests were drained by uvicorn; abort what is left, STOP
    return 1 if loop.failed else 0


@app.command()
@engine_options
def main(
    host: Annotated[str, option("--host", "address to listen on")] = "127.0.0.1",
    port: Annotated[int, option("--port", "port to listen on")] = 8000,
    config: Annotated[Path | None, option(
        "--config", "TOML file: an [engine] table of engine settings and a [sampling] table of request "
        "defaults (flags override it)", "none")] = None,
    served_model_name: Annotated[str | None, option(
        "--served-model-name", "the model name the API answers to and reports", "the model folder's name")] = None,
    drain_timeout_s: Annotated[float, option(
        "--drain-timeout-s", "on SIGTERM / SIGINT, seconds in-flight requests may take to finish before they "
        "are aborted")] = 5.0,
    chat_template: Annotated[str | None, option(
        "--chat-template", "a Jinja chat template file (or the template text) used instead of the tokenizer's "
        "own, e.g. one that renders tools", "the tokenizer's")] = None,
    enable_auto_tool_choice: Annotated[bool, option(
        "--enable-auto-tool-choice", 'let the model decide when to call tools (tool_choice "auto", the default '
        "with tools); needs --tool-call-parser")] = False,
    tool_call_parser: Annotated[str | None, option(
        "--tool-call-parser", "how tool calls are read from the model's text: hermes (Hermes, Qwen2.5, Qwen3) or "
        "llama3_json (Llama 3.1 / 3.2)", "none")] = None,
    api_key: Annotated[list[str] | None, option(
        "--api-key", "an API key every /v1 route requires as 'Authorization: Bearer <key>' (401 otherwise); "
        "give it several times for several keys; /health, /metrics, /version and the tokenizer routes stay "
        "open", "$TPENGINE_API_KEY, else none: no check")] = None,
    metrics_prefix: Annotated[str, option(
        "--metrics-prefix", "the prefix of every /metrics name: tpengine, or vllm for dashboards built for "
        "vLLM")] = "tpengine",
    *,
    engine: dict[str, Any],
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics; with
    --runner pooling /v1/embeddings instead of the generation routes)."""
    rank, world = start_rank()
    try:
        launch = read_launch(config, engine, world)
        model_name = served_model_name or launch.model_name
        if drain_timeout_s < 0:
            raise UserError(f"--drain-timeout-s must be >= 0, got {drain_timeout_s}")
        template = read_chat_template(chat_template)
        check_tool_flags(enable_auto_tool_choice, tool_call_parser)
        if metrics_prefix not in ("tpengine", "vllm"):
            raise UserError(f"--metrics-prefix must be tpengine or vllm, got {metrics_prefix!r}")
        keys = api_keys(api_key)
        sock = bind(host, port) if rank == 0 else None
        # the parsers and the template against the model's tokenizer, before the weights load
        check_flags_against_model(launch.config.model, launch.config.reasoning_parser, tool_call_parser, template,
                                  chat_template)
    except (UserError, ValueError, OSError) as e:
        raise typer.Exit(settings_mistake_exit(rank, e, engine)) from None
    try:
        llm = build_engine(launch.config, rank, world, launch.defaults_line)
    except (UserError, FileNotFoundError) as e:
        print(failure_line(rank, world, e), file=sys.stderr, flush=True)
        raise typer.Exit(2) from None
    if llm.is_driver:
        if template is not None:  # the chat endpoint, /tokenize and /tokenizer_info all read this one
            llm.tokenizer.chat_template = template
        code = serve_rank0(llm, sock, model_name, launch.sampling, drain_timeout_s, tool_call_parser,
                           enable_auto_tool_choice, keys, metrics_prefix)
    else:
        for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 drains and sends STOP
            signal.signal(sig, lambda *_: None)
        try:
            llm.generate([])
        except Exception as e:  # one line naming the rank (and, in a collective, its forensics report)
            print(failure_line(rank, world, e), file=sys.stderr, flush=True)
            raise
        code = 0
    if code == 0:
        llm.shutdown()
    print(f"[tpengine rank {rank}/{world}] server stopped (exit {code})", file=sys.stderr, flush=True)
    if code:  # the engine failed: the other ranks may never answer, so do not wait on any collective
        sys.stdout.flush()
        os._exit(code)
    end_rank(code)
    raise typer.Exit(code)


if __name__ == "__main__":
    app()
