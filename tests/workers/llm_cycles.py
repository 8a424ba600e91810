"""torchrun worker: open, use and close ``tpengine.LLM`` several times in one process.

usage: torchrun --nproc_per_node N tests/workers/llm_cycles.py MODEL CYCLES OUT_DIR
Each cycle builds an LLM on MODEL, generates greedily for a few prompts and shuts it down; writes
OUT_DIR/rank<R>.json: {"world_size": N, "cycles": [[token ids per prompt], ...]}.
"""

import json
import os
import sys

from tpengine import LLM, SamplingParams

SETTINGS = {"dtype": "float32", "max_model_len": 64, "num_kv_blocks": 64, "block_size": 4}
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


def cycles(model: str, n: int) -> list[list[list[int]]]:
    """``n`` open / generate / close cycles; the greedy token ids of each."""
    got = []
    for _ in range(n):
        with LLM(model, **SETTINGS) as llm:
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
            got.append([o.outputs[0].token_ids for o in outs])
    return got


def main():
    model, n, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    result = {"world_size": int(os.environ.get("WORLD_SIZE", "1")), "cycles": cycles(model, n)}
    with open(os.path.join(out_dir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
