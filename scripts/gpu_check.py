"""GPU agreement check: tpengine (tp=1, bfloat16, Triton kernels, CUDA graphs) against Hugging
Face on SmolLM2-135M-Instruct, 16 chat prompts, greedy. Run by ``scripts/gpu_check.sh``.

usage: python scripts/gpu_check.py --out agreement.json [--model DIR] [--max-tokens 64]
                                   [--min-agreement 0.99] [--prompts 16] [--device cuda]

(``--device cpu`` is a float32 smoke run of this script itself, with the torch backend.)

Two comparisons, both in bfloat16 on the GPU:

* ``argmax_agreement`` (the pass criterion): HF's own forward -- the one ``generate`` runs at
  every step -- over prompt + the engine's tokens; at each generated position, does HF's argmax
  equal the engine's token? Counting every position this way is meaningful even after a bf16
  near tie sends the two free-running outputs down different paths.
* ``generate``: HF ``generate(do_sample=False)`` on its own; prompts whose output equals the
  engine's exactly, and the share of positions before the first divergence.

Writes one JSON object (``ok`` true when argmax_agreement >= --min-agreement) and exits 0 if
ok, 1 otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

CHAT = [
    "What is the capital of France?", "Write a haiku about autumn.", "Explain TCP in one sentence.",
    "List three fruits.", "What is 12 times 7?", "Translate 'good morning' to Spanish.",
    "Who wrote Hamlet?", "Give me a tip for learning Python.", "What is photosynthesis?",
    "Name a planet with rings.", "Write a limerick about a cat.", "What does CPU stand for?",
    "How many days are in a leap year?", "Describe the color blue to someone.",
    "What is the boiling point of water?", "Suggest a name for a goldfish.",
]


def run_engine(model: str, prompts: list[list[int]], max_tokens: int, device: str) -> tuple[list, dict]:
    from tpengine.config import EngineConfig
    from tpengine.engine.llm_engine import LLMEngine
    from tpengine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    cuda = device == "cuda"
    engine = LLMEngine(EngineConfig(model=model, dtype="bfloat16" if cuda else "float32",
                                    attention_backend="triton" if cuda else "torch"))
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = engine.generate([(str(i), p, params) for i, p in enumerate(prompts)])
    outs = {o.request_id: o.token_ids for o in outs}
    gen_s = time.perf_counter() - t0
    r = engine.runner
    info = {"engine_load_s": round(load_s, 2), "engine_generate_s": round(gen_s, 3),
            "engine_output_tokens": sum(len(t) for t in outs.values()), "kv_blocks": r.num_blocks,
            "kv_cache_gib": round(r.kv_cache.numel() * r.kv_cache.element_size() / 2**30, 2),
            "cuda_graph_batch_sizes": None if r.graphs is None else r.graphs.batch_sizes,
            "dtype": str(r.dtype), "backend": r.backend.__name__}
    info["engine_tokens_per_s"] = round(info["engine_output_tokens"] / gen_s, 1)
    engine.shutdown()
    del engine, r
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return [outs[str(i)] for i in range(len(prompts))], info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-agreement", type=float, default=0.99)
    ap.add_argument("--prompts", type=int, default=len(CHAT), help="use the first N of the 16 prompts")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    dev = args.device
    result: dict = {"ok": False, "model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens,
                    "min_agreement": args.min_agreement}
    try:
        if dev == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        result["gpu"] = torch.cuda.get_device_name(0) if dev == "cuda" else None
        tok = AutoTokenizer.from_pretrained(args.model)
        prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                tokenize=True)["input_ids"]) for q in CHAT[: args.prompts]]
        engine_out, info = run_engine(args.model, prompts, args.max_tokens, dev)
        result.update(info)

        dtype = torch.bfloat16 if dev == "cuda" else torch.float32
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(dev).eval()
        match = total = exact = prefix = longest = 0
        first_div = []
        with torch.inference_mode():
            for p, got in zip(prompts, engine_out):
                if got:  # teacher-forced: HF argmax after prompt + got[:i], for every i
                    ids = torch.tensor([p + got], device=dev)
                    pred = hf(ids).logits[0, len(p) - 1: len(p) + len(got) - 1].argmax(-1).tolist()
                    match += sum(a == b for a, b in zip(pred, got))
                    total += len(got)
                ids = torch.tensor([p], device=dev)
                ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens,
                                  do_sample=False)[0, len(p):].tolist()
                d = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                exact += got == ref
                prefix += d
                longest += max(len(got), len(ref))
                first_div.append(None if got == ref else d)
        result.update({"positions": total, "argmax_matches": match,
                       "argmax_agreement": round(match / max(total, 1), 4),
                       "generate_exact_prompts": exact,
                       "generate_prefix_agreement": round(prefix / max(longest, 1), 4),
                       "generate_first_divergence": first_div})
        result["ok"] = total > 0 and match / total >= args.min_agreement
    except Exception as e:  # noqa: BLE001 -- recorded in the JSON; the shell script keeps going
        result["error"] = f"{type(e).__name__}: {e}"
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
