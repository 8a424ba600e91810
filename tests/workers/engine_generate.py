"""torchrun worker: run LLMEngine jobs at this world size; rank 0 writes the outputs as JSON.

usage: torchrun --nproc_per_node N tests/workers/engine_generate.py OUT.json JOBS.json
JOBS.json: [{"key": str, "config": {EngineConfig fields}, "requests": [[id, prompt_ids, params]]}]
params are SamplingParams keyword arguments (``structured_outputs``: StructuredOutputsParams ones).
Output: {key: {"outputs": [...], "stats": {...}, "window_freed": blocks freed for leaving a sliding window,
"weight_bytes": [per rank], "load_s": seconds to build the engine, "run_s": seconds to generate}}
(the seconds are for reading which job a slow run spends its time in, never asserted).
A job may instead carry "waves": a list of request lists, each generate()d in turn, and "env": variables
set while it loads and runs (e.g. ``TPENGINE_MEASURE_BUDGET_S``: one job measures its choices in a launch
that does not).
"""

import dataclasses
import json
import os
import sys
import time

from tpengine.startup import collector_paused

with collector_paused():  # the start's imports, as the entry points (tpengine/startup.py)
    from tpengine.config import EngineConfig
    from tpengine.distributed import gather_control, get_tp, shutdown
    from tpengine.engine.llm_engine import LLMEngine
    from tpengine.sampling_params import SamplingParams
    from tpengine.structured import StructuredOutputsParams


def as_record(o) -> dict:
    """A RequestOutput as JSON: its fields plus sample 0's text, token_ids and finish_reason."""
    return {**dataclasses.asdict(o), "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}


def params(p: dict) -> SamplingParams:
    """SamplingParams from JSON kwargs (``logit_bias`` keys come as strings)."""
    if p.get("logit_bias") is not None:
        p = {**p, "logit_bias": {int(k): v for k, v in p["logit_bias"].items()}}
    if p.get("structured_outputs") is not None:
        p = {**p, "structured_outputs": StructuredOutputsParams(**p["structured_outputs"])}
    return SamplingParams(**p)


def main():
    out_path, jobs_path = sys.argv[1], sys.argv[2]
    results = {}
    for job in json.load(open(jobs_path)):
        saved = {k: os.environ.get(k) for k in job.get("env", {})}
        os.environ.update(job.get("env", {}))
        start = time.monotonic()
        engine = LLMEngine(EngineConfig(**job["config"]))
        loaded = time.monotonic()
        start_free = engine.stats().num_free_blocks if engine.is_driver else None
        weight_bytes = gather_control(engine.runner.weight_bytes)  # every rank's, on rank 0
        outs = []
        for wave in job.get("waves", [job.get("requests", [])]):
            reqs = [(rid, ids, params(p)) for rid, ids, p in wave]
            outs += engine.generate(reqs if engine.is_driver else [])
        if engine.is_driver:
            results[job["key"]] = {
                "outputs": [as_record(o) for o in outs],
                "stats": dataclasses.asdict(engine.stats()),
                "start_free_blocks": start_free,
                "window_freed": engine.scheduler.block_manager.num_window_freed,  # blocks that left the window
                "weight_bytes": weight_bytes,
                "load_s": round(loaded - start, 2),
                "run_s": round(time.monotonic() - loaded, 2),
            }
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if get_tp().is_driver:
        json.dump(results, open(out_path, "w"))
    shutdown()


if __name__ == "__main__":
    main()
