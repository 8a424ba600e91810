"""Soak test (issue 38): the tp=2 server for ``--minutes`` under a mixed load, then checks that nothing
grew, leaked or was lost.

    python -m benchmarks.soak                        (make soak: 10 minutes, the default model)
    python -m benchmarks.soak --minutes 1 --model <folder> --out soak.json

Load: between 2 and ``--max-clients`` (100) concurrent clients (one ``aiohttp`` session, as
``benchmarks.serve_client``), their number sweeping from 2 to the most and back (in log space, a
period of half the run, 30 s to 5 min), each level jittered by a seeded draw and held 3-10 s. Each
client sends one request after another, each of a kind drawn by ``--seed``:

- ``stream``: a streamed completion (``stream_options.include_usage``), read to ``[DONE]``;
- ``chat_stream``: a streamed chat completion, read to ``[DONE]``;
- ``disconnect``: a streamed completion closed by the client after a few chunks (the server aborts it);
- ``n``: a completion with ``n`` 2 or 3 (that many choices expected);
- ``logprobs``: a completion with ``logprobs`` 3 (``top_logprobs`` expected);
- ``prefix``: one of a few long shared documents plus a question (the prefix cache's case), chat;
- ``chat``: a plain chat completion;
- ``bad``: an invalid request (```max_tokens`` -1, ``temperature`` -1, an unknown ``n`` type, an empty
  prompt): a 400 is expected.

Checks, each a row of the table (the run fails, exit 1, if one fails):

- RSS: each rank's ``VmRSS`` (``/proc/<pid>/status``) less its KV cache's resident pages (:func:`kv_rss_kb`)
  at the end is within 5 % of its value at the end of the first sweep (2 clients to the most and back:
  half the run, at most 5 minutes); both figures and the KV cache's pages are printed. The KV cache is
  mapped whole at start-up and its pages become resident as blocks are first written (the free queue
  hands out every block in turn), up to ``--kv-cache-gb``: that is not growth. The first sweep is the
  working set's warm-up: the heap that the largest steps' activations leave (malloc keeps freed memory,
  :func:`tpengine.backends.cpu.process.keep_freed_memory`) and oneDNN's primitive caches, keyed by row count
  and bounded (:func:`tpengine.backends.cpu.process.bound_onednn_caches`); the second sweep repeats the load;
- drained: once the load stops, ``/metrics`` shows ``tpengine:num_requests_running`` and
  ``num_requests_waiting`` 0 and ``tpengine:kv_cache_usage_perc`` 0 within 30 s;
- no request lost: sent = answered (a 200 of the expected shape) + deliberately disconnected + expected
  400s, and nothing else (no 5xx, no connection error, no response of the wrong shape, no timeout);
- the server stops on SIGTERM to its ranks with exit 0.

Latency percentiles (p50 / p90 / p99) of TTFT (streams: send to the first content chunk) and of the
end-to-end time of every answered request are printed with the counts.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from benchmarks import REPO_ROOT, emit, launcher, subprocess_env
from benchmarks.bench_serve import free_port
from benchmarks.chaos import Tree, default_model_dir, http_ok, send, served_name

app = typer.Typer(add_completion=False)

KINDS = ("stream", "chat_stream", "disconnect", "n", "logprobs", "prefix", "chat", "bad")
#: the draw's weights of the kinds, in the order of :data:`KINDS`
WEIGHTS = (4, 2, 1, 1, 1, 2, 2, 1)
TOPICS = ("rivers", "volcanoes", "the moon", "bread", "chess", "trains", "bees", "glaciers")
#: a few long documents that many prompts begin with: the prefix cache's blocks are shared and freed
DOCS = [" ".join(f"Fact {i} about {t}: it is a subject of study with a long history." for i in range(16))
        for t in TOPICS[:3]]


def metric(text: str, name: str) -> float | None:
    """The value of ``tpengine:<name>`` (any labels) in the Prometheus ``text``."""
    m = re.search(rf"^tpengine:{name}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def kv_rss_kb(pid: int) -> tuple[int, int] | None:
    """(resident kB, size kB) of ``pid``'s KV cache: its largest shared anonymous mapping (``/dev/zero
    (deleted)`` in ``/proc/<pid>/smaps``, :func:`tpengine.backends.cpu.memory.lazy_zeros`); None if it is gone."""
    best, name, size = (0, 0), "", 0
    try:
        with open(f"/proc/{pid}/smaps") as fh:
            for line in fh:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    name = line
                elif head == "Size:":
                    size = int(line.split()[1])
                elif head == "Rss:" and "/dev/zero (deleted)" in name and size > best[1]:
                    best = (int(line.split()[1]), size)
    except OSError:
        return None
    return best


def sweep_period(seconds: float) -> float:
    """Seconds of one sweep of the clients from 2 to the most and back: half the run, 30 s to 5 min."""
    return max(30.0, min(300.0, seconds / 2))


def vm_rss_kb(pid: int) -> int | None:
    """``VmRSS`` of ``pid`` in kB, None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclass
