"""One layout of ``make bench-pp`` (:mod:`benchmarks.bench_pp`), every rank of one torchrun launch.

    torchrun --standalone --nproc_per_node 2 -m benchmarks.pp_worker --model DIR --dtype bfloat16 \\
        --pipeline-parallel-size 2 --prompts PROMPTS.json --output-len 128 --out OUT_DIR

Every rank builds the launch's engine (:func:`tpengine.entrypoints.setup.build_engine`: a data-parallel
layout's front routes the requests), warms it up, then runs two measured commands: the throughput one
(every prompt of ``PROMPTS.json`` at once, greedy, exactly ``--output-len`` tokens each) and a batch-1
latency one (the first prompt alone). Each rank writes ``OUT_DIR/rank<R>.json``: its wall and CPU
seconds of the throughput command (CPU: user + system of the process, all its threads), its threads,
its pipeline transfers (:data:`tpengine.distributed.P2P_COUNTERS`: bytes sent, seconds waiting to
receive), its weight bytes and peak resident memory; rank 0 also the outputs' token counts, TTFT p50
of the throughput command and the latency command's TTFT and TPOT.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Annotated

import torch
import typer

app = typer.Typer(add_completion=False)


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


@app.command()
def main(
    model: Annotated[str, typer.Option()],
    prompts: Annotated[Path, typer.Option(help="JSON list of token-id prompts")],
    output_len: Annotated[int, typer.Option()],
    out: Annotated[Path, typer.Option(help="folder for rank<R>.json")],
    dtype: Annotated[str, typer.Option()] = "bfloat16",
    threads: Annotated[int, typer.Option()] = 1,
    tensor_parallel_size: Annotated[int, typer.Option()] = 1,
    pipeline_parallel_size: Annotated[int, typer.Option()] = 1,
    data_parallel_size: Annotated[int, typer.Option()] = 1,
) -> None:
    from tpengine import distributed
    from tpengine.config import EngineConfig
    from tpengine.engine.memory import peak_rss_bytes
    from tpengine.entrypoints.setup import build_engine
    from tpengine.sampling_params import SamplingParams

    ids = json.loads(prompts.read_text())
    cfg = EngineConfig(model=model, dtype=dtype, threads=threads, max_num_seqs=len(ids), kv_cache_gb=2.0,
                       max_model_len=max(map(len, ids)) + output_len, dist_timeout_s=600.0,
                       tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                       data_parallel_size=data_parallel_size)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    engine = build_engine(cfg, rank, world, announce_loading=False)
    front = engine.is_driver

    def run(batch: list[list[int]], n: int) -> list:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return engine.generate([(f"r{i}", p, sp) for i, p in enumerate(batch)] if front else [])

    run(ids[:2], 4)  # warm-up
    local = getattr(engine, "engine", None) or engine  # (a data-parallel driver's replica engine)
    local.reset_prefix_cache()  # every replica's driver: the warm-up's prompts are no hits of the measured run
    distributed.P2P_COUNTERS.update(sent_bytes=0, recv_wait_s=0.0)
    wall, cpu = time.perf_counter(), _cpu_s()
    outs = run(ids, output_len)
    wall, cpu = time.perf_counter() - wall, _cpu_s() - cpu
    mine = {"rank": rank, "wall_s": wall, "cpu_s": cpu, "threads": torch.get_num_threads(),
            **distributed.P2P_COUNTERS, "peak_rss_bytes": peak_rss_bytes(),
            "weight_bytes": local.runner.weight_bytes}
    lat = run(ids[:1], output_len)
    if front:
        mine.update(output_tokens=sum(o.num_output_tokens for o in outs), prompt_tokens=sum(map(len, ids)),
                    ttft_p50_s=statistics.median(o.ttft_s for o in outs), latency_ttft_s=lat[0].ttft_s,
                    latency_tpot_s=lat[0].tpot_s)
    (out / f"rank{rank}.json").write_text(json.dumps(mine))
    engine.shutdown()


if __name__ == "__main__":
    app()
