"""One system of :mod:`benchmarks.bench_scale`, run once in its own process(es), so each process's
peak resident memory is its own.

    python -m benchmarks.scale_worker --system hf --model DIR ...
    python -m benchmarks.scale_worker --system engine --model DIR ...                        (tp=1)
    torchrun --standalone --nproc_per_node=2 -m benchmarks.scale_worker --system engine ...  (tp=2)

It loads the model in bfloat16 (HF: ``from_pretrained``; engine: ``LLMEngine`` construction,
timed as ``load_s``), runs two short warm-up requests, then the workload: ``--requests`` random
prompts (fixed seed) of ``--prompt-len`` tokens, greedy, exactly ``--output-len`` new tokens each
(``ignore_eos`` / ``min_new_tokens``), all submitted at once (HF: one static batch). Rank 0 prints
one line ``@@bench {json}``:

``{"system", "tp", "load_s", "warmup_s", "elapsed_s", "output_tokens", "prompt_tokens",
"ttft_s": [per request], "tpot_s": [per request], "ranks": [{"rank", "peak_rss_bytes",
"load_peak_rss_bytes", "weight_bytes", "kv_bytes"}, ...]}``

``peak_rss_bytes`` is ``VmHWM`` of ``/proc/self/status`` at the end (``load_peak_rss_bytes``: right
after loading); ``weight_bytes`` the rank's weights (the engine's ``ModelRunner.weight_bytes`` where it has one,
else its parameters, unique storages), ``kv_bytes`` its KV cache
(engine: the allocated cache; HF: the DynamicCache the workload fills, computed from the config).
TTFT is arrival to first token and TPOT = (latency - TTFT) / (output tokens - 1) (vLLM's).
"""

from __future__ import annotations

import time

import torch
import typer

from benchmarks.bench import random_prompts
from benchmarks.bench_worker import MARK, FirstTokenTimer, HFSystem

WARMUP = [[3, 4, 5, 6], [7, 8, 9, 10]]  # two requests: a batch, as in the workload


def vm_hwm_bytes() -> int | None:
    """This process's peak resident set size (``VmHWM``) in bytes; None where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        return None
    return None


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters, each storage counted once (fused or tied weights)."""
    seen: dict[int, int] = {}
    for p in module.parameters():
        s = p.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def hf_kv_bytes(config, batch: int, tokens: int, dtype: torch.dtype) -> int:
    """K and V of ``batch`` sequences of ``tokens`` tokens over all layers, bytes."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize
    return batch * tokens * per_token


def run_hf(model: str, prompts: list[list[int]], n: int) -> tuple[dict, dict]:
    """HF ``generate`` on one static batch: (timings, this process's memory record)."""
    t0 = time.perf_counter()
    # eager, not "auto": timing both implementations on a multi-GB model would cost minutes
    hf = HFSystem(model, torch.bfloat16, torch.get_num_threads(), len(prompts), "eager")
    load_s, load_peak = time.perf_counter() - t0, vm_hwm_bytes()
    t0 = time.perf_counter()
    hf._generate(WARMUP, 2)
    warmup_s = time.perf_counter() - t0
    timer = FirstTokenTimer()
    t0 = time.perf_counter()
    out = hf._generate(prompts, n, streamer=timer)
    t1 = time.perf_counter()
    assert out.shape == (len(prompts), n), out.shape
    ttft = timer.first - t0
    tpot = (t1 - timer.first) / max(1, n - 1)
    timing = {"system": "hf", "tp": 1, "attn_implementation": hf.attn, "load_s": load_s, "warmup_s": warmup_s,
              "elapsed_s": t1 - t0, "output_tokens": out.numel(), "prompt_tokens": sum(map(len, prompts)),
              "ttft_s": [ttft] * len(prompts), "tpot_s": [tpot] * len(prompts)}
    mem = {"rank": 0, "peak_rss_bytes": vm_hwm_bytes(), "load_peak_rss_bytes": load_peak,
           "weight_bytes": module_bytes(hf.model),
           "kv_bytes": hf_kv_bytes(hf.model.config, len(prompts), len(prompts[0]) + n, torch.bfloat16)}
    return timing, mem


def run_engine(model: str, prompts: list[list[int]], n: int, kv_cache_gb: float, max_model_len: int) -> tuple:
    """tpengine on this rank (SPMD: every rank calls it): (timings on rank 0 else None, the
    memory records of every rank on rank 0 else None)."""
    from tpengine.config import EngineConfig
    from tpengine.engine.llm_engine import LLMEngine
    from tpengine.sampling_params import SamplingParams

    cfg = EngineConfig(model=model, dtype="bfloat16", kv_cache_gb=kv_cache_gb, max_model_len=max_model_len,
                       max_num_seqs=len(prompts), dist_timeout_s=3600.0)
    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    load_s, load_peak = time.perf_counter() - t0, vm_hwm_bytes()
    tp, driver = engine.tp, engine.tp.is_driver
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate([(f"warmup{i}", p, warm) for i, p in enumerate(WARMUP)] if driver else [])
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = engine.generate([(f"r{i}", p, sp) for i, p in enumerate(prompts)] if driver else [])
    elapsed = time.perf_counter() - t0
    mem = {"rank": tp.rank, "peak_rss_bytes": vm_hwm_bytes(), "load_peak_rss_bytes": load_peak,
           "weight_bytes": getattr(engine.runner, "weight_bytes", None) or module_bytes(engine.runner.model),
           "kv_bytes": engine.runner.kv_cache.nbytes}
    mems = [mem]
    if tp.size > 1:
        mems = [None] * tp.size
        torch.distributed.all_gather_object(mems, mem)
    engine.shutdown()
    if not driver:
        return None, None
    bad = [o.request_id for o in outs if o.error or len(o.token_ids) != n]
    assert not bad and len(outs) == len(prompts), f"requests without {n} tokens: {bad}"
    timing = {"system": "engine", "tp": tp.size, "load_s": load_s, "warmup_s": warmup_s, "elapsed_s": elapsed,
              "output_tokens": sum(len(o.token_ids) for o in outs), "prompt_tokens": sum(map(len, prompts)),
              "ttft_s": [o.ttft_s for o in outs],
              "tpot_s": [(o.latency_s - o.ttft_s) / max(1, n - 1) for o in outs]}
    return timing, mems


def main(system: str = typer.Option(..., help="hf or engine"),
         model: str = typer.Option(..., help="HF model folder"),
         requests: int = typer.Option(16), prompt_len: int = typer.Option(128), output_len: int = typer.Option(32),
         vocab: int = typer.Option(..., help="prompt ids are drawn from [0, vocab)"),
         kv_cache_gb: float = typer.Option(0.25, help="engine: KV cache GiB per rank"),
         max_model_len: int = typer.Option(512, help="engine: prompt + output tokens"),
         seed: int = typer.Option(0, help="seed of the random prompts")) -> None:
    import json

    prompts = random_prompts(requests, prompt_len, vocab, seed)
    if system == "hf":
        timing, mem = run_hf(model, prompts, output_len)
        mems = [mem]
    elif system == "engine":
        timing, mems = run_engine(model, prompts, output_len, kv_cache_gb, max_model_len)
    else:
        raise typer.BadParameter(f"--system {system!r} is not one of hf, engine")
    if timing is not None:
        print(MARK + json.dumps({**timing, "ranks": mems}), flush=True)


if __name__ == "__main__":
    typer.run(main)