class Tally:
    """The counts and timings of the load."""

    sent: int = 0
    answered: int = 0
    disconnected: int = 0
    expected_400: int = 0
    failed: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)

    def fail(self, kind: str, why: str) -> None:
        self.failed += 1
        if len(self.errors) < 10:
            self.errors.append(f"{kind}: {why}"[:300])


def request_for(kind: str, rng: random.Random, model: str) -> tuple[str, dict]:
    """(path, body) of one request of ``kind``."""
    topic = rng.choice(TOPICS)
    max_tokens = rng.randint(8, 48)
    if kind in ("stream", "disconnect"):
        return "/v1/completions", {"model": model, "prompt": f"Tell a short story about {topic}.",
                                   "max_tokens": max_tokens if kind == "stream" else 48, "stream": True,
                                   "stream_options": {"include_usage": True}, "temperature": 0.8,
                                   "seed": rng.randint(0, 1 << 30), "ignore_eos": kind == "disconnect"}
    if kind == "chat_stream":
        return "/v1/chat/completions", {"model": model, "stream": True, "max_tokens": max_tokens,
                                        "messages": [{"role": "user", "content": f"Describe {topic}."}]}
    if kind == "n":
        return "/v1/completions", {"model": model, "prompt": f"Three words about {topic}:", "n": rng.randint(2, 3),
                                   "max_tokens": max_tokens, "temperature": 1.0}
    if kind == "logprobs":
        return "/v1/completions", {"model": model, "prompt": f"The best thing about {topic} is",
                                   "max_tokens": max_tokens, "logprobs": 3}
    if kind == "prefix":
        doc = rng.choice(DOCS)
        return "/v1/chat/completions", {"model": model, "max_tokens": max_tokens, "messages": [
            {"role": "system", "content": doc}, {"role": "user", "content": f"Question {rng.randint(0, 99)}: why?"}]}
    if kind == "chat":
        return "/v1/chat/completions", {"model": model, "max_tokens": max_tokens,
                                        "messages": [{"role": "user", "content": f"Name a fact about {topic}."}]}
    # (max_tokens 0 is valid: it scores the prompt, vLLM's semantics)
    bad = rng.choice([{"max_tokens": -1}, {"temperature": -1.0}, {"n": "two"}, {"prompt": ""}])
    return "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 8, **bad}


