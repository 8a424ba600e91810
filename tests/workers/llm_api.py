"""torchrun worker: every rank builds the same ``tpengine.LLM``, makes the same calls, and writes
what it got back, so a test can check that every rank gets rank 0's outputs.

usage: torchrun --nproc_per_node N tests/workers/llm_api.py WORKLOAD.json OUT_DIR
WORKLOAD.json: {"model": str, "settings": {EngineConfig fields}, "prompts": [...], "params":
[{SamplingParams kwargs}, ...] (one per prompt), "conversations": [...], "chat_params": {...}}.
Writes OUT_DIR/rank<R>.json: {"world_size": N, "generate": [...], "chat": [...]} (outputs as dicts).
"""

import dataclasses
import json
import os
import sys

from tpengine import LLM, SamplingParams


def run_workload(llm: LLM, workload: dict) -> dict:
    """``llm.generate(prompts, params)`` then ``llm.chat(conversations, chat_params)``, as dicts."""
    gen = llm.generate(workload["prompts"], [SamplingParams(**p) for p in workload["params"]])
    chat = llm.chat(workload["conversations"], SamplingParams(**workload["chat_params"]))
    return {"generate": [dataclasses.asdict(o) for o in gen], "chat": [dataclasses.asdict(o) for o in chat]}


def main():
    workload, out_dir = json.load(open(sys.argv[1])), sys.argv[2]
    with LLM(workload["model"], **workload["settings"]) as llm:
        result = {"world_size": int(os.environ["WORLD_SIZE"]), **run_workload(llm, workload)}
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
