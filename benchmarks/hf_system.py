"""The Hugging Face ``generate`` baseline of the benchmarks (:class:`HFSystem`), its attention
implementation (:func:`hf_attn_for`) and the first-token timer; driven by
:mod:`benchmarks.bench_worker` and :mod:`benchmarks.scale_worker`."""

from __future__ import annotations

import time
from pathlib import Path

import torch

HF_ATTN = ("sdpa", "eager")
#: The warm-up requests every system runs (2 tokens each) before answering ``ready``; fits any
#: max_model_len >= 6.
WARMUP_PROMPTS = [[3, 4, 5, 6], [7, 8, 9, 10]]


#: The workload the "auto" attention choice is timed on: prompts x prompt tokens -> new tokens.
AUTO_ATTN_WORKLOAD = (8, 32, 8)


def hf_attn_for(attn: str = "auto") -> str | None:
    """HF ``attn_implementation`` for the baseline: ``attn`` itself, or None for "auto" (measured
    by :class:`HFSystem` on this machine, :func:`choose_hf_attn`). Raises ValueError for anything
    else than auto, sdpa or eager."""
    if attn not in ("auto", *HF_ATTN):
        raise ValueError(f"hf attention {attn!r} is not one of auto, {', '.join(HF_ATTN)}")
    return None if attn == "auto" else attn


def choose_hf_attn(model, name: str, dtype: torch.dtype, generate) -> str:
    """The faster of :data:`HF_ATTN` for HF ``model`` (named ``name``) in ``dtype`` on this machine:
    ``generate(prompts, n)`` timed on :data:`AUTO_ATTN_WORKLOAD` with each implementation set
    (``model.set_attn_implementation``), timed once per machine, model, dtype and transformers
    version and cached (:func:`tpengine.backends.cpu.measured.fastest`). Leaves ``model`` set to the
    choice."""
    import transformers

    from tpengine.backends.cpu.measured import fastest

    n, length, new = AUTO_ATTN_WORKLOAD
    prompts = torch.randint(0, 1000, (n, length), generator=torch.Generator().manual_seed(0)).tolist()

    def run(impl: str):
        model.set_attn_implementation(impl)
        generate(prompts, new)

    key = (f"hf attention {name} {str(dtype).removeprefix('torch.')} transformers {transformers.__version__} "
           f"{n}x{length}->{new}")
    choice = fastest(key, {impl: [lambda impl=impl: run(impl)] for impl in HF_ATTN}, passes=1)
    model.set_attn_implementation(choice.name)
    return choice.name


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
    attention implementation given, or for "auto" the one measured faster on this machine
    (:func:`choose_hf_attn`), so the baseline is HF at its best rather than at its default."""

    def __init__(self, model: str, dtype: torch.dtype, threads: int, batch_size: int, attn: str = "auto"):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        chosen = hf_attn_for(attn)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype,
                                                          attn_implementation=chosen or HF_ATTN[0]).eval()
        gc = self.model.generation_config
        pad = gc.pad_token_id if gc.pad_token_id is not None else gc.eos_token_id
        self.pad = int(pad[0] if isinstance(pad, list) else (pad or 0))
        self.batch_size = batch_size
        self.attn = chosen or choose_hf_attn(self.model, Path(model).name, dtype, self._generate)
        self.threads = [torch.get_num_threads()]
        # every parameter and buffer once (a tied LM head is the embedding's tensor)
        tensors = {t.data_ptr(): t for t in (*self.model.parameters(), *self.model.buffers())}
        self.weight_bytes = [sum(t.numel() * t.element_size() for t in tensors.values())]

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], n: int, streamer=None) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=self.pad, streamer=streamer)
        return out[:, width:]

    def _use(self, attn: str | None) -> None:
        """Run with ``attn`` (one of :data:`HF_ATTN`) from now on; None: keep the current one."""
        if attn is not None and attn != self.attn:
            if attn not in HF_ATTN:
                raise ValueError(f"hf attention {attn!r} is not one of {', '.join(HF_ATTN)}")
            self.model.set_attn_implementation(attn)
            self.attn = attn

    def throughput(self, prompts: list[list[int]], n: int, attn: str | None = None) -> dict:
        """``prompts`` in static batches of ``batch_size``, ``n`` new tokens each, with ``attn``
        (None: the current implementation). Returns elapsed_s, output/prompt token counts, the
        implementation and each request's TTFT (s)."""
        self._use(attn)
        t0 = time.perf_counter()
        made, ttft = 0, []
        for i in range(0, len(prompts), self.batch_size):
            batch, timer = prompts[i:i + self.batch_size], FirstTokenTimer()
            made += self._generate(batch, n, streamer=timer).numel()
            ttft += [timer.first - t0] * len(batch)  # every request of a static batch: its first token
        return {"elapsed_s": time.perf_counter() - t0, "output_tokens": made,
                "prompt_tokens": sum(map(len, prompts)), "attn_implementation": self.attn, "ttft_s": ttft}

    def latency(self, prompt: list[int], n: int, attn: str | None = None) -> dict:
        """One request alone, ``n`` new tokens, with ``attn`` (None: the current implementation):
        ttft_s, latency_s and the implementation."""
        self._use(attn)
        s = FirstTokenTimer()
        t0 = time.perf_counter()
        out = self._generate([prompt], n, streamer=s)
        t1 = time.perf_counter()
        assert out.shape[1] == n and s.first is not None
        return {"ttft_s": s.first - t0, "latency_s": t1 - t0, "attn_implementation": self.attn}
