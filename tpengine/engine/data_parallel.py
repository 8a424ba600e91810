"""Data parallelism: several tensor-parallel replicas of the model behind one front.

A launch of ``dp_size x tp_size`` ranks (``--data-parallel-size``, ``--tensor-parallel-size``) is
``dp_size`` replicas, each a TP group of consecutive ranks with its own driver (TP rank 0), scheduler,
KV cache and prefix cache: each replica is the plain :class:`tpengine.engine.llm_engine.LLMEngine`
of one TP group. Global rank 0 (the *front*: the request file, the HTTP server, the ``LLM`` calls)
drives replica 0 itself and routes requests between the replicas (:class:`Router`).

The replicas' drivers move in lockstep *ticks* on the data-parallel gloo group (vLLM's data parallel
runs an engine core per replica behind one front end; SGLang's ``--dp-size`` a scheduler per
replica behind its router; here the exchange is two bounded collectives per tick, so every wait is
bounded by ``dist_timeout_s`` and a dead replica fails the next tick, as a dead rank fails the next
step of one TP group):

1. the front broadcasts a :class:`Tick`: per replica the requests routed to it and the aborts since
   the last tick, whether idle replicas send a heartbeat, and whether to stop;
2. every driver applies its commands and runs one step of its replica (or, idle, an IDLE heartbeat
   to its TP group when one is due), in parallel with the others;
3. the front gathers each driver's :class:`Report`: the step's outputs and the replica's stats.

A tick lasts as long as the slowest replica's step; a replica with nothing to run waits for it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields

from tpengine.distributed import dp_broadcast_object, dp_gather_object
from tpengine.engine.llm_engine import run_requests
from tpengine.engine.outputs import EngineOutput
from tpengine.engine.stats import EngineStats
from tpengine.sampling_params import SamplingParams

#: Prefix keys (first-block hashes) the router remembers, least recently routed dropped first.
PREFIX_KEYS = 1 << 16
#: A request goes to a replica that holds its prefix while that replica's outstanding tokens are at
#: most this many times the least loaded replica's plus the request's own (SGLang's cache-aware
#: router also leaves the cache for balance when the load is uneven).
BALANCE_FACTOR = 2


@dataclass
class Tick:
    """One tick's commands, broadcast by the front: ``commands[d]`` for replica ``d``, each
    ``("add", request_id, prompt_token_ids, params, stream)`` or ``("abort", request_id)``;
    ``heartbeat``: every idle replica broadcasts IDLE to its TP group; ``stop``: the drivers stop (no
    step, no report)."""

    commands: list[list[tuple]]
    heartbeat: bool = False
    stop: bool = False


@dataclass
class Report:
    """One driver's answer to a tick: ``outputs`` of its step and its replica's ``stats`` after it."""

    outputs: list[EngineOutput]
    stats: EngineStats


def request_cost(prompt_len: int, params: SamplingParams, max_model_len: int) -> int:
    """The tokens a request may still cost its replica: ``prompt_len`` plus ``n`` times its
    ``max_tokens`` (unset: the rest of ``max_model_len``)."""
    out = params.max_tokens if params.max_tokens is not None else max(0, max_model_len - prompt_len)
    return prompt_len + params.n * out


class Router:
    """Which replica runs a request: the one with the fewest outstanding tokens
    (:func:`request_cost` of the requests routed to it and not finished), except that a prompt whose
    first block (``block_size`` tokens) a replica has seen goes to such a replica, so its prefix cache
    keeps working, while that replica's load is at most ``BALANCE_FACTOR`` times the least loaded
    one's plus the request's cost. Prompts shorter than a block carry no prefix key.

    Args:
        dp_size: the number of replicas.
        block_size: tokens per KV-cache block (the prefix cache's unit).
        max_model_len: tokens of one sequence (a request's cost without ``max_tokens``).
    """

    def __init__(self, dp_size: int, block_size: int, max_model_len: int) -> None:
        self.dp_size, self.block_size, self.max_model_len = dp_size, block_size, max_model_len
        self.load = [0] * dp_size  # outstanding tokens per replica
        self.live: dict[str, tuple[int, int]] = {}  # request id -> (replica, cost)
        self.holders: OrderedDict[int, list[int]] = OrderedDict()  # first-block hash -> replicas, LRU order

    def route(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """The replica of a new request (noted as outstanding until :meth:`finish`). A request id
        that is live already goes to its replica, whose engine refuses it as a duplicate."""
        if request_id in self.live:
            return self.live[request_id][0]
        cost = request_cost(len(prompt_token_ids), params, self.max_model_len)
        least = min(range(self.dp_size), key=lambda d: (self.load[d], d))
        choice = least
        key = hash(tuple(prompt_token_ids[:self.block_size])) if len(prompt_token_ids) >= self.block_size else None
        if key is not None:
            holders = self.holders.pop(key, [])
            if holders:
                best = min(holders, key=lambda d: (self.load[d], d))
                if self.load[best] <= BALANCE_FACTOR * self.load[least] + cost:
                    choice = best
            if choice not in holders:
                holders.append(choice)
            self.holders[key] = holders
            while len(self.holders) > PREFIX_KEYS:
                self.holders.popitem(last=False)
        self.load[choice] += cost
        self.live[request_id] = (choice, cost)
        return choice

    def replica_of(self, request_id: str) -> int | None:
        """The replica of a live request, or None."""
        hit = self.live.get(request_id)
        return None if hit is None else hit[0]

    def finish(self, request_id: str) -> None:
        """A request's final output arrived: its cost leaves its replica's load."""
        hit = self.live.pop(request_id, None)
        if hit is not None:
            self.load[hit[0]] -= hit[1]


def merge_stats(parts: list[EngineStats]) -> EngineStats:
    """The replicas' stats as one: counts summed (per-position speculative counts too),
    ``speculative`` if any replica's is."""
    values = {}
    for f in fields(EngineStats):
        got = [getattr(p, f.name) for p in parts]
        if f.name == "speculative":
            values[f.name] = any(got)
        elif f.name == "spec_accepted_per_pos":
            width = max((len(g) for g in got), default=0)
            values[f.name] = tuple(sum(g[i] for g in got if i < len(g)) for i in range(width))
        else:
            values[f.name] = sum(got)
    return EngineStats(**values)


@dataclass
class _Replica:
    """A driver's side of the ticks: its engine and when it last broadcast to its TP group."""

    engine: object
    last_broadcast: float = field(default_factory=time.monotonic)

    def apply(self, tick: Tick, dp_rank: int) -> None:
        """Apply ``tick``'s commands for replica ``dp_rank``."""
        for cmd in tick.commands[dp_rank]:
            if cmd[0] == "add":
                self.engine.add_request(cmd[1], cmd[2], cmd[3], stream=cmd[4])
            else:
                self.engine.abort_request(cmd[1])

    def run(self, heartbeat: bool) -> list[EngineOutput]:
        """One step when anything is unfinished; else an IDLE heartbeat to the TP group when asked or
        when a quarter of ``dist_timeout_s`` passed since the last broadcast."""
        engine = self.engine
        now = time.monotonic()
        if engine.has_unfinished():
            self.last_broadcast = now
            return engine.step()
        if heartbeat or now - self.last_broadcast >= engine.config.dist_timeout_s / 4:
            engine.heartbeat()
            self.last_broadcast = now
        return []


class DataParallelEngine:
    """The engine of a replica's driver when there are several replicas (``data_parallel_size`` > 1).

    On the front (global rank 0, :attr:`is_driver` True) it is what the batch job, the server and the
    ``LLM`` API drive, with :class:`tpengine.engine.llm_engine.LLMEngine`'s driver interface
    (``add_request``, ``abort_request``, ``step``, ``has_unfinished``, ``heartbeat``, ``stats``,
    ``generate``, ``stop_workers``, ``tokenizer``, ``vocab_size``, ``config``, ``structured``, ``runner``): each
    call is a tick over every replica (module docstring). On another replica's driver
    (:attr:`is_driver` False) :meth:`generate` follows the front's ticks until it stops, as a TP
    worker follows its driver's steps.

    Args:
        engine: this driver's own replica's :class:`tpengine.engine.llm_engine.LLMEngine`.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.tp = engine.tp
        self.config = engine.config
        self._replica = _Replica(engine)
        self._stats: list[EngineStats | None] = [None] * self.tp.dp_size  # the other replicas', last tick
        if self.is_driver:
            self.router = Router(self.tp.dp_size, self.config.block_size, self.config.max_model_len)
            self._outbox: list[list[tuple]] = [[] for _ in range(self.tp.dp_size)]

    @property
    def is_driver(self) -> bool:
        """Whether this is the front (global rank 0)."""
        return self.tp.is_front

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def runner(self):
        """This driver's own replica's :class:`tpengine.engine.model_runner.ModelRunner` (the batch job's
        summary reports rank 0's KV cache from it)."""
        return self.engine.runner

    @property
    def structured(self):
        return self.engine.structured

    # ------------------------------------------------------------------ the front
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    stream: bool = False) -> None:
        """Route a request (:class:`Router`) to a replica: replica 0's engine takes it now, another
        replica's driver at the next tick. A request that cannot run becomes its replica's error output,
        as :meth:`tpengine.engine.llm_engine.LLMEngine.add_request` makes it."""
        replica = self.router.route(request_id, list(prompt_token_ids), params)
        if replica == 0:
            self.engine.add_request(request_id, prompt_token_ids, params, stream=stream)
        else:
            self._outbox[replica].append(("add", request_id, list(prompt_token_ids), params, stream))

    def abort_request(self, request_id: str) -> bool:
        """End a live request on its replica (its final output comes with a later :meth:`step`).
        Returns False when no such request is live."""
        replica = self.router.replica_of(request_id)
        if replica is None:
            return False
        if replica == 0:
            return self.engine.abort_request(request_id)
        self._outbox[replica].append(("abort", request_id))
        return True

    def has_unfinished(self) -> bool:
        """Whether any replica has work: a request routed and not finished, or replica 0's own."""
        return bool(self.router.live) or self.engine.has_unfinished() or any(self._outbox)

    def step(self) -> list[EngineOutput]:
        """One tick: every replica runs a step; returns their outputs (replica 0's first)."""
        return self._tick()

    def heartbeat(self) -> None:
        """A tick in which every idle replica broadcasts IDLE to its TP group (the server's heartbeat)."""
        self._tick(heartbeat=True)

    def stop_workers(self) -> None:
        """Stop every replica: the other drivers leave :meth:`generate` and stop their TP groups, and
        replica 0's TP workers stop."""
        dp_broadcast_object(Tick([[] for _ in range(self.tp.dp_size)], stop=True))
        self.engine.stop_workers()

    def _tick(self, heartbeat: bool = False) -> list[EngineOutput]:
        tick = Tick(self._outbox, heartbeat=heartbeat)
        self._outbox = [[] for _ in range(self.tp.dp_size)]
        dp_broadcast_object(tick)
        self._replica.apply(tick, 0)
        outs = self._replica.run(heartbeat)
        reports = dp_gather_object(Report([], self.engine.stats()))
        for d, rep in enumerate(reports[1:], start=1):
            outs += rep.outputs
            self._stats[d] = rep.stats
        for o in outs:
            if o.finished:
                self.router.finish(o.request_id)
        return outs

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's stats, replica 0's now and the others' as of the last tick (before any tick,
        replica 0's alone)."""
        return [self.engine.stats()] + [s for s in self._stats[1:] if s is not None]

    def stats(self) -> EngineStats:
        """The replicas' stats summed (:func:`merge_stats`); the requests routed since the last tick count
        as waiting."""
        total = merge_stats(self.replica_stats())
        queued = sum(cmd[0] == "add" for box in self._outbox for cmd in box)
        return EngineStats(**{**{f.name: getattr(total, f.name) for f in fields(EngineStats)},
                              "num_waiting": total.num_waiting + queued})

    def num_waiting(self) -> int:
        """Requests waiting in every replica: replica 0's now, the others' as of the last tick, and those
        routed since."""
        others = sum(s.num_waiting for s in self._stats[1:] if s is not None)
        return self.engine.num_waiting() + others + sum(map(len, self._outbox))

    def generate(self, requests: Iterable[tuple[str, list[int], SamplingParams]],
                 on_output: Callable[[EngineOutput], None] | None = None,
                 on_step: Callable[[EngineStats], None] | None = None) -> list[EngineOutput]:
        """As :meth:`tpengine.engine.llm_engine.LLMEngine.generate`, over every replica; the requests
        are taken lazily, at most ``2 * max_num_seqs`` waiting per replica. On another replica's driver:
        follow the front's ticks until it stops, then stop this replica's TP group; returns []."""
        if not self.is_driver:
            self._follow()
            return []
        return run_requests(self, requests, 2 * self.config.max_num_seqs * self.tp.dp_size, on_output, on_step)

    def _follow(self) -> None:
        """Another replica's driver: apply each tick, run its step, report; stop on the front's STOP."""
        while True:
            tick = dp_broadcast_object(None)
            if tick.stop:
                break
            self._replica.apply(tick, self.tp.dp_rank)
            outs = self._replica.run(tick.heartbeat)
            dp_gather_object(Report(outs, self.engine.stats()))
        self.engine.stop_workers()

    def shutdown(self) -> None:
        """Tear down the process groups (after :meth:`generate` returned on every rank)."""
        self.engine.shutdown()
