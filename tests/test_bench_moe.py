"""``make bench-moe``'s summary and goals (benchmarks/bench_moe.py) from given runs: the ratios the README's
table shows and which of issue 56's goals each row meets (the runs themselves: ``make bench-moe``)."""

from __future__ import annotations

from benchmarks.bench_moe import goals, summarize


def run(tok_s: float | None, ttft: float, latency: float, weight_bytes: list[int], threads: list[int]) -> dict:
    tput = [] if tok_s is None else [{"output_tokens": 1000, "elapsed_s": 1000 / (tok_s / 2)},
                                     {"output_tokens": 1000, "elapsed_s": 1000 / tok_s}]
    return {"threads": threads, "weight_bytes": weight_bytes, "throughput": tput,
            "latency": [{"ttft_s": ttft, "latency_s": latency}, {"ttft_s": ttft * 2, "latency_s": latency * 2}]}


def test_summary_and_goals() -> None:
    mib = 2**20
    runs = {"hf": run(100.0, 0.5, 0.5 + 9 * 0.1, [700 * mib], [2]),
            "tp1": run(400.0, 0.1, 0.1 + 9 * 0.03, [700 * mib], [2]),
            "tp2": run(320.0, 0.1, 0.1 + 9 * 0.02, [360 * mib, 350 * mib], [1, 1]),
            "ep2": run(360.0, 0.1, 0.1 + 9 * 0.025, [360 * mib, 350 * mib], [1, 1]),
            "dense": run(None, 0.1, 0.1 + 9 * 0.02, [256 * mib], [2])}
    rows = summarize(runs, latency_output_len=10)
    assert rows["hf"] == {"threads": [2], "ttft_ms": 500.0, "tpot_ms": 100.0, "output_tok_s": 100.0,
                          "weight_mib": [700.0]}
    assert rows["dense"] == {"threads": [2], "ttft_ms": 100.0, "tpot_ms": 20.0, "weight_mib": [256.0]}
    assert rows["tp1"] == {"threads": [2], "ttft_ms": 100.0, "tpot_ms": 30.0, "output_tok_s": 400.0,
                           "weight_mib": [700.0], "vs_hf": 4.0, "tpot_vs_hf": 0.3, "tpot_vs_dense": 1.5}
    assert (rows["tp2"]["tp_efficiency"], rows["ep2"]["tp_efficiency"]) == (0.8, 0.9)
    assert rows["ep2"]["weight_mib"] == [360.0, 350.0] and rows["ep2"]["vs_hf"] == 3.6
    met = {(g["system"], g["field"]): g["met"] for g in goals(rows)}
    assert met == {("tp1", "vs_hf"): True, ("tp1", "tpot_vs_dense"): False, ("tp2", "vs_hf"): True,
                   ("tp2", "tp_efficiency"): False, ("ep2", "vs_hf"): True, ("ep2", "tp_efficiency"): True}
