"""Where the bench's throughput workload spends its time, per op, in one process (tp=1): ``make bench``'s
64 prompts x 128 tokens in, 128 out, greedy, all prompts in one 8192-token prefill step, then the decode
steps at up to 64 rows.

    python -m benchmarks.throughput_profile [--model DIR] [--dtype float32] [--threads 1] [--clock cpu|wall]
                                            [--cpu-linear auto|blocked|...] [--measure-busy]

The engine loads, runs the workload once (a warm-up: the KV pages touched, oneDNN's primitives made), then again
with a timer around each linear layer's bound call (by layer kind and rows: "prefill" past 64), the attention
backend's forward (prefill / decode), the MLP's activation, the decoder stack and the model runner's step,
and prints each one's seconds, calls and time per call, then the load average. ``--clock cpu`` (the calling
thread's CPU time) at ``--threads 1`` holds on a loaded machine: every kernel then runs on that thread; at 2
threads only ``--clock wall`` counts the second one, and a shared machine's load stalls its OpenMP barriers.
``--cpu-linear blocked`` pins the layouts (a busy machine measures nothing and takes the packed default).
``--measure-busy`` makes the load's measured choices (the blocked GEMM's AMX start, the paged kernel's AMX path,
the greedy pick, an auto layout) even on a busy machine and without the measuring budget, as a quiet start of
``make bench``'s worker would; the timings are the loaded machine's (a choice may differ from a quiet one's; the
load's log line names each), so nothing is cached. About a minute at one thread.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

from benchmarks.bench import random_prompts
from tpengine.backends.cpu import measured
from tpengine.backends.cpu.attention import CPUAttentionBackend
from tpengine.config import DEFAULT_MODEL_DIR, EngineConfig
from tpengine.engine.llm_engine import LLMEngine
from tpengine.model.layers.linear import _Packable
from tpengine.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL_DIR)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--cpu-linear", default="auto")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--measure-busy", action="store_true",
                   help="measure the load's choices on a busy machine too, with no measuring budget")
    a = p.parse_args()
    if a.measure_busy:  # measured on a loaded machine: used for this run, never cached for a quiet start
        measured.probe_busy = lambda: False
        measured.write_cache = lambda path, data: None
        os.environ.setdefault("TPENGINE_MEASURE_BUDGET_S", "inf")
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    eng = LLMEngine(EngineConfig(model=a.model, dtype=a.dtype, threads=a.threads, max_num_seqs=a.num_prompts,
                                 max_model_len=a.input_len + a.output_len, cpu_linear=a.cpu_linear,
                                 max_num_batched_tokens=max(8192, a.num_prompts * a.input_len)))
    prompts = random_prompts(a.num_prompts, a.input_len, eng.runner.hf_config.vocab_size, 0)
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)

    def workload() -> float:
        eng.reset_prefix_cache()
        start = clock()
        eng.generate([(f"r{i}", q, params) for i, q in enumerate(prompts)])
        return clock() - start

    workload()
    seconds, calls = collections.defaultdict(float), collections.Counter()

    def timed(key, fn):
        def run(*args, **kwargs):
            start = clock()
            out = fn(*args, **kwargs)
            seconds[key] += clock() - start
            calls[key] += 1
            return out
        return run

    def rows(n: int) -> str:
        return "prefill" if n > 64 else str(n)

    model = eng.runner.model
    for name, m in model.named_modules():
        if isinstance(m, _Packable) and m.impl is not None:
            impl, kind = m.impl, name.rsplit(".", 1)[-1]
            m.impl = lambda x, impl=impl, kind=kind: timed((kind, rows(x.shape[0])), impl)(x)
    for layer in model.model.layers:
        if layer.mlp.bound_act is not None:
            layer.mlp.bound_act = timed(("activation", "-"), layer.mlp.bound_act)
    backend_forward, stack_forward, execute = (CPUAttentionBackend.forward, type(model.model).forward,
                                               type(eng.runner).execute)
    try:
        CPUAttentionBackend.forward = lambda self, qkv, rope, layer, ctx: timed(
            ("attention", "prefill" if ctx.is_prefill else "decode"), backend_forward)(self, qkv, rope, layer, ctx)
        type(model.model).forward = lambda self, ids, *rest: timed(("decoder stack", rows(ids.shape[0])),
                                                                   stack_forward)(self, ids, *rest)
        type(eng.runner).execute = lambda self, plan, *rest: timed(("model runner step", plan.kind.name),
                                                                   execute)(self, plan, *rest)
        total = workload()
    finally:
        CPUAttentionBackend.forward, type(model.model).forward, type(eng.runner).execute = (
            backend_forward, stack_forward, execute)
    tokens = a.num_prompts * a.output_len
    print(f"workload {total:.2f} s ({a.clock} clock, {a.threads} threads): {tokens / total:.1f} output tok/s")
    for key in sorted(seconds, key=lambda k: -seconds[k]):
        print(f"  {key[0]:>18} {key[1]:>8}: {seconds[key]:8.2f} s  {calls[key]:6d} calls  "
              f"{seconds[key] / calls[key] * 1e3:9.3f} ms a call")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
