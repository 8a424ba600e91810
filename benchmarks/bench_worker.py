"""One system under benchmark, in its own process(es), driven by :mod:`benchmarks.bench`.

    python -m benchmarks.bench_worker --system hf --model DIR --dtype float32 --threads 2
    python -m benchmarks.bench_worker --system engine --model DIR --dtype float32 ...     (tp=1)
    torchrun --standalone --nproc_per_node=2 -m benchmarks.bench_worker --system engine ...  (tp=2)
    python -m benchmarks.bench_worker --system engine --dtype bfloat16 --quantization int4 ...
    python -m benchmarks.bench_worker --system engine --dtype bfloat16 --kv-cache-dtype int8 ...
    python -m benchmarks.bench_worker --system engine --job-tokens 8192 ...  (measure as a batch job of that work)
    torchrun ... -m benchmarks.bench_worker --system engine --enable-expert-parallel ...  (MoE: experts per rank)

The model is loaded once and warmed up (rank 0 then says ``{"ready", "threads": [per rank],
"weight_bytes": [per rank], "load_s"}``); then rank 0 reads one JSON command per stdin line and
answers each with one stdout line ``@@bench {json}`` (everything else goes to stderr or is
ignored), so the driver can alternate systems without reloading them. At tp > 1 rank 0
broadcasts each command and every rank runs it (``LLMEngine.generate`` is SPMD).

Commands (all greedy; every request makes exactly ``output_len`` tokens):

* ``{"cmd": "throughput", "prompts": [[ids...], ...], "output_len": n}`` -> ``{"elapsed_s",
  "output_tokens", "prompt_tokens", "ttft_s": [s per request]}``: all requests at once (engine:
  continuous batching with ``ignore_eos``, TTFT = each request's arrival to its first token, plus
  ``"stats"``, the prefix-cache counters of this command: ``prompt_tokens``,
  ``cached_prompt_tokens``, ``prefix_cache_hit_rate``, ``steps``, ``prefill_steps``,
  ``computed_tokens``; HF: ``generate`` on left-padded static batches of ``--hf-batch-size``,
  TTFT = the command's start to its batch's first token).
* ``{"cmd": "latency", "prompt": [ids...], "output_len": n}`` -> ``{"ttft_s", "latency_s"}``
  for one request (TTFT = arrival to first token, as in vLLM's benchmarks; engine: also
  ``"stats"``, and with ``"token_ids": true`` in the command its output's ``"token_ids"``).
* engine, tp=1 only: ``{"cmd": "interference", "running_prompts": [[ids...], ...],
  "running_output_len": n, "long_prompt": [ids...], "start_after": k}`` -> see
  :meth:`EngineSystem.interference` (the decode gaps of running requests while a long prompt is
  prefilled; :mod:`benchmarks.chunked_prefill`).
* engine: ``{"cmd": "configure", "enable_chunked_prefill": bool, "max_num_batched_tokens": n,
  "enable_prefix_caching": bool, "warmup": [[ids...], ...]}`` (every key optional) -> ``{"load_s",
  "max_num_batched_tokens"}``: build the engine again with these settings (the model is loaded
  again, outside any measurement) and warm it up, also on the ``warmup`` prompts (2 tokens each).
* ``{"cmd": "quit"}`` (or end of stdin).

Every engine command starts from an empty prefix cache (:meth:`LLMEngine.reset_prefix_cache`),
so rounds that repeat the same prompts measure the same work.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import typer

from benchmarks.hf_system import WARMUP_PROMPTS, FirstTokenTimer, HFSystem, hf_attn_for  # noqa: F401 (re-exported)

MARK = "@@bench "


def _say(obj: dict) -> None:
    print(MARK + json.dumps(obj), flush=True)


class EngineSystem:
    """tpengine's LLMEngine on this rank (every rank of a torchrun group builds one).

    ``max_num_batched_tokens`` 0 means ``max(8192, max_model_len)`` (every prompt in one step);
    ``enable_prefix_caching``, ``enable_chunked_prefill``, ``quantization`` (None, "int8",
    "int4"), ``enable_expert_parallel`` and ``kv_cache_dtype`` are the EngineConfig fields. ``weight_bytes``: every
    rank's model weight bytes (``ModelRunner.weight_bytes``), rank order.

    Raises:
        ValueError: an invalid setting (from EngineConfig, naming the field).
    """

    def __init__(self, model: str, dtype: str, threads: int | None, max_num_seqs: int, max_model_len: int,
                 num_kv_blocks: int | None, max_num_batched_tokens: int = 0, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, quantization: str | None = None,
                 speculative_config: str | None = None, enable_expert_parallel: bool = False,
                 kv_cache_dtype: str = "auto"):
        from tpengine.config import EngineConfig

        self.base = EngineConfig(model=model, dtype=dtype, threads=threads, max_num_seqs=max_num_seqs,
                                 max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, dist_timeout_s=3600.0,
                                 max_num_batched_tokens=max_num_batched_tokens or max(8192, max_model_len),
                                 enable_prefix_caching=enable_prefix_caching,
                                 enable_chunked_prefill=enable_chunked_prefill, quantization=quantization,
                                 speculative_config=speculative_config, enable_expert_parallel=enable_expert_parallel,
                                 kv_cache_dtype=kv_cache_dtype)
        self._build(self.base)

    def _build(self, cfg) -> None:
        from tpengine.engine.llm_engine import LLMEngine

        self.engine = None  # the old engine (its weights and KV cache) goes before the new one loads
        self.engine = LLMEngine(cfg)
        self.tp = self.engine.tp
        mine = (torch.get_num_threads(), self.engine.runner.weight_bytes)
        every = [mine]
        if self.tp.size > 1:
            every = [None] * self.tp.size
            torch.distributed.all_gather_object(every, mine)
        self.threads, self.weight_bytes = [t for t, _ in every], [b for _, b in every]

    def configure(self, settings: dict) -> dict:
        """Build the engine again from the startup settings with ``settings`` applied
        (``enable_chunked_prefill``, ``max_num_batched_tokens``, ``enable_prefix_caching``; 0 or
        missing max_num_batched_tokens: ``max(8192, max_model_len)``), warm it up (also on
        ``settings["warmup"]`` prompts, 2 tokens each). Returns ``{"load_s",
        "max_num_batched_tokens"}``.

        Raises:
            ValueError: an unknown key, or an invalid value (from EngineConfig).
        """
        known = {"enable_chunked_prefill", "max_num_batched_tokens", "enable_prefix_caching", "warmup"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"configure: unknown setting(s) {unknown}; valid: {', '.join(sorted(known))}")
        t0 = time.perf_counter()
        changes = {k: v for k, v in settings.items() if k != "warmup"}
        if not changes.get("max_num_batched_tokens"):
            changes["max_num_batched_tokens"] = max(8192, self.base.max_model_len)
        self._build(self.base.replace(**changes))
        self.throughput(WARMUP_PROMPTS, 2)
        if settings.get("warmup"):
            self.throughput(settings["warmup"], 2)
        return {"load_s": time.perf_counter() - t0,
                "max_num_batched_tokens": self.engine.config.max_num_batched_tokens}

    def _run(self, prompts: list[list[int]], n: int):
        from tpengine.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = self.engine.generate([(f"r{i}", p, sp) for i, p in enumerate(prompts)] if self.tp.is_driver else [])
        if self.tp.is_driver:
            bad = [o.request_id for o in outs if o.error or len(o.token_ids) != n]
            assert not bad and len(outs) == len(prompts), f"requests without {n} tokens: {bad}"
        return outs

    def throughput(self, prompts: list[list[int]], n: int) -> dict:
        self.engine.reset_prefix_cache()  # no blocks cached by an earlier command
        before = self.engine.stats() if self.tp.is_driver else None
        t0 = time.perf_counter()
        outs = self._run(prompts, n)
        res = {"elapsed_s": time.perf_counter() - t0, "output_tokens": sum(len(o.token_ids) for o in outs),
               "prompt_tokens": sum(map(len, prompts))}
        if self.tp.is_driver:
            order = {f"r{i}": i for i in range(len(prompts))}
            res["ttft_s"] = [o.ttft_s for o in sorted(outs, key=lambda o: order[o.request_id])]
            res["stats"] = self._stats_since(before)
        return res

    def _stats_since(self, before) -> dict:
        """The prefix-cache and step counters since ``before`` (an EngineStats taken after the reset)."""
        s = self.engine.stats()
        prompt, cached = s.prompt_tokens - before.prompt_tokens, s.cached_prompt_tokens - before.cached_prompt_tokens
        out = {"prompt_tokens": prompt, "cached_prompt_tokens": cached,
               "prefix_cache_hit_rate": cached / prompt if prompt else 0.0, "steps": s.steps - before.steps,
               "prefill_steps": s.prefill_steps - before.prefill_steps,
               "computed_tokens": s.computed_tokens - before.computed_tokens}
        if s.speculative:
            out.update({k: getattr(s, k) - getattr(before, k) for k in (
                "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")})
        return out

    def latency(self, prompt: list[int], n: int, token_ids: bool = False) -> dict:
        self.engine.reset_prefix_cache()  # no blocks cached by an earlier command
        before = self.engine.stats() if self.tp.is_driver else None
        outs = self._run([prompt], n)
        if not outs:
            return {}
        res = {"ttft_s": outs[0].ttft_s, "latency_s": outs[0].latency_s, "stats": self._stats_since(before)}
        return {**res, "token_ids": list(outs[0].token_ids)} if token_ids else res

    def interference(self, running_prompts: list[list[int]], running_output_len: int, long_prompt: list[int],
                     start_after: int) -> dict:
        """Rank 0 at tp=1: start ``running_prompts`` (``running_output_len`` tokens each,
        ``ignore_eos``, greedy); after the first step at whose end each has >= ``start_after``
        tokens, add ``long_prompt`` (1 output token); step until all finish, timing each
        ``engine.step()`` with ``time.perf_counter``.

        Returns:
            ``{"step_s": [s per step], "gaps_s": [s between consecutive tokens of a running request,
            every request's gaps in order], "long_ttft_s": arrival -> first token of the long prompt,
            "long_added_step": index of the first step after it was added, "running_tokens": tokens
            the running requests made, "decode_s": first step's start to the last running request's
            last token, "max_num_batched_tokens", "enable_chunked_prefill", "stats"}``. A token's time is the end of
            the step that sampled it.

        Raises:
            ValueError: tp > 1 (this loop drives ``step()`` itself, without the broadcasts of
                ``generate``), or ``start_after`` >= ``running_output_len``.
        """
        from tpengine.sampling_params import SamplingParams

        if self.tp.size != 1:
            raise ValueError(f"interference runs at tp=1 only, not tp={self.tp.size}")
        if not 1 <= start_after < running_output_len:
            raise ValueError(f"start_after={start_after} must be in [1, running_output_len={running_output_len})")
        self.engine.reset_prefix_cache()  # no blocks cached by an earlier command
        e = self.engine
        before = e.stats()
        run = SamplingParams(temperature=0.0, max_tokens=running_output_len, ignore_eos=True)
        for i, p in enumerate(running_prompts):
            e.add_request(f"run{i}", p, run)
        times: dict[str, list[float]] = {f"run{i}": [] for i in range(len(running_prompts))}
        step_s, long_out, long_added = [], None, None
        t_start = time.perf_counter()
        while e.has_unfinished():
            t0 = time.perf_counter()
            finished = e.step()
            t1 = time.perf_counter()
            step_s.append(t1 - t0)
            counts = {s.request_id: s.num_completion_tokens for s in e.scheduler.running}
            for o in finished:
                if o.error:
                    raise RuntimeError(f"request {o.request_id} failed: {o.error}")
                counts[o.request_id] = len(o.token_ids)
                if o.request_id == "long":
                    long_out = o
            for rid, ts in times.items():
                ts += [t1] * (counts.get(rid, len(ts)) - len(ts))
            if long_added is None and all(len(ts) >= start_after for ts in times.values()):
                e.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
                long_added = len(step_s)
        bad = [rid for rid, ts in times.items() if len(ts) != running_output_len]
        assert not bad and long_out is not None, f"running requests without {running_output_len} tokens: {bad}"
        gaps = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
        return {"step_s": step_s, "gaps_s": gaps, "long_ttft_s": long_out.ttft_s, "long_added_step": long_added,
                "running_tokens": sum(map(len, times.values())),
                "decode_s": max(ts[-1] for ts in times.values()) - t_start,
                "max_num_batched_tokens": e.config.max_num_batched_tokens,
                "enable_chunked_prefill": e.config.enable_chunked_prefill, "stats": self._stats_since(before)}


def serve(system, driver: bool, sync) -> None:
    """The command loop: rank 0 reads stdin, ``sync`` shares each command with the other ranks."""
    while True:
        cmd = None
        if driver:
            line = sys.stdin.readline()
            cmd = json.loads(line) if line.strip() else {"cmd": "quit"}
        cmd = sync(cmd)
        if cmd["cmd"] == "quit":
            return
        attn = {"attn": cmd["attn"]} if "attn" in cmd else {}  # HF: the attention implementation of this run
        if cmd["cmd"] == "throughput":
            res = system.throughput(cmd["prompts"], cmd["output_len"], **attn)
        elif cmd["cmd"] == "interference":
            res = system.interference(cmd["running_prompts"], cmd["running_output_len"], cmd["long_prompt"],
                                      cmd["start_after"])
        elif cmd["cmd"] == "configure":
            res = system.configure({k: v for k, v in cmd.items() if k != "cmd"})
        else:
            ids = {"token_ids": True} if cmd.get("token_ids") else {}  # the engine's output tokens too
            res = system.latency(cmd["prompt"], cmd["output_len"], **attn, **ids)
        if driver:
            _say(res)


def main(system: str = typer.Option(..., help="hf or engine"),
         model: str = typer.Option(..., help="HF model folder"),
         dtype: str = typer.Option("float32"),
         threads: int = typer.Option(0, help="intra-op threads (engine: per rank; 0 = cores / tp)"),
         max_num_seqs: int = typer.Option(64), max_model_len: int = typer.Option(256),
         num_kv_blocks: int = typer.Option(0, help="engine KV blocks (0 = from kv_cache_gb)"),
         hf_batch_size: int = typer.Option(64),
         hf_attn: str = typer.Option("auto", help="HF attn_implementation: auto, sdpa, eager"),
         max_num_batched_tokens: int = typer.Option(0, help="engine tokens per step (0 = max(8192, "
                                                         "max_model_len): every prompt in one step)"),
         enable_prefix_caching: bool = typer.Option(True, help="engine: automatic prefix caching"),
         chunked_prefill: bool = typer.Option(True, help="engine: enable_chunked_prefill"),
         quantization: str = typer.Option("", help="engine: weight-only int8 or int4 (empty: float weights)"),
         speculative_config: str = typer.Option("", help="engine: vLLM's speculative-config JSON (empty: off)"),
         enable_expert_parallel: bool = typer.Option(False, help="engine: a MoE model's experts whole per rank"),
         kv_cache_dtype: str = typer.Option("auto", help="engine: the KV cache's storage, auto or int8"),
         job_tokens: int = typer.Option(0, help="engine: the tokens the driver will ask for, stated while the "
                                                "engine loads as a batch job states its work (its measuring "
                                                "budget in proportion); 0: nothing stated"),
         ) -> None:
    t0 = time.perf_counter()
    warm = WARMUP_PROMPTS
    if system == "hf":
        sysm = HFSystem(model, getattr(torch, dtype), threads or torch.get_num_threads(), hf_batch_size, hf_attn)
        driver, sync = True, lambda c: c
    else:
        from tpengine.entrypoints.run import stated_work

        # the same measuring budget as `python -m tpengine.run` gives a job of this work: with the 1 s default a
        # fresh cache's first shapes spend it and the rest (the tied LM head) keep their unmeasured defaults
        with stated_work(job_tokens or None):
            sysm = EngineSystem(model, dtype, threads or None, max_num_seqs, max_model_len, num_kv_blocks or None,
                                max_num_batched_tokens, enable_prefix_caching, chunked_prefill, quantization or None,
                                speculative_config or None, enable_expert_parallel, kv_cache_dtype)
        driver = sysm.tp.is_driver

        def sync(c):
            if sysm.tp.size == 1:
                return c
            box = [c]
            torch.distributed.broadcast_object_list(box, src=0)
            return box[0]

    sysm.throughput(warm, 2)  # warm-up (allocator, oneDNN primitives, lazy imports)
    if driver:
        _say({"ready": True, "threads": sysm.threads, "weight_bytes": sysm.weight_bytes,
              "load_s": time.perf_counter() - t0})
    serve(sysm, driver, sync)
    if system != "hf":
        sysm.engine.shutdown()


if __name__ == "__main__":
    typer.run(main)
