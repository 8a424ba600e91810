"""The CPU weights moved into transparent huge pages (tpengine/backends/cpu/memory.py,
``collapse_huge_pages``): which 2 MiB regions are asked for, and the exact outcome per kernel answer
(collapsed, no MADV_COLLAPSE, no huge page free, THP "never"), madvise stubbed so that every case runs
on any kernel; and one real call where the kernel has MADV_COLLAPSE."""

import errno

import pytest
import torch

from tpengine.backends.cpu import memory
from tpengine.backends.cpu.memory import HUGE_PAGE, MADV_COLLAPSE, collapse_huge_pages, huge_regions

MB2 = HUGE_PAGE


def test_regions_rounded_outward_merged_and_inside_anonymous_ranges():
    ranges = [(0, 8 * MB2), (10 * MB2, 12 * MB2 + 4096)]
    spans = [(MB2 + 100, 10), (MB2 + 5000, MB2), (3 * MB2 - 1, 2),  # 1; 1-2 (overlaps); 2-3
             (7 * MB2 + 8, MB2),                                    # 7-8: 8 lies outside every range
             (11 * MB2, MB2 + 4096),                                # 11 in; 12 passes the range's end
             (20 * MB2, 64), (5 * MB2, 0)]                          # no range; empty
    assert huge_regions(spans, ranges, 0) == [MB2, 2 * MB2, 3 * MB2, 7 * MB2, 11 * MB2]
    assert huge_regions(spans, ranges) == [MB2, 7 * MB2, 11 * MB2]  # at least half of each filled


def test_regions_half_filled_by_several_tensors():
    quarter = MB2 // 4
    spans = [(0, quarter), (quarter, quarter), (MB2, quarter), (2 * MB2 - 8, 16)]  # region 0: 1/2; region 1: 1/4
    assert huge_regions(spans, [(0, 4 * MB2)]) == [0]


def _calls(answer):
    calls = []

    def madvise(addr, n, advice):
        calls.append((addr, n, advice))
        return answer(len(calls))
    return calls, madvise


def test_every_region_collapsed_once():
    t = torch.ones(3 * MB2 // 4 + 7, dtype=torch.float32)  # 3 MiB + 28 bytes: 2-4 regions
    lo = t.data_ptr() // MB2 * MB2
    hi = -(-(t.data_ptr() + t.nbytes) // MB2) * MB2
    calls, madvise = _calls(lambda i: (0, 0))
    everywhere = [(0, 1 << 62)]
    views = [t, t[5:], t[7:].view(2, -1)]
    assert collapse_huge_pages(views, madvise, True, everywhere, min_fill=0) == ((hi - lo) // MB2,) * 2
    assert calls == [(a, MB2, MADV_COLLAPSE) for a in range(lo, hi, MB2)]
    assert torch.equal(t, torch.ones_like(t))


@pytest.mark.parametrize("err, asked, done", [(errno.EINVAL, 1, 0), (errno.ENOMEM, 4, 2), (errno.EAGAIN, 4, 2)])
def test_refused_regions_keep_their_pages(err, asked, done):
    """EINVAL on the first region (a kernel without MADV_COLLAPSE): nothing more asked; ENOMEM / EAGAIN
    (no huge page free now): every region asked, those refused counted out."""
    t = torch.empty(4 * MB2 - 4096, dtype=torch.uint8)
    ranges = [(t.data_ptr() // MB2 * MB2, (t.data_ptr() // MB2 + 4) * MB2)]  # exactly the 4 regions
    calls, madvise = _calls(lambda i: (0, 0) if err != errno.EINVAL and i % 2 else (-1, err))
    assert collapse_huge_pages([t], madvise, True, ranges, min_fill=0) == (done, 4)
    assert len(calls) == asked


def test_thp_never_or_no_anonymous_mapping_asks_nothing(tmp_path):
    calls, madvise = _calls(lambda i: (0, 0))
    t = torch.empty(MB2, dtype=torch.uint8)
    assert collapse_huge_pages([t], madvise, False, [(0, 1 << 62)]) == (0, 0)
    assert collapse_huge_pages([t], madvise, True, []) == (0, 0)
    shared = memory.lazy_zeros((MB2,), torch.uint8)  # MAP_SHARED: no transparent huge page holds it
    assert collapse_huge_pages([shared], madvise, True) == (0, 0)
    assert calls == []
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    assert not memory.thp_enabled(str(setting))
    setting.write_text("always [madvise] never\n")
    assert memory.thp_enabled(str(setting)) == memory.sys.platform.startswith("linux")
    assert not memory.thp_enabled(str(tmp_path / "missing"))


def test_real_collapse_keeps_bytes():
    """The kernel's own answer on a fresh heap tensor: collapsed (Linux >= 6.1, THP on), or refused
    with the regions counted; the bytes and the address stay either way."""
    t = torch.arange(5 * MB2 // 4, dtype=torch.float32)
    ptr, before = t.data_ptr(), t.clone()
    done, regions = collapse_huge_pages([t])
    assert 0 <= done <= regions <= 6 and t.data_ptr() == ptr and torch.equal(t, before)


def test_onednn_packed_weight_is_seen():
    """oneDNN's packed layout (an opaque tensor) counts by its own memory, as a weight in it is bound."""
    mkldnn = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "data_ptr")):
        pytest.skip("no oneDNN packed layout in this torch")
    packed = mkldnn._reorder_linear_weight(torch.randn(1024, 1024))
    addr, n = int(mkldnn.data_ptr(packed)), int(mkldnn._nbytes(packed))
    calls, madvise = _calls(lambda i: (0, 0))
    assert collapse_huge_pages([packed], madvise, True, [(0, 1 << 62)], min_fill=0) == (len(calls),) * 2
    assert [a for a, _, _ in calls] == list(range(addr // MB2 * MB2, addr + n, MB2))


def test_budget_stops_asking():
    """Past ``budget_s`` the regions left keep their pages: a clock stepping 1 s a reading, budget 2.5 s."""
    t = torch.empty(4 * MB2 - 4096, dtype=torch.uint8)
    ranges = [(t.data_ptr() // MB2 * MB2, (t.data_ptr() // MB2 + 4) * MB2)]
    calls, madvise = _calls(lambda i: (0, 0))
    ticks = iter(range(100))
    assert collapse_huge_pages([t], madvise, True, ranges, budget_s=2.5, clock=lambda: next(ticks),
                               min_fill=0) == (2, 4)
    assert len(calls) == 2


def test_engine_tokens_unchanged_once_collapsed(tiny, monkeypatch):
    """An engine's greedy tokens before and after its weights move into huge pages (the conftest's
    measuring budget of 0 kept them out at load): the same, every bound pointer still valid."""
    from tpengine import LLM, SamplingParams

    llm = LLM(model=str(tiny), dtype="float32", cpu_linear="blocked", num_kv_blocks=16, max_model_len=64)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before = llm.generate(["The capital of France is"], params)[0].outputs[0].token_ids
    runner = llm.llm_engine.runner
    monkeypatch.delenv("TPENGINE_MEASURE_BUDGET_S")
    done, regions = runner.platform.weights_to_huge_pages(runner.model)
    assert regions > 0 and 0 <= done <= regions
    assert llm.generate(["The capital of France is"], params)[0].outputs[0].token_ids == before
    llm.shutdown()
