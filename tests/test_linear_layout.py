"""The CPU linear layout choice (issue 17, tpengine/kernels/linear_layout.py): the decision rule,
forced settings, the per-machine timings cache, and what a loaded model holds for each choice."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model

from tpengine.config import EngineConfig
from tpengine.distributed import TPInfo
from tpengine.kernels import linear_layout as L
from tpengine.layers.linear import prepack
from tpengine.loader import load_model

needs_onednn = pytest.mark.skipif(prepack(torch.zeros(2, 2)) is None, reason="no oneDNN packing in this torch")


def test_pick_uses_the_summed_relative_time_and_keeps_packed_on_a_tie():
    # plain: 1 + 1.5 + 1.2 = 3.7 vs packed 1.5 + 1 + 1 = 3.5 -> packed
    assert L.pick({"plain": [10, 30, 120], "packed": [15, 20, 100]}) == "packed"
    # one-row win of 2x outweighs two small losses: plain 1 + 1.1 + 1.1 = 3.2 vs packed 2 + 1 + 1 = 4
    assert L.pick({"plain": [10, 22, 110], "packed": [20, 20, 100]}) == "plain"
    assert L.pick({"plain": [1, 1, 1], "packed": [1, 1, 1]}) == "packed"


def test_forced_settings_and_bad_setting():
    shapes = {(960, 576): 30, (576, 1536): 30}
    for s in ("plain", "packed"):
        got = L.choose_layouts(shapes, torch.float32, s)
        assert {k: (v.layout, v.how) for k, v in got.items()} == {k: (s, "forced") for k in shapes}
    with pytest.raises(ValueError) as e:
        L.choose_layouts(shapes, torch.float32, "mkl")
    assert str(e.value) == "invalid cpu_linear='mkl': must be one of auto, plain, packed"
    with pytest.raises(ValueError) as e:
        EngineConfig(cpu_linear="onednn")
    assert str(e.value) == "invalid cpu_linear='onednn': must be one of auto, plain, packed"


@needs_onednn
def test_auto_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    calls = []
    real = L.measure
    monkeypatch.setattr(L, "measure", lambda *a: calls.append(a) or real(*a))
    shapes = {(48, 32): 3, (32, 64): 2}
    first = L.choose_layouts(shapes, torch.float32)
    assert sorted(calls) == [((32, 64), 2, torch.float32), ((48, 32), 3, torch.float32)]
    assert {v.how for v in first.values()} == {"measured"}
    for c in first.values():
        assert set(c.times_us) == {"plain", "packed"} and all(len(t) == 3 and min(t) > 0 for t in c.times_us.values())
        assert c.layout == L.pick(c.times_us)
    stored = json.loads(L.cache_path(torch.float32).read_text())
    assert sorted(stored) == ["32x64x2", "48x32x3"]
    calls.clear()
    second = L.choose_layouts(shapes, torch.float32)
    assert calls == [] and {v.how for v in second.values()} == {"cached"}
    assert {k: v.layout for k, v in second.items()} == {k: v.layout for k, v in first.items()}
    # another dtype is another machine setting: measured again, in its own file
    L.choose_layouts({(48, 32): 3}, torch.bfloat16)
    assert calls == [((48, 32), 3, torch.bfloat16)] and L.cache_path(torch.bfloat16) != L.cache_path(torch.float32)
    # a damaged cache file is measured again, not trusted
    L.cache_path(torch.float32).write_text("{not json")
    calls.clear()
    L.choose_layouts(shapes, torch.float32)
    assert len(calls) == 2


@needs_onednn
@pytest.mark.parametrize("setting", ["plain", "packed"])
def test_loaded_model_holds_each_weight_once_in_the_chosen_layout(tmp_path, setting):
    model_dir = make_tiny_model(tmp_path, "llama", seed=1)
    model, _, _ = load_model(model_dir, TPInfo(0, 1, 0, torch.device("cpu")), torch.float32, cpu_linear=setting)
    linears = [m for n, m in model.named_modules() if hasattr(m, "pack") and not n.endswith("lm_head")]
    assert len(linears) == 2 * 4  # 2 layers: qkv, o, gate_up, down
    assert all((m.packed is not None) == (setting == "packed") for m in linears)
    assert all((m.weight is None) == (setting == "packed") for m in linears)
    assert {c.layout for c in model.linear_layouts.values()} == {setting}
    line = L.summary(model.linear_layouts, torch.float32)
    assert line.startswith(f"tpengine: CPU linear layouts (float32, {torch.get_num_threads()} threads, forced): ")
