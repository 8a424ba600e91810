"""One system under benchmark, in its own process(es), driven by :mod:`benchmarks.bench`.

    python -m benchmarks.bench_worker --system hf --model DIR --dtype float32 --threads 2
    python -m benchmarks.bench_worker --system engine --model DIR --dtype float32 ...     (tp=1)
    torchrun --standalone --nproc_per_node=2 -m benchmarks.bench_worker --system engine ...  (tp=2)

The model is loaded once and warmed up; then rank 0 reads one JSON command per stdin line and
answers each with one stdout line ``@@bench {json}`` (everything else goes to stderr or is
ignored), so the driver can alternate systems without reloading them. At tp > 1 rank 0
broadcasts each command and every rank runs it (``LLMEngine.generate`` is SPMD).

Commands (all greedy; every request makes exactly ``output_len`` tokens):

* ``{"cmd": "throughput", "prompts": [[ids...], ...], "output_len": n}`` -> ``{"elapsed_s",
  "output_tokens", "prompt_tokens"}``: all requests at once (engine: continuous batching with
  ``ignore_eos``; HF: ``generate`` on left-padded static batches of ``--hf-batch-size``).
* ``{"cmd": "latency", "prompt": [ids...], "output_len": n}`` -> ``{"ttft_s", "latency_s"}``
  for one request (TTFT = arrival to first token, as in vLLM's benchmarks).
* ``{"cmd": "quit"}`` (or end of stdin).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import typer

MARK = "@@bench "


def _say(obj: dict) -> None:
    print(MARK + json.dumps(obj), flush=True)


HF_ATTN = ("sdpa", "eager")


def hf_attn_for(dtype: torch.dtype, attn: str = "auto") -> str:
    """HF ``attn_implementation`` for the baseline: ``attn`` itself, or for "auto" the one that ran
    faster in this benchmark's throughput workload on the build machine (README, Performance):
    "sdpa" in float32 and "eager" in 16-bit dtypes. Raises ValueError for anything else than
    auto, sdpa or eager."""
    if attn not in ("auto", *HF_ATTN):
        raise ValueError(f"hf attention {attn!r} is not one of auto, {', '.join(HF_ATTN)}")
    if attn != "auto":
        return attn
    return "sdpa" if dtype == torch.float32 else "eager"


class FirstTokenTimer:
    """A ``generate(streamer=...)`` that records when the first new token arrives:
    ``first`` = ``time.perf_counter()`` at the second ``put`` (the first one is the prompt)."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class HFSystem:
    """HF ``AutoModelForCausalLM.generate``: static batches, left padding, greedy, with the
    attention implementation :func:`hf_attn_for` picks (the faster one for the dtype), so the
    baseline is HF at its best rather than at its default."""

    def __init__(self, model: str, dtype: torch.dtype, threads: int, batch_size: int, attn: str = "auto"):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.attn = hf_attn_for(dtype, attn)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation=self.attn).eval()
        gc = self.model.generation_config
        pad = gc.pad_token_id if gc.pad_token_id is not None else gc.eos_token_id
        self.pad = int(pad[0] if isinstance(pad, list) else (pad or 0))
        self.batch_size = batch_size
        self.threads = [torch.get_num_threads()]

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], n: int, streamer=None) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=self.pad, streamer=streamer)
        return out[:, width:]

    def throughput(self, prompts: list[list[int]], n: int) -> dict:
        t0 = time.perf_counter()
        made = sum(self._generate(prompts[i:i + self.batch_size], n).numel()
                   for i in range(0, len(prompts), self.batch_size))
        return {"elapsed_s": time.perf_counter() - t0, "output_tokens": made,
                "prompt_tokens": sum(map(len, prompts)), "attn_implementation": self.attn}

    def latency(self, prompt: list[int], n: int) -> dict:
        s = FirstTokenTimer()
        t0 = time.perf_counter()
        out = self._generate([prompt], n, streamer=s)
        t1 = time.perf_counter()
        assert out.shape[1] == n and s.first is not None
        return {"ttft_s": s.first - t0, "latency_s": t1 - t0, "attn_implementation": self.attn}


