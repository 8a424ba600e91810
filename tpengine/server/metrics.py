"""The server's Prometheus metrics (``GET /metrics``), named after vLLM's (``vllm:`` becomes
``tpengine:``): queue gauges, KV-cache usage, token counters and latency histograms (seconds)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tpengine.engine.outputs import EngineOutput

# vLLM's bucket bounds (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The metrics of one server, in their own registry.

    ``observe_step(stats, outputs, replicas)`` runs in the engine loop after every step (queue sizes,
    KV-cache usage, tokens, finished requests' latencies); ``set_queue(stats)`` refreshes the gauges
    alone. The gauges count every data-parallel replica; with several, ``tpengine:replica_*`` gauges
    (a ``replica`` label) give each one's.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(f"tpengine:{name}", doc, labels, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = all).")
        self.prompt_tokens = Counter("tpengine:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("tpengine:generation_tokens", "Generated tokens of finished requests.",
                                         labels, registry=r).labels(model_name)
        self.success = Counter("tpengine:request_success", "Finished requests, by finish reason.",
                               [*labels, "finished_reason"], registry=r)
        self.ttft = Histogram("tpengine:time_to_first_token_seconds", "Arrival to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("tpengine:time_per_output_token_seconds", "Mean time per output token after "
                              "the first, per request.", labels, buckets=TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("tpengine:e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self._replica: dict | None = None  # the per-replica gauges, made at the first stats of several replicas
        self._spec: dict | None = None  # vLLM's spec_decode_* counters, made at the first speculative stats
        self._spec_seen: dict[str, int] = {}

    def _observe_spec(self, stats) -> None:
        """The spec_decode_* counters, advanced to the engine's cumulative counts in ``stats``."""
        if self._spec is None:
            labels, r = ["model_name"], self.registry
            self._spec = {
                "spec_num_drafts": Counter("tpengine:spec_decode_num_drafts", "Sequence-steps that verified "
                                           "speculative tokens.", labels, registry=r).labels(self.model_name),
                "spec_num_draft_tokens": Counter("tpengine:spec_decode_num_draft_tokens", "Speculative tokens "
                                                 "proposed.", labels, registry=r).labels(self.model_name),
                "spec_num_accepted_tokens": Counter("tpengine:spec_decode_num_accepted_tokens", "Speculative "
                                                    "tokens accepted.", labels, registry=r).labels(self.model_name),
                "per_pos": Counter("tpengine:spec_decode_num_accepted_tokens_per_pos", "Speculative tokens "
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
                "running": Gauge("tpengine:replica_num_requests_running", "Requests in a replica's running "
                                 "batch.", labels, registry=r),
                "waiting": Gauge("tpengine:replica_num_requests_waiting", "Requests waiting in a replica.",
                                 labels, registry=r),
                "kv": Gauge("tpengine:replica_kv_cache_usage_perc", "Fraction of a replica's KV-cache blocks in use.",
                            labels, registry=r),
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
        if replicas is not None and len(replicas) > 1:
            self._observe_replicas(replicas)
        if getattr(stats, "speculative", False):
            self._observe_spec(stats)
        for o in outputs:
            if not o.finished or o.error is not None:
                continue
            n = len(o.token_ids)
            self.prompt_tokens.inc(len(o.prompt_token_ids))
            self.generation_tokens.inc(n)
            self.success.labels(self.model_name, o.finish_reason or "abort").inc()
            if o.ttft_s is not None:
                self.ttft.observe(o.ttft_s)
            if o.tpot_s is not None:
                self.tpot.observe(o.tpot_s)
            if o.latency_s is not None:
                self.e2e.observe(o.latency_s)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