async def one(session, base: str, kind: str, body: dict, path: str, tally: Tally, rng: random.Random) -> None:
    """Send one request and count how it ended."""
    import aiohttp

    tally.sent += 1
    tally.by_kind[kind] = tally.by_kind.get(kind, 0) + 1
    t0 = time.perf_counter()
    try:
        async with session.post(base + path, json=body) as resp:
            if kind == "bad":
                text = await resp.text()
                if resp.status == 400:
                    tally.expected_400 += 1
                else:
                    tally.fail(kind, f"expected a 400 for {json.dumps(body)}, got {resp.status}: {text[:200]}")
                return
            if resp.status != 200:
                tally.fail(kind, f"HTTP {resp.status}: {(await resp.text())[:200]}")
                return
            if not body.get("stream"):
                data = await resp.json()
                choices = data.get("choices") or []
                want = body.get("n", 1)
                if len(choices) != want:
                    tally.fail(kind, f"{len(choices)} choices, expected {want}")
                    return
                if kind == "logprobs" and not (choices[0].get("logprobs") or {}).get("top_logprobs"):
                    tally.fail(kind, "no top_logprobs")
                    return
                tally.answered += 1
                tally.e2e.append(time.perf_counter() - t0)
                return
            stop_after = rng.randint(1, 4) if kind == "disconnect" else None
            chunks, first, done = 0, None, False
            async for raw in resp.content:
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    tally.fail(kind, f"error event: {chunk['error']}")
                    return
                c = (chunk.get("choices") or [{}])[0]
                if c.get("text") or (c.get("delta") or {}).get("content"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter() - t0
                if stop_after is not None and chunks >= stop_after:
                    # a client that goes away mid-stream: close the connection, the server aborts the request
                    resp.close()
                    tally.disconnected += 1
                    return
            if stop_after is not None:
                tally.fail(kind, f"the stream ended after {chunks} chunks, before the client left")
            elif not done:
                tally.fail(kind, "the stream ended without [DONE]")
            else:
                tally.answered += 1
                tally.e2e.append(time.perf_counter() - t0)
                if first is not None:
                    tally.ttft.append(first)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        tally.fail(kind, f"{type(e).__name__}: {e}")


async def load(base: str, model: str, seconds: float, max_clients: int, seed: int, tally: Tally,
               concurrency: list[tuple[float, int]], on_tick) -> None:
    """``seconds`` of load by a varying number of clients (2 .. ``max_clients``); ``concurrency`` gets
    (time, clients) at every change; ``on_tick(elapsed)`` runs once a second."""
    import aiohttp

    rng = random.Random(seed)
    target = 2
    stop = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=180)
    connector = aiohttp.TCPConnector(limit=max_clients + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client(k: int) -> None:
            crng = random.Random(seed * 1000 + k)
            while time.monotonic() < stop:
                if k >= target:  # this client is idle at the current concurrency
                    await asyncio.sleep(0.2)
                    continue
                kind = crng.choices(KINDS, WEIGHTS)[0]
                path, body = request_for(kind, crng, model)
                await one(session, base, kind, body, path, tally, crng)

        async def conductor() -> None:
            nonlocal target
            t0 = time.monotonic()
            next_change = 0.0
            # a sweep between 2 and max_clients in log space (a period of a half run, 30 s to 5 min), each
            # level jittered by up to 30 % and held 3-10 s; now and then a jump to an extreme
            period = sweep_period(seconds)
            while (now := time.monotonic()) < stop:
                if now - t0 >= next_change:
                    phase = 0.5 - 0.5 * math.cos(2 * math.pi * (now - t0) / period)
                    level = math.exp(math.log(2) + phase * (math.log(max_clients) - math.log(2)))
                    target = max(2, min(max_clients, round(level * rng.uniform(0.7, 1.3))))
                    if rng.random() < 0.1:
                        target = rng.choice([2, max_clients])
                    concurrency.append((round(now - t0, 1), target))
                    next_change = now - t0 + rng.uniform(3, 10)
                on_tick(now - t0)
                await asyncio.sleep(1.0)

        await asyncio.gather(conductor(), *(client(k) for k in range(max_clients)))


def percentiles(values: list[float]) -> dict:
    """p50 / p90 / p99 of ``values`` (seconds) in ms, None without values."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    a = np.asarray(values) * 1e3
    return {f"p{q}": round(float(np.percentile(a, q)), 1) for q in (50, 90, 99)}


def render(result: dict):
    """The checks, the counts and the latencies as one ``rich`` group of tables."""
    from rich.console import Group
    from rich.table import Table

    checks = Table(title=f"soak: {result['minutes']} min, tp=2, {result['model']}")
    for col in ("check", "value", "verdict"):
        checks.add_column(col, overflow="fold")
    for c in result["checks"]:
        checks.add_row(c["check"], c["value"], "[green]pass[/]" if c["ok"] else "[red]FAIL[/]")
    counts = Table(title="requests")
    for col in ("sent", "answered", "disconnected", "expected 400", "failed", "by kind"):
        counts.add_column(col, overflow="fold")
    t = result["requests"]
    counts.add_row(str(t["sent"]), str(t["answered"]), str(t["disconnected"]), str(t["expected_400"]),
                   str(t["failed"]), ", ".join(f"{k} {v}" for k, v in sorted(t["by_kind"].items())))
    lat = Table(title="latency (ms)")
    for col in ("", "n", "p50", "p90", "p99"):
        lat.add_column(col)
    for name in ("ttft", "e2e"):
        p = result["latency_ms"][name]
        lat.add_row(name, str(p["n"]), *(str(p[q]) for q in ("p50", "p90", "p99")))
    return Group(checks, counts, lat)


@app.command()
def main(
    minutes: Annotated[float, typer.Option(help="minutes of load")] = 10.0,
    model: Annotated[Path, typer.Option(help="model folder")] = default_model_dir(),
    max_clients: Annotated[int, typer.Option(help="most concurrent clients (the least is 2)")] = 100,
    seed: Annotated[int, typer.Option(help="seed of the load")] = 0,
    dist_timeout_s: Annotated[float, typer.Option(help="--dist-timeout-s of the server")] = 60.0,
    engine_args: Annotated[str, typer.Option(help="more server flags, e.g. '--kv-cache-gb 0.5'")] = "",
    rss_tolerance: Annotated[float, typer.Option(help="allowed RSS change (less the KV cache's pages) after "
                                                      "the first sweep")] = 0.05,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """The tp=2 server under a mixed, varying load; then RSS, drained KV and queues, lost requests."""
    from rich.console import Console

    console = Console(width=max(Console().width, 140))
    tmp = Path(tempfile.mkdtemp(prefix="tpengine-soak-"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp / "server.log"
    cmd = [*launcher(2, "tpengine.serve"), "--host", "127.0.0.1",
           "--port", str(port), "--model", str(model), "--dist-timeout-s", str(dist_timeout_s),
           *engine_args.split()]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
    tree = Tree(proc.pid)
    checks: list[dict] = []

    def check(name: str, ok: bool, value: str) -> None:
        checks.append({"check": name, "ok": bool(ok), "value": value})

    try:
        deadline = time.monotonic() + 600
        while not http_ok(base + "/health", timeout=2):
            if proc.poll() is not None or time.monotonic() > deadline:
                console.print(f"[red]the server did not come up (exit {proc.poll()}):[/]")
                console.print(log.read_text()[-3000:], markup=False, highlight=False)
                raise typer.Exit(1)
            time.sleep(0.5)
        tree.poll()
        ranks = {r: tree.pid_of(r) for r in ("rank0", "rank1")}
        name = served_name(base)
        console.print(f"server up at tp=2 ({model}); ranks {ranks}; load for {minutes} min")
        seconds = minutes * 60
        baseline_at = min(sweep_period(seconds), seconds / 2)  # the end of the first sweep
        baseline: dict[str, tuple[int, int] | None] = {}

        def rss(pid: int) -> tuple[int, int] | None:
            """(VmRSS, the KV cache's resident pages) of ``pid`` in kB, None if it is gone."""
            total, kv = vm_rss_kb(pid), kv_rss_kb(pid)
            return None if total is None or kv is None else (total, kv[0])

        def on_tick(elapsed: float) -> None:
            if not baseline and elapsed >= baseline_at:
                baseline.update({r: rss(p) for r, p in ranks.items() if p})
                console.print(f"RSS after {elapsed:.0f} s: " + ", ".join(
                    f"{r} {v[0] / 1024:.0f} MiB ({v[1] / 1024:.0f} MiB of it KV cache)"
                    for r, v in baseline.items() if v))

        tally, concurrency = Tally(), []
        t0 = time.monotonic()
        asyncio.run(load(base, name, seconds, max_clients, seed, tally, concurrency, on_tick))
        load_s = time.monotonic() - t0
        console.print(f"load done in {load_s:.0f} s: {tally.sent} requests; concurrency "
                      f"{min(c for _, c in concurrency)} .. {max(c for _, c in concurrency)}")

        # the drain: no request running or waiting, no KV block in use
        drained, values = False, {}
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
                    text = resp.read().decode()
                values = {k: metric(text, k) for k in ("num_requests_running", "num_requests_waiting",
                                                       "kv_cache_usage_perc")}
                if all(v == 0 for v in values.values()):
                    drained = True
                    break
            except OSError:
                pass
            time.sleep(0.5)
        check("drained (running, waiting, KV usage)", drained,
              ", ".join(f"{k} {v}" for k, v in values.items()) or "no /metrics")
        rss_rows = {}
        for r, p in ranks.items():
            now, first = rss(p) if p else None, baseline.get(r)
            if now is None or first is None:
                check(f"{r} RSS less KV pages within {rss_tolerance:.0%}", False, f"{first} -> {now}")
                continue
            a, b = first[0] - first[1], now[0] - now[1]
            ok = a * (1 - rss_tolerance) <= b <= a * (1 + rss_tolerance)
            rss_rows[r] = {"at_s": round(baseline_at), "first_kb": first[0], "first_kv_kb": first[1],
                           "end_kb": now[0], "end_kv_kb": now[1]}
            check(f"{r} RSS less KV pages within {rss_tolerance:.0%}", ok,
                  f"{a / 1024:.1f} MiB after {baseline_at:.0f} s -> {b / 1024:.1f} MiB at the end "
                  f"({(b / a - 1) * 100:+.1f} %); VmRSS {first[0] / 1024:.0f} -> {now[0] / 1024:.0f} MiB, "
                  f"KV cache pages {first[1] / 1024:.0f} -> {now[1] / 1024:.0f} MiB")
        lost = tally.sent - tally.answered - tally.disconnected - tally.expected_400
        check("no request lost", lost == 0 and tally.failed == 0,
              f"sent {tally.sent} = answered {tally.answered} + disconnected {tally.disconnected} + 400 "
              f"{tally.expected_400} + failed {tally.failed}" + (f"; first: {tally.errors[0]}" if tally.errors else ""))
        # a clean stop: SIGTERM to the ranks, as a process manager would
        still = http_ok(base + "/v1/completions", {"model": name, "prompt": "Bye", "max_tokens": 4}, timeout=60)
        check("serves after the load", still, "a completion answered 200" if still else "no answer")
        for p in ranks.values():
            if p:
                send(p, signal.SIGTERM)
        try:
            rc = proc.wait(dist_timeout_s + 30)
        except subprocess.TimeoutExpired:
            rc = None
        gone = tree.wait_gone(time.monotonic() + 10) is not None
        check("stops on SIGTERM (exit 0, no process left)", rc == 0 and gone, f"exit {rc}, "
              + ("no process left" if gone else "left: " + ", ".join(f"{r}:{p}" for r, p, _ in tree.live())))
        result = {
            "minutes": minutes, "model": str(model), "seed": seed, "max_clients": max_clients,
            "load_s": round(load_s, 1), "concurrency": concurrency, "checks": checks, "rss": rss_rows,
            "requests": {"sent": tally.sent, "answered": tally.answered, "disconnected": tally.disconnected,
                         "expected_400": tally.expected_400, "failed": tally.failed, "by_kind": tally.by_kind,
                         "errors": tally.errors},
            "latency_ms": {"ttft": {"n": len(tally.ttft), **percentiles(tally.ttft)},
                           "e2e": {"n": len(tally.e2e), **percentiles(tally.e2e)}},
        }
        emit(console, render(result), result, out)
        for e in tally.errors:
            console.print(f"  {e}", markup=False, highlight=False)
        if not all(c["ok"] for c in checks):
            console.print(f"[red]soak failed; server log {log}[/]")
            shutil.copy(log, Path(tempfile.gettempdir()) / "tpengine-soak-server.log")
            raise typer.Exit(1)
    finally:
        tree.poll()
        tree.reap()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    app()