class EngineSystem:
    """tpengine's LLMEngine on this rank (every rank of a torchrun group builds one)."""

    def __init__(self, model: str, dtype: str, threads: int | None, max_num_seqs: int, max_model_len: int,
                 num_kv_blocks: int):
        from tpengine.config import EngineConfig
        from tpengine.engine.llm_engine import LLMEngine

        cfg = EngineConfig(model=model, dtype=dtype, threads=threads, max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len, max_num_batched_tokens=max(8192, max_model_len),
                           num_kv_blocks=num_kv_blocks, dist_timeout_s=3600.0)
        self.engine = LLMEngine(cfg)
        self.tp = self.engine.tp
        mine = torch.get_num_threads()
        self.threads = [mine]
        if self.tp.size > 1:
            self.threads = [None] * self.tp.size
            torch.distributed.all_gather_object(self.threads, mine)

    def _run(self, prompts: list[list[int]], n: int):
        from tpengine.engine.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = self.engine.generate([(f"r{i}", p, sp) for i, p in enumerate(prompts)] if self.tp.is_driver else [])
        if self.tp.is_driver:
            bad = [o.request_id for o in outs if o.error or len(o.token_ids) != n]
            assert not bad and len(outs) == len(prompts), f"requests without {n} tokens: {bad}"
        return outs

    def throughput(self, prompts: list[list[int]], n: int) -> dict:
        t0 = time.perf_counter()
        outs = self._run(prompts, n)
        return {"elapsed_s": time.perf_counter() - t0, "output_tokens": sum(len(o.token_ids) for o in outs),
                "prompt_tokens": sum(map(len, prompts))}

    def latency(self, prompt: list[int], n: int) -> dict:
        outs = self._run([prompt], n)
        return {"ttft_s": outs[0].ttft_s, "latency_s": outs[0].latency_s} if outs else {}


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
        if cmd["cmd"] == "throughput":
            res = system.throughput(cmd["prompts"], cmd["output_len"])
        else:
            res = system.latency(cmd["prompt"], cmd["output_len"])
        if driver:
            _say(res)


def main(system: str = typer.Option(..., help="hf or engine"),
         model: str = typer.Option(..., help="HF model folder"),
         dtype: str = typer.Option("float32"),
         threads: int = typer.Option(0, help="intra-op threads (engine: per rank; 0 = cores / tp)"),
         max_num_seqs: int = typer.Option(64), max_model_len: int = typer.Option(256),
         num_kv_blocks: int = typer.Option(0, help="engine KV blocks (0 = from kv_cache_gb)"),
         hf_batch_size: int = typer.Option(64),
         hf_attn: str = typer.Option("auto", help="HF attn_implementation: auto, sdpa, eager")) -> None:
    t0 = time.perf_counter()
    warm = [[3, 4, 5, 6], [7, 8, 9, 10]]  # fits any max_model_len >= 6
    if system == "hf":
        sysm = HFSystem(model, getattr(torch, dtype), threads or torch.get_num_threads(), hf_batch_size, hf_attn)
        driver, sync = True, lambda c: c
    else:
        sysm = EngineSystem(model, dtype, threads or None, max_num_seqs, max_model_len, num_kv_blocks or None)
        driver = sysm.tp.is_driver

        def sync(c):
            if sysm.tp.size == 1:
                return c
            box = [c]
            torch.distributed.broadcast_object_list(box, src=0)
            return box[0]

    sysm.throughput(warm, 2)  # warm-up (allocator, oneDNN primitives, lazy imports)
    if driver:
        _say({"ready": True, "threads": sysm.threads, "load_s": time.perf_counter() - t0})
    serve(sysm, driver, sync)
    if system != "hf":
        sysm.engine.shutdown()


if __name__ == "__main__":
    typer.run(main)
