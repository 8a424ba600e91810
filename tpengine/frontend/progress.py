"""Rank-0 progress: a rich bar on a terminal, plain periodic lines otherwise, then a summary.

TTFT = arrival -> first token; TPOT (time per output token after the first) =
``(latency - ttft) / (completion_tokens - 1)`` for requests with more than one token. All times
in seconds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from tpengine.engine.memory import format_peak_rss
from tpengine.engine.outputs import EngineOutput


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, linear interpolation) of ``xs``; None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stat(stats: Any, name: str) -> Any:
    if stats is None:
        return None
    return stats.get(name) if isinstance(stats, dict) else getattr(stats, name, None)


class ProgressReporter:
    """Counts finished requests and tokens; shows progress on ``stream`` (default stderr).

    Args:
        total: requests expected (including ones that end as errors).
        stream: where progress goes; a rich bar if it is a terminal (or ``live`` is True),
            else one plain line every ``interval_s`` seconds.
        enabled: False shows nothing during the run (counts are still kept).
    """

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        interval_s: float = 5.0,
        enabled: bool = True,
        live: bool | None = None,
    ) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.enabled = enabled
        self.ok = self.errors = self.prompt_tokens = self.output_tokens = self.sampled_tokens = 0
        self.cached_tokens = 0  # prompt tokens of finished requests found in the prefix cache
        self.ttfts: list[float] = []
        self.tpots: list[float] = []
        self.running = self.waiting = 0
        self.spec: dict[str, Any] | None = None  # with speculative decoding: the engine's spec_* counters
        self.peak_rss: list[int] | None = None  # bytes per rank, set at the end of the run
        # rank 0's KV cache: {"dtype": the cache's kind ("auto" / "int8"), "bytes_per_token", "blocks"}
        self.kv_cache: dict[str, Any] | None = None
        self.start = time.monotonic()
        self._last_print = self.start
        self._bar = None
        if live is None:
            live = bool(getattr(self.stream, "isatty", lambda: False)())
        if enabled and live and total > 0:
            self._start_bar()

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("requests"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=Console(file=self.stream),
            transient=False,
        )
        self._task = self._bar.add_task("requests", total=self.total, info="")
        self._bar.start()

    @property
    def done(self) -> int:
        return self.ok + self.errors

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def tokens_per_s(self) -> float:
        """Output tokens per second of wall time so far, for the progress line: the tokens the engine
        has emitted (requests still running included; speculative tokens once accepted), or those of
        the finished requests when more."""
        return max(self.output_tokens, self.sampled_tokens) / max(self.elapsed(), 1e-9)

    def add_errors(self, n: int = 1) -> None:
        """Count ``n`` requests rejected before they reached the engine."""
        self.errors += n
        self._refresh()

    def on_output(self, out: EngineOutput) -> None:
        """Count one finished request (ok, or an error record from the engine)."""
        self.running = max(0, self.running - 1)  # until the next step's stats arrive
        if out.error is not None:
            self.errors += 1
        else:
            self.ok += 1
            self.prompt_tokens += len(out.prompt_token_ids)
            self.cached_tokens += out.num_cached_tokens
            self.output_tokens += out.num_output_tokens  # every sample's (n > 1), as the record's usage
            if out.ttft_s is not None:
                self.ttfts.append(out.ttft_s)
            if out.tpot_s is not None:
                self.tpots.append(out.tpot_s)
        self._refresh()

    def on_step(self, stats: Any = None) -> None:
        """Per engine step: ``stats`` (dict or object) with ``num_running``/``num_waiting``."""
        self.running = _stat(stats, "num_running") or 0
        self.waiting = _stat(stats, "num_waiting") or 0
        self.sampled_tokens = _stat(stats, "output_tokens") or self.sampled_tokens
        if _stat(stats, "speculative"):
            drafts, proposed = _stat(stats, "spec_num_drafts") or 0, _stat(stats, "spec_num_draft_tokens") or 0
            accepted = _stat(stats, "spec_num_accepted_tokens") or 0
            self.spec = {"num_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
                         "acceptance_rate": accepted / proposed if proposed else None,
                         "mean_acceptance_length": 1 + accepted / drafts if drafts else None}
        self._refresh()

    def _line(self) -> str:
        return (f"{self.tokens_per_s():.1f} output tok/s, running {self.running}, "
                f"waiting {self.waiting}")

    def _refresh(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, info=self._line())
            return
        now = time.monotonic()
        if now - self._last_print >= self.interval_s:
            self._last_print = now
            print(f"[tpengine] {self.done}/{self.total} requests, {self._line()}, "
                  f"{self.elapsed():.0f}s", file=self.stream, flush=True)

    def close(self) -> None:
        """Stop the bar (idempotent)."""
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, info=self._line())
            self._bar.stop()
            self._bar = None

    def summary(self) -> dict[str, Any]:
        """The run's numbers: counts (``requests_ok``: records with output, ``requests_error``: error
        records), tokens (``prompt_tokens`` / ``output_tokens``: the sums of the ok records'
        ``usage.prompt_tokens`` / ``usage.completion_tokens``: each prompt once, every sample's tokens
        with n > 1, speculative tokens as emitted), prefix_cache_hit_rate (cached prompt tokens / prompt
        tokens of the finished requests), wall_s, output_tok_s (``output_tokens / wall_s``), ttft/tpot
        p50/p90 (s),
        peak_rss_bytes (per rank, in rank order; None when not reported), ``kv_cache`` (rank 0's KV cache:
        its ``dtype`` setting, ``bytes_per_token`` and ``blocks``; None when not reported); with speculative decoding,
        ``spec_decode``: proposals (sequence-steps), proposed and accepted tokens, acceptance rate
        (accepted / proposed) and mean acceptance length (tokens per sequence-step with a proposal)."""
        extra = {} if self.spec is None else {"spec_decode": dict(self.spec)}
        wall = self.elapsed()
        return {
            "requests_ok": self.ok,
            "requests_error": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_prompt_tokens": self.cached_tokens,
            "prefix_cache_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "wall_s": wall,
            "output_tok_s": self.output_tokens / max(wall, 1e-9),
            "ttft_p50_s": percentile(self.ttfts, 50),
            "ttft_p90_s": percentile(self.ttfts, 90),
            "tpot_p50_s": percentile(self.tpots, 50),
            "tpot_p90_s": percentile(self.tpots, 90),
            "peak_rss_bytes": self.peak_rss,
            "kv_cache": self.kv_cache,
            **extra,
        }

    def print_summary(self) -> dict[str, Any]:
        """Close the bar and print the summary as a rich table on ``stream``; return it."""
        from rich.console import Console
        from rich.table import Table

        self.close()
        s = self.summary()

        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x * 1000:.1f} ms"

        table = Table(title="tpengine run summary", show_header=False)
        table.add_row("requests", f"{s['requests_ok']} ok, {s['requests_error']} errors")
        table.add_row("prompt tokens", str(s["prompt_tokens"]))
        table.add_row("prefix cache hit rate", f"{s['prefix_cache_hit_rate']:.3f} "
                      f"({s['cached_prompt_tokens']} of {s['prompt_tokens']} prompt tokens cached)")
        table.add_row("output tokens", str(s["output_tokens"]))
        table.add_row("wall time", f"{s['wall_s']:.2f} s")
        table.add_row("output tokens/s", f"{s['output_tok_s']:.1f}")
        table.add_row("TTFT p50 / p90", f"{ms(s['ttft_p50_s'])} / {ms(s['ttft_p90_s'])}")
        table.add_row("TPOT p50 / p90", f"{ms(s['tpot_p50_s'])} / {ms(s['tpot_p90_s'])}")
        if (spec := s.get("spec_decode")) is not None:
            rate, mean = spec["acceptance_rate"], spec["mean_acceptance_length"]
            table.add_row("speculative decoding", "no proposal yet" if rate is None else
                          f"{spec['num_accepted_tokens']} of {spec['num_draft_tokens']} proposed tokens accepted "
                          f"({rate:.3f}), mean acceptance length {mean:.2f}")
        if (kv := s["kv_cache"]) is not None:
            table.add_row("KV cache (rank 0)", f"{kv['dtype']}, {kv['bytes_per_token']} B/token, {kv['blocks']} blocks")
        if s["peak_rss_bytes"]:
            table.add_row("peak memory per rank", format_peak_rss(s["peak_rss_bytes"]))
        Console(file=self.stream, width=80).print(table)
        return s
