"""Rank 0's engine loop beside the server: one thread owns the LLMEngine, takes new requests and
aborts between steps, and hands each output to the asyncio side.

The other ranks follow rank 0's broadcasts as in the batch job (``LLMEngine.generate([])``). While
there is nothing to run the loop blocks on its command queue (no core spins) and broadcasts an
IDLE plan every ``heartbeat_s`` seconds, so no rank's wait for the next plan reaches
``dist_timeout_s`` and a dead rank is noticed by the next broadcast.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections.abc import Callable

from tpengine import forensics
from tpengine.engine.outputs import EngineOutput
from tpengine.sampling_params import SamplingParams


class EngineDead(RuntimeError):
    """The engine loop has stopped (a failed step or rank, or shutdown); no request can run."""


def _put_all(items: list[tuple[asyncio.Queue, EngineOutput | BaseException]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class EngineLoop:
    """Runs ``engine`` (rank 0's :class:`tpengine.engine.llm_engine.LLMEngine`) in a thread.

    Args:
        engine: the driver's engine.
        heartbeat_s: seconds between IDLE broadcasts while idle (default ``dist_timeout_s / 4``).
        on_step: called in the loop thread after every step with the engine's stats and the step's
            outputs (metrics).

    ``dead`` holds the exception that stopped the loop (None while it runs); ``failed`` is True
    when that was a failure (not :meth:`stop`).
    """

    def __init__(self, engine, heartbeat_s: float | None = None,
                 on_step: Callable[[object, list[EngineOutput]], None] | None = None) -> None:
        self.engine = engine
        self.heartbeat_s = heartbeat_s or engine.config.dist_timeout_s / 4
        self.on_step = on_step
        self.dead: BaseException | None = None
        self.failed = False
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}  # request id -> its outputs' queue
        self._event_loop: asyncio.AbstractEventLoop | None = None  # the server's, set by the first submit
        self._stop_at: float | None = None  # monotonic deadline of the drain, once stopping
        self._thread = threading.Thread(target=self._run, name="tpengine-engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               stream: bool, into: asyncio.Queue | None = None) -> asyncio.Queue:
        """Queue a request (call from the event loop). Its outputs arrive in the returned queue
        (``into``, when given: the prompts of one HTTP request share one queue): with ``stream``,
        outputs so far (``finished`` False), then the final output; a :class:`EngineDead` instead if
        the loop stops first.

        Raises:
            EngineDead: the loop is stopping or stopped.
        """
        if self.dead is not None or self._stop_at is not None:
            raise EngineDead(f"the engine is not running ({self.dead or 'shutting down'})")
        self._event_loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue() if into is None else into
        self._streams[request_id] = q
        self._commands.put(("add", request_id, prompt_token_ids, params, stream))
        return q

    def running(self, request_id: str) -> bool:
        """Whether a request with this id was submitted and has not had its final output yet (call
        from the event loop)."""
        return request_id in self._streams

    def abort(self, request_id: str) -> None:
        """Abort a request (its client went away): its blocks are freed before the next step."""
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every live request (the drain timeout passed): each stream ends with its final output."""
        self._commands.put(("abort_all",))

    def stop(self, drain_s: float) -> None:
        """Stop: take no new request, let running ones finish for up to ``drain_s`` seconds, abort
        the rest, broadcast STOP to the other ranks and join the thread (blocks)."""
        self._commands.put(("stop", drain_s))
        self._thread.join()

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        engine = self.engine
        last = time.monotonic()
        try:
            while True:
                busy = engine.has_unfinished()
                applied = self._take_commands(block=not busy,
                                              timeout=max(0.0, self.heartbeat_s - (time.monotonic() - last)))
                if applied and self.on_step is not None:  # e.g. an abort freed blocks: the gauges show it now
                    self.on_step(engine.stats(), [])
                if self._stop_at is not None and (not engine.has_unfinished() or time.monotonic() >= self._stop_at):
                    self._abort_streams()
                    self._deliver(engine.step() if engine.has_unfinished() else [])
                    break
                if engine.has_unfinished():
                    outs = engine.step()
                    self._deliver(outs)
                    if self.on_step is not None:
                        self.on_step(engine.stats(), outs)
                    last = time.monotonic()
                elif time.monotonic() - last >= self.heartbeat_s:
                    engine.heartbeat()
                    last = time.monotonic()
            engine.stop_workers()
        except BaseException as e:  # a failed step or rank: every waiting request learns it
            self.dead, self.failed = e, True
            # inside a collective: the forensics report first, and the line names the missing ranks
            what = forensics.collective_failure(e) if isinstance(e, Exception) else None
            print(f"[tpengine rank 0] engine loop failed: {what or f'{type(e).__name__}: {e}'}", file=sys.stderr,
                  flush=True)
            dead = EngineDead(f"the engine failed: {type(e).__name__}: {e}")
            self._send([(q, dead) for q in list(self._streams.values())])
            self._streams.clear()
        else:
            self.dead = EngineDead("the server shut down")

    def _take_commands(self, block: bool, timeout: float) -> bool:
        """Apply every queued command; wait up to ``timeout`` seconds for the first when ``block``.
        Returns whether any was applied."""
        try:
            cmd = self._commands.get(timeout=timeout) if block and timeout > 0 else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            if cmd[0] == "add":
                self.engine.add_request(cmd[1], cmd[2], cmd[3], stream=cmd[4])
            elif cmd[0] == "abort":
                self.engine.abort_request(cmd[1])
            elif cmd[0] == "abort_all":
                self._abort_streams()
            elif self._stop_at is None:  # "stop"
                self._stop_at = time.monotonic() + cmd[1]
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _abort_streams(self) -> None:
        """Abort every request a client still waits for (their final outputs come with the next step)."""
        for rid in list(self._streams):
            self.engine.abort_request(rid)

    def _deliver(self, outs: list[EngineOutput]) -> None:
        items = []
        for out in outs:
            q = self._streams.get(out.request_id)
            if q is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            items.append((q, out))
        self._send(items)

    def _send(self, items: list[tuple[asyncio.Queue, EngineOutput | BaseException]]) -> None:
        """Hand one step's outputs to the event loop in one call (not one per request)."""
        if items and self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(_put_all, items)
