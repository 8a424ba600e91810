"""torchrun worker: ``tpengine.LLM`` over data-parallel layouts, one after the other in one process.

usage: torchrun --nproc_per_node N tests/workers/dp_llm.py MODEL PROMPTS_JSON OUT_DIR DP [DP ...]
For each DP, opens ``LLM(MODEL, data_parallel_size=DP)`` (tp = N / DP), generates greedily for the
prompts (token-id lists with their max_tokens) and closes it; writes OUT_DIR/rank<R>.json:
{"<DP>": [[token ids] per prompt], ...}: every rank's copy of the outputs.
"""

import json
import os
import sys

from tpengine import LLM, SamplingParams

SETTINGS = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 256, "block_size": 4, "max_num_seqs": 4}


def main():
    model, prompts_file, out_dir, layouts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    prompts = json.loads(open(prompts_file).read())
    got = {}
    for dp in layouts:
        with LLM(model, data_parallel_size=int(dp), **SETTINGS) as llm:
            params = [SamplingParams(temperature=0.0, max_tokens=p["max_tokens"], ignore_eos=True) for p in prompts]
            outs = llm.generate([p["ids"] for p in prompts], params)
            got[dp] = [o.outputs[0].token_ids for o in outs]
    with open(os.path.join(out_dir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(got, f)


if __name__ == "__main__":
    main()
