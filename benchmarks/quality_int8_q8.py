"""What the int8 x int8 kernel costs in quality against the float int8 kernel (issue 59): HumanEval
perplexity (as ``make quality`` scores it: the canonical solutions given their prompts, the engine's
prompt logprobs) of SmolLM2 with ``--quantization int8`` in bfloat16, every decoder linear's product
made by tpengine's one-row kernels at every row count (the rows run 8 at a time), once with the float
kernel (``tpe_qgemv_int8``) and once with int8 activations (``tpe_qgemv_int8_q8``), in one process.

    python -m benchmarks.quality_int8_q8 [--limit 40] [--model DIR]

``make quality`` scores in prefill, where neither kernel runs (more than 8 rows: torch's kernel or
dequantize + GEMM), so its int8 row does not see this kernel; this script makes the prefill take it.
The LM head keeps its bound path in both. Prints both perplexities and the relative change. Slow: the
prefill runs 8 rows a call (``--limit 40``: ~33 minutes on 2 busy vCPUs; a smaller ``--limit`` for a look).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import quality_metrics as qm
from benchmarks.humaneval import humaneval_problems
from benchmarks.quality import scoring_requests
from tpengine.config import DEFAULT_MODEL_DIR, EngineConfig
from tpengine.engine.llm_engine import LLMEngine
from tpengine.sampling_params import SamplingParams


def chunked(kernel):
    """``kernel`` (1..8 rows) over any number of rows, 8 at a time."""
    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([kernel(x[i:i + 8].contiguous()) for i in range(0, x.shape[0], 8)])
    return run


def pin(engine: LLMEngine, act_int8: bool) -> None:
    """Every decoder linear on the int8 kernel (``act_int8``: int8 x int8) at every row count."""
    stack = engine.runner.model.model
    for layer in stack.layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            q = m.quant
            m.bind(chunked(q.qkernels.bind_int8(q.qweight, q.scales, act_int8=act_int8)))
    engine.runner.backend.bind_model(stack, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL_DIR)
    p.add_argument("--limit", type=int, default=40)
    a = p.parse_args()
    engine = LLMEngine(EngineConfig(model=a.model, dtype="bfloat16", quantization="int8", max_model_len=2048,
                                    enable_prefix_caching=False))
    scoring = scoring_requests(engine.tokenizer, humaneval_problems()[: a.limit or None])
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    ppl = {}
    for act_int8 in (False, True):
        pin(engine, act_int8)
        outs = {o.request_id: o for o in engine.generate((f"s{i}", ids, sp) for i, (ids, _) in enumerate(scoring))}
        nll = count = 0
        for i, (_, first) in enumerate(scoring):
            n, c = qm.solution_nll(outs[f"s{i}"].prompt_logprobs, first)
            nll, count = nll + n, count + c
        ppl[act_int8] = qm.perplexity(nll, count)
        print(f"{'int8 x int8' if act_int8 else 'float kernel'}: perplexity {ppl[act_int8]:.4f} over {count} tokens")
    print(f"change {100 * qm.relative_change(ppl[True], ppl[False]):+.3f} % (int8 x int8 vs the float kernel; "
          f"make quality's int8 limit vs bf16: {100 * qm.PPL_THRESHOLDS['int8']:.1f} %)")


if __name__ == "__main__":
    main()
