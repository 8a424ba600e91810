"""The streaming client of ``benchmarks.bench_serve``: concurrent ``/v1/completions`` requests through
one ``aiohttp`` session (as ``vllm bench serve``), timing every text chunk. Times in seconds."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

#: ``tpengine:num_requests_running`` in the Prometheus text of ``/metrics``.
RUNNING = re.compile(r"^tpengine:num_requests_running(?:\{[^}]*\})? ([0-9.e+-]+)$", re.M)


@dataclass
class RequestResult:
    """One streamed request: seconds from send to each non-empty text chunk, its end, usage tokens."""

    chunk_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    output_tokens: int | None = None
    error: str | None = None


async def one_request(session, url: str, body: dict) -> RequestResult:
    """Send ``body`` to ``url`` streamed; time every non-empty ``choices[0].text`` chunk."""
    r = RequestResult()
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return r
            async for raw in resp.content:  # one SSE line at a time
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = f"error event: {chunk['error']}"
                    break
                if chunk.get("choices"):
                    if chunk["choices"][0].get("text"):
                        r.chunk_s.append(now - t0)
                elif chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 -- a failed request is reported with the others
        r.error = f"{type(e).__name__}: {e}"
    r.latency_s = time.perf_counter() - t0
    return r


async def sample_running(client, url: str, every_s: float, samples: list[float], stop: asyncio.Event) -> None:
    """Every ``every_s`` seconds until ``stop``, append ``tpengine:num_requests_running`` from ``url``."""
    while True:
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return
        except TimeoutError:
            pass
        try:
            async with client.get(url) as resp:
                m = RUNNING.search(await resp.text())
            if m:
                samples.append(float(m.group(1)))
        except Exception:  # noqa: BLE001 -- a missed sample is not a failure
            pass


async def run_clients(base_url: str, bodies: list[dict], concurrency: int) -> tuple[list[RequestResult], float,
                                                                                      list[float]]:
    """All ``bodies`` at once, at most ``concurrency`` in flight: the results (in order), the run's wall
    time (s) and the running-batch samples."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency + 1)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as client:
        sem = asyncio.Semaphore(concurrency)

        async def bounded(body: dict) -> RequestResult:
            async with sem:
                return await one_request(client, base_url + "/v1/completions", body)

        stop, samples = asyncio.Event(), []
        sampler = asyncio.ensure_future(sample_running(client, base_url + "/metrics", 1.0, samples, stop))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(b) for b in bodies))
        wall = time.perf_counter() - t0
        stop.set()
        await sampler
    return list(results), wall, samples
