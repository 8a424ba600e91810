"""The server's Prometheus metrics (``GET /metrics``), named after vLLM's (``vllm:`` becomes
``tpengine:``, or stays ``vllm:`` with ``--metrics-prefix vllm``): queue gauges, KV-cache usage, the
cache's settings (``cache_config_info``), token, preemption and prefix-cache counters, tokens per step,
and latency histograms (seconds): per request time to first token, time per output token, end to end,
and its phases (queue: arrival to first scheduled; prefill: then to the first token; decode: first
to last token; inference: prefill + decode), and each interval between two tokens of a request."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tpengine.engine.outputs import EngineOutput

# vLLM's bucket bounds (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # tokens per step
#: The metric-name prefixes ``--metrics-prefix`` takes: tpengine's own, or vLLM's for dashboards built for vLLM.
PREFIXES = ("tpengine", "vllm")


class ServerMetrics:
    """The metrics of one server, in their own registry, every name ``<prefix>:...`` (``prefix`` one
    of :data:`PREFIXES`).

    ``observe_step(stats, outputs, replicas)`` runs in the engine loop after every step (queue sizes,
    KV-cache usage, the counters' advance since the last call, tokens computed by the step, finished
    requests' tokens and latencies); ``set_queue(stats)`` refreshes the gauges alone;
    ``set_cache_config(info)`` sets ``cache_config_info``. The gauges count every data-parallel
    replica; with several, ``<prefix>:replica_*`` gauges (a ``replica`` label) give each one's.

    Raises:
        ValueError: ``prefix`` is not one of :data:`PREFIXES`.
    """

    def __init__(self, model_name: str, prefix: str = "tpengine") -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {', '.join(PREFIXES)}, got {prefix!r}")
        self.registry = r = CollectorRegistry()
        self.prefix = prefix
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(f"{prefix}:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"{prefix}:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"{prefix}:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = all).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests (each prompt once, "
                                     "aborted requests too; failed ones have none).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests: every "
                                         "sample's, speculative tokens as emitted, aborted requests' too.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (their KV blocks freed, to be "
                                   "recomputed).")
        self.cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                     "(each request's prompt, at its first scheduling).")
        self.cache_hits = counter("prefix_cache_hits", "Of the prompt tokens looked up, those found in the "
                                  "prefix cache.")
        self.success = Counter(f"{prefix}:request_success", "Samples that finished (stop or length; each "
                               "sample of n > 1; never an aborted or failed one), by finish reason.",
                               [*labels, "finished_reason"], registry=r)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step (prompt "
                                          "tokens prefilled and tokens decoded).", ITERATION_TOKENS_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the first, "
                              "per request.", TPOT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two consecutive tokens of a request.",
                             TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled (waiting).",
                                    E2E_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      E2E_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.", E2E_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to finish "
                                        "(prefill and decode).", E2E_BUCKETS)
        self._seen: dict[str, int] = {}  # the stats' cumulative counts at the last observe_step
        self._replica: dict | None = None  # the per-replica gauges, made at the first stats of several replicas
        self._spec: dict | None = None  # vLLM's spec_decode_* counters, made at the first speculative stats
        self._spec_seen: dict[str, int] = {}

    def set_cache_config(self, info: Mapping[str, Any]) -> None:
        """``<prefix>:cache_config_info``, vLLM's info gauge (always 1) whose labels are the KV cache's
        settings: ``info``'s keys and values (as strings), e.g. ``block_size``, ``num_gpu_blocks``."""
        labels = {k: str(v) for k, v in info.items()}
        Gauge(f"{self.prefix}:cache_config_info", "The KV cache's settings (labels).", list(labels),
              registry=self.registry).labels(**labels).set(1)

    def _advance(self, stats) -> dict[str, int]:
        """How far each cumulative count of ``stats`` moved since the last call (never negative)."""
        out = {}
        for name in ("num_preemptions", "prompt_tokens", "cached_prompt_tokens", "computed_tokens"):
            now = getattr(stats, name)
            out[name] = max(0, now - self._seen.get(name, 0))
            self._seen[name] = now
        return out

    def _observe_spec(self, stats) -> None:
        """The spec_decode_* counters, advanced to the engine's cumulative counts in ``stats``."""
        if self._spec is None:
            labels, r = ["model_name"], self.registry
            self._spec = {
                "spec_num_drafts": Counter(f"{self.prefix}:spec_decode_num_drafts", "Sequence-steps that verified "
                                           "speculative tokens.", labels, registry=r).labels(self.model_name),
                "spec_num_draft_tokens": Counter(f"{self.prefix}:spec_decode_num_draft_tokens", "Speculative tokens "
                                                 "proposed.", labels, registry=r).labels(self.model_name),
                "spec_num_accepted_tokens": Counter(f"{self.prefix}:spec_decode_num_accepted_tokens", "Speculative "
                                                    "tokens accepted.", labels, registry=r).labels(self.model_name),
                "per_pos": Counter(f"{self.prefix}:spec_decode_num_accepted_tokens_per_pos", "Speculative tokens "
                                   "accepted at each proposal position.", [*labels, "position"], registry=r),
            }
        for name in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens"):
            now = getattr(stats, name)
            self._spec[name].inc(max(0, now - self._spec_seen.get(name, 0)))
            self._spec_seen[name] = now
        for pos, now in enumerate(stats.spec_accepted_per_pos):
            key = f"pos{pos}"
            self._spec["per_pos"].labels(self.model_name, str(pos)).inc(max(0, now - self._spec_seen.get(key, 0)))
            self._spec_seen[key] = now

    def set_queue(self, stats) -> None:
        """Gauges from an :class:`tpengine.engine.llm_engine.EngineStats`."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        total = stats.num_total_blocks
        self.kv_usage.set((total - stats.num_free_blocks) / total if total else 0.0)

    def _observe_replicas(self, replicas: list) -> None:
        """The ``tpengine:replica_*`` gauges from each replica's stats (index = replica)."""
        if self._replica is None:
            labels, r = ["model_name", "replica"], self.registry
            self._replica = {
                "running": Gauge(f"{self.prefix}:replica_num_requests_running", "Requests in a replica's running "
                                 "batch.", labels, registry=r),
                "waiting": Gauge(f"{self.prefix}:replica_num_requests_waiting", "Requests waiting in a replica.",
                                 labels, registry=r),
                "kv": Gauge(f"{self.prefix}:replica_kv_cache_usage_perc", "Fraction of a replica's KV-cache "
                            "blocks in use.", labels, registry=r),
            }
        for d, st in enumerate(replicas):
            self._replica["running"].labels(self.model_name, str(d)).set(st.num_running)
            self._replica["waiting"].labels(self.model_name, str(d)).set(st.num_waiting)
            total = st.num_total_blocks
            used = (total - st.num_free_blocks) / total if total else 0.0
            self._replica["kv"].labels(self.model_name, str(d)).set(used)

    def observe_step(self, stats, outputs: list[EngineOutput], replicas: list | None = None) -> None:
        """After a step: the gauges from ``stats`` (and, with several, each of ``replicas``' stats), the
        counters and histograms from the finished ``outputs``."""
        self.set_queue(stats)
        moved = self._advance(stats)
        self.preemptions.inc(moved["num_preemptions"])
        self.cache_queries.inc(moved["prompt_tokens"])
        self.cache_hits.inc(moved["cached_prompt_tokens"])
        if moved["computed_tokens"]:  # a step ran (not only commands applied)
            self.iteration_tokens.observe(moved["computed_tokens"])
        if replicas is not None and len(replicas) > 1:
            self._observe_replicas(replicas)
        if getattr(stats, "speculative", False):
            self._observe_spec(stats)
        for o in outputs:
            if not o.finished or o.error is not None:  # a failed request generated nothing
                continue
            self.prompt_tokens.inc(len(o.prompt_token_ids))
            self.generation_tokens.inc(o.num_output_tokens)
            for sample in o.outputs:  # each sample of n > 1 (vLLM runs each as its own request)
                if sample.finish_reason not in (None, "abort"):
                    self.success.labels(self.model_name, sample.finish_reason).inc()
            if o.ttft_s is not None:
                self.ttft.observe(o.ttft_s)
            if o.tpot_s is not None:
                self.tpot.observe(o.tpot_s)
            if o.latency_s is not None:
                self.e2e.observe(o.latency_s)
            for itl in o.itl_s:
                self.itl.observe(itl)
            if o.queue_s is not None:
                self.queue_time.observe(o.queue_s)
                if o.ttft_s is not None and o.latency_s is not None:
                    self.prefill_time.observe(max(0.0, o.ttft_s - o.queue_s))
                    self.decode_time.observe(max(0.0, o.latency_s - o.ttft_s))
                    self.inference_time.observe(max(0.0, o.latency_s - o.queue_s))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
