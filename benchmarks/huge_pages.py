"""The CPU weights in 2 MiB transparent huge pages against 4 KiB pages (``EngineConfig.cpu_huge_pages``,
``tpengine.backends.cpu.memory.collapse_huge_pages``): engine processes alternating on / off (the pair's order
flipped every other pair), each loading SmolLM2-135M (``--cpu-linear blocked``) and timing a batch-1 decode.

    python -m benchmarks.huge_pages [--configs bfloat16 bfloat16:int8 float32] [--pairs 3] [--threads 2]
                                    [--clock wall|cpu] [--model models/smollm2-135m-instruct]

Per process: the load (s), the collapse (s: ``Platform.weights_to_huge_pages``), the 2 MiB regions collapsed
of those asked for, ``AnonHugePages`` after loading, and the time a token of one greedy request (64 tokens
less one, prefix cached, rounds 2-5's median, ms; ``--clock cpu`` with ``--threads 1``: the process's CPU time,
a loaded machine's lost slices left out); per pair the off / on ratio. About 15 s a process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def one(config: str, on: bool, threads: int, clock_name: str, model: str) -> None:
    """Child: load, collapse (or not), time the decode; print one ``RESULT`` line."""
    from tpengine import LLM, SamplingParams
    from tpengine.backends.cpu.platform import CPUPlatform

    spent: dict = {}
    orig = CPUPlatform.weights_to_huge_pages

    def timed(self, module):
        t = time.perf_counter()
        spent["r"] = orig(self, module)
        spent["s"] = time.perf_counter() - t
        return spent["r"]
    CPUPlatform.weights_to_huge_pages = timed
    dtype, _, quant = config.partition(":")
    t = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, quantization=quant or None, cpu_linear="blocked", threads=threads,
              cpu_huge_pages=on)
    load = time.perf_counter() - t
    huge = next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages"))
    clock = time.perf_counter if clock_name == "wall" else time.process_time
    prompt = ["Write a long story about a dragon who learns to bake bread in a small village."]

    def run(n: int) -> float:
        t = clock()
        llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return clock() - t
    rounds = []
    for _ in range(5):
        first = run(1)
        rounds.append((run(65) - first) / 64 * 1e3)
    done, regions = spent.get("r", (0, 0))
    print(f"RESULT {load:.2f} {spent.get('s', 0.0):.2f} {done} {regions} {huge >> 10} "
          f"{statistics.median(rounds[1:]):.3f}", flush=True)
    llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=["bfloat16", "bfloat16:int8", "float32"])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--one", nargs=2, metavar=("CONFIG", "ON"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        one(a.one[0], a.one[1] == "1", a.threads, a.clock, a.model)
        return
    print(f"load average {os.getloadavg()[0]:.2f}, {a.threads} threads, {a.clock} clock")
    print(f"{'config':14s} {'pages':6s} {'load s':>7s} {'collapse s':>10s} {'regions':>9s} {'huge MiB':>8s} "
          f"{'ms/token':>8s}")
    for pair in range(a.pairs):
        for config in a.configs:
            tpot = {}
            for on in ((False, True) if pair % 2 == 0 else (True, False)):
                out = subprocess.run([sys.executable, "-m", "benchmarks.huge_pages", "--one", config, str(int(on)),
                                      "--threads", str(a.threads), "--clock", a.clock, "--model", a.model],
                                     capture_output=True, text=True, check=True).stdout
                load, collapse, done, regions, huge, ms = next(line for line in out.splitlines()
                                                                if line.startswith("RESULT")).split()[1:]
                tpot[on] = float(ms)
                print(f"{config:14s} {'2 MiB' if on else '4 KiB':6s} {load:>7s} {collapse:>10s} "
                      f"{done + '/' + regions:>9s} {huge:>8s} {ms:>8s}", flush=True)
            print(f"{config:14s} pair {pair + 1}: 4 KiB / 2 MiB {tpot[False] / tpot[True]:.3f}x", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
