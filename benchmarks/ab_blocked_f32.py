"""float32 batch-1 decode, every linear and the tied LM head in the float32 blocked layout against the plain
weights on the GEMV kernel, in one process (issue 59); ``--dtype bfloat16`` the same in bfloat16 (its blocked
layout, on an AVX2 build too: ``TPENGINE_ISA=avx2``).

    python -m benchmarks.ab_blocked_f32 [--model DIR] [--rounds 4] [--threads N] [--clock wall|cpu] [--dtype bfloat16]

Loads the model once in float32 (or ``--dtype``) with ``cpu_linear="blocked"`` (tp=1), keeps a plain copy of every
weight beside it, then alternates, round by round, the blocked layout (``tpe_blocked_gemm_f32``) and the plain one
(``tpe_gemv_f32`` / ``_bf16`` at 1..8 rows; the tied head plain too, the embedding reading its rows), the layers and the
backend bound again each time (the decode program binds on both): one greedy request of 64 tokens after a
128-token prompt a round, time per decoded token (the step after the prompt's), best round of each; the first
round of each is a warm-up. Checks that both give the same tokens. Prints both, their ratio and the load
average. About a minute after the load.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from tpengine.backends.cpu import cpu_blocked, greedy, linear_layout
from tpengine.config import DEFAULT_MODEL_DIR, EngineConfig
from tpengine.engine.llm_engine import LLMEngine
from tpengine.sampling_params import SamplingParams


def layouts(engine: LLMEngine, dtype: torch.dtype = torch.float32) -> dict:
    """``layout -> setter()``: "blocked" and "plain", each rebinding every linear, the head and the backend."""
    model = engine.runner.model
    head, emb = model.lm_head, model.get_input_embeddings()
    mods = [m for m in model.modules() if hasattr(m, "pack")]
    assert all(cpu_blocked.is_blocked(m.packed) for m in mods), "not every linear is blocked"
    blocked = {m: m.packed for m in mods}
    plain = {m: torch.nn.Parameter(cpu_blocked.unpack(b).contiguous(), requires_grad=False) for m, b in blocked.items()}

    def put(kind: str) -> None:
        for m in mods:
            m.packed, m.weight = (blocked[m], None) if kind == "blocked" else (None, plain[m])
            m.kernels = () if kind == "blocked" else ("gemv", "gemv", "plain")
            m.bind(linear_layout.bind_layer(m, head=m is head))
        if kind == "blocked":
            emb.weight, emb.lookup = None, (lambda ids: cpu_blocked.rows(blocked[head], ids))
        else:
            emb.weight, emb.lookup = plain[head], None
        greedy.bind_head(head, dtype, True)
        engine.runner.backend.bind_model(model.model, 1)
        assert engine.runner.backend.program is not None, "no decode program bound"
    return {"blocked": lambda: put("blocked"), "plain": lambda: put("plain")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL_DIR)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    engine = LLMEngine(EngineConfig(model=a.model, dtype=a.dtype, cpu_linear="blocked", max_model_len=512,
                                    kv_cache_gb=0.1, enable_prefix_caching=False, threads=a.threads))
    setters = layouts(engine, getattr(torch, a.dtype))
    prompt = torch.randint(100, 10000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    sp1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    sp = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
    best, texts = {k: float("inf") for k in setters}, {}
    print(f"load average {os.getloadavg()[0]:.2f}, {a.threads} threads, {a.dtype}, {a.clock} clock")
    for rnd in range(a.rounds):
        for kind in tuple(setters) if rnd % 2 == 0 else tuple(reversed(setters)):
            setters[kind]()
            t = clock()
            engine.generate([("p", prompt, sp1)])
            first = clock() - t
            t = clock()
            out = engine.generate([("r", prompt, sp)])
            per = (clock() - t - first) / 64
            texts.setdefault(kind, [list(o.token_ids) for o in out])
            if rnd:
                best[kind] = min(best[kind], per)
            print(f"round {rnd} {kind}: {per * 1e3:.2f} ms/token")
    same = texts["blocked"] == texts["plain"]
    print(f"best: blocked {best['blocked'] * 1e3:.2f} ms, plain GEMV {best['plain'] * 1e3:.2f} ms, "
          f"{best['plain'] / best['blocked']:.2f}x; same tokens: {same}; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
