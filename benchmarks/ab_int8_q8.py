"""int8 weights' batch-1 decode, the float kernel against the int8 x int8 one, in one process (issue 59).

    python -m benchmarks.ab_int8_q8 [--model DIR] [--rounds 4] [--threads N] [--clock wall|cpu]

Loads the model once with ``--quantization int8`` in bfloat16 (tp=1), puts every quantized product's
one-row path on tpengine's C kernels (``gemv_rows`` 8, so the decode program binds), then alternates,
round by round, ``q8_rows`` 0 (``tpe_qgemv_int8``, the activations' float32 sums) and 8
(``tpe_qgemv_int8_q8``, the activations quantized to int8 per 32), the backend binding again each time:
one greedy request of 64 tokens after a 128-token prompt a round, time per decoded token (the step after
the prompt's), best round of each; the first round of each is a warm-up. Prints both, their ratio and the
load average. About a minute after the load.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from tpengine.backends.cpu import linear_layout
from tpengine.config import DEFAULT_MODEL_DIR, EngineConfig
from tpengine.engine.llm_engine import LLMEngine
from tpengine.sampling_params import SamplingParams


def pin(engine: LLMEngine, q8_rows: int) -> None:
    """Every quantized product on tpengine's kernel at 1..8 rows, with int8 activations up to ``q8_rows``."""
    stack = engine.runner.model.model
    for layer in stack.layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            m.quant.gemv_rows, m.quant.q8_rows = 8, q8_rows
            m.bind(linear_layout.bind_layer(m))
    engine.runner.backend.bind_model(stack, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL_DIR)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    engine = LLMEngine(EngineConfig(model=a.model, dtype="bfloat16", quantization="int8", max_model_len=512,
                                    kv_cache_gb=0.1, enable_prefix_caching=False, threads=a.threads))
    prompt = torch.randint(100, 10000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    sp1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    sp = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
    best = {0: float("inf"), 8: float("inf")}
    print(f"load average {os.getloadavg()[0]:.2f}, {a.threads} threads, {a.clock} clock")
    for rnd in range(a.rounds):
        for q8 in (0, 8) if rnd % 2 == 0 else (8, 0):
            pin(engine, q8)
            assert engine.runner.backend.program is not None, "no decode program bound"
            t = clock()
            engine.generate([("p", prompt, sp1)])
            first = clock() - t
            t = clock()
            engine.generate([("r", prompt, sp)])
            per = (clock() - t - first) / 64
            if rnd:
                best[q8] = min(best[q8], per)
            print(f"round {rnd} {'int8 x int8' if q8 else 'float kernel'}: {per * 1e3:.2f} ms/token")
    print(f"best: float kernel {best[0] * 1e3:.2f} ms, int8 x int8 {best[8] * 1e3:.2f} ms, "
          f"{best[0] / best[8]:.2f}x; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
