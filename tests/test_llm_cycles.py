"""``LLM`` opened, used and closed three times in one process (issue 38 C): at tp=1 in process and
at tp=2 under torchrun (a second process group after the first is destroyed), every cycle works
and gives the same greedy tokens."""

from __future__ import annotations

import json
import sys

from conftest import make_tiny_model
from launch import torchrun

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "workers"))
from llm_cycles import cycles  # noqa: E402


def test_three_cycles_at_tp1_and_tp2(tmp_path):
    model = make_tiny_model(tmp_path, name="tiny")
    at1 = cycles(str(model), 3)
    assert len(at1) == 3 and at1[0] == at1[1] == at1[2]
    assert all(len(ids) == 6 for ids in at1[0])
    out = tmp_path / "out"
    out.mkdir()
    torchrun("llm_cycles.py", 2, [str(model), "3", str(out)], timeout=300)
    for rank in range(2):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert got["world_size"] == 2
        assert got["cycles"] == at1  # every cycle, every rank: tp=1's tokens (float32 greedy)
