"""torchrun worker: ``tpengine.LLM`` over pipeline-parallel layouts, one after the other in one process.

usage: torchrun --nproc_per_node N tests/workers/pp_llm.py JOBS_JSON OUT_DIR
JOBS_JSON: a list of {"model": folder, "engine": {LLM keyword settings}, "prompts": [[ids], ...],
"params": [{SamplingParams fields (structured_outputs: a dict of its fields)}, ...]}. Each job opens
``LLM(model, **engine)``, generates and closes
it; writes OUT_DIR/rank<R>.json: per job, per prompt ``{"ids": token ids, "logprobs": [{id: logprob}
per position] or None, "prompt_logprobs": ... or None}``: every rank's copy of the outputs.
"""

import json
import os
import sys

from tpengine import LLM, SamplingParams
from tpengine.structured import StructuredOutputsParams


def plain(lps):
    """A logprobs list (a dict per position, or None) as JSON: ``{str(id): logprob}`` per position."""
    if lps is None:
        return None
    return [None if d is None else {str(k): v.logprob for k, v in d.items()} for d in lps]


def params(p: dict) -> SamplingParams:
    """``SamplingParams`` of the JSON fields ``p`` (``structured_outputs`` a dict of its fields)."""
    if p.get("structured_outputs") is not None:
        p = {**p, "structured_outputs": StructuredOutputsParams(**p["structured_outputs"])}
    return SamplingParams(**p)


def run_job(job: dict) -> list[dict]:
    with LLM(job["model"], **job["engine"]) as llm:
        outs = llm.generate(job["prompts"], [params(p) for p in job["params"]])
    return [{"ids": o.outputs[0].token_ids, "logprobs": plain(o.outputs[0].logprobs),
             "prompt_logprobs": plain(o.prompt_logprobs)} for o in outs]


def main():
    jobs, out_dir = json.loads(open(sys.argv[1]).read()), sys.argv[2]
    got = [run_job(job) for job in jobs]
    with open(os.path.join(out_dir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(got, f)


if __name__ == "__main__":
    main()
