"""Sampler: greedy, top-k/top-p/min-p filters, per-request seeds independent of the batch
(C17), padded vocab columns never sampled (C01)."""

import pytest
import torch

from tpengine.engine.sampler import Sampler, apply_min_p, apply_top_k, apply_top_p
from tpengine.engine.sequence import Sequence
from tpengine.sampling_params import SamplingParams

# measured choices are among this module's subjects: no measuring budget (conftest's default is 0: nothing
# measured)
pytestmark = pytest.mark.usefixtures("measuring")

V = 50


def mk(sid: int, **params) -> Sequence:
    return Sequence(sid, f"r{sid}", [1, 2, 3], SamplingParams(**params))


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_top_k_1_equals_greedy():
    x = logits(6)
    s = Sampler()
    greedy = s.sample(x, [mk(i, temperature=0) for i in range(6)])
    assert greedy == x.argmax(-1).tolist()
    assert s.sample(x, [mk(i, temperature=1.3, top_k=1) for i in range(6)]) == greedy
    mixed = [mk(0, temperature=0), mk(1, temperature=1.0, top_k=1), mk(2, temperature=0)]
    assert s.sample(x[:3], mixed) == greedy[:3]


def test_seeded_row_independent_of_batch_c17():
    steps = 20
    alone_seq, batch_seq = mk(0, seed=1234), mk(0, seed=1234)
    s_alone, s_batch = Sampler(seed=0), Sampler(seed=99)
    alone, batched = [], []
    for t in range(steps):
        row = logits(1, seed=1000 + t)
        alone += s_alone.sample(row, [alone_seq])
        others = logits(3, seed=2000 + t)
        x = torch.cat([others[:1], row, others[1:]])
        batch = [mk(5), batch_seq, mk(6, seed=7, top_p=0.9), mk(7, temperature=0)]
        batched.append(s_batch.sample(x, batch)[1])
    assert alone == batched
    assert len(set(alone)) > 3  # really sampled, not a constant


def test_different_seeds_differ_and_same_seed_repeats():
    x = torch.zeros(1, V)  # uniform: 20 draws from 50 tokens
    def draws(seed):
        s, q = Sampler(), mk(0, seed=seed)
        return [s.sample(x, [q])[0] for _ in range(20)]
    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_top_p_tiny_and_min_p_one_keep_only_the_top_token():
    x = logits(4, seed=3)
    top = x.argmax(-1).tolist()
    s = Sampler()
    for _ in range(10):
        assert s.sample(x, [mk(i, temperature=2.0, top_p=1e-6) for i in range(4)]) == top
        assert s.sample(x, [mk(i, temperature=2.0, min_p=1.0) for i in range(4)]) == top


def test_filter_functions_exact():
    row = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    kept = lambda r: torch.isfinite(r).nonzero().flatten().tolist()  # noqa: E731
    assert kept(apply_top_k(row, 2)) == [0, 1]
    assert kept(apply_top_k(row, 0)) == [0, 1, 2, 3, 4]
    assert kept(apply_top_p(row, 0.5)) == [0]  # 0.5 alone reaches 0.5
    assert kept(apply_top_p(row, 0.6)) == [0, 1]  # 0.7 >= 0.6
    assert kept(apply_top_p(row, 0.86)) == [0, 1, 2, 3]  # 0.85 < 0.86 <= 0.95
    assert kept(apply_min_p(row, 0.3)) == [0, 1, 2]  # keep p >= 0.15
    assert kept(apply_min_p(row, 0.0)) == [0, 1, 2, 3, 4]


def test_sampled_distribution_respects_top_k():
    x = logits(1, seed=5)
    allowed = set(torch.topk(x[0], 3).indices.tolist())
    s, q = Sampler(), mk(0, temperature=1.0, top_k=3)
    got = {s.sample(x, [q])[0] for _ in range(100)}
    assert got <= allowed and len(got) > 1


def test_unseeded_rows_draw_together_each_with_its_filters_and_a_failing_row_is_its_own():
    """The unseeded rows of a step draw in one call: each keeps its own filters (top-k 2 draws only its
    two best tokens, top-p 1e-6 only its best, temperature alone any of them, about as often as the
    softmax says), and a row whose temperature overflows its logits is entered in ``errors`` while
    the others (the seeded one too) are sampled."""
    x = logits(4, seed=11)
    s = Sampler(seed=3)
    seqs = [mk(0, temperature=1.0, top_k=2), mk(1, temperature=1.0, top_p=1e-6), mk(2, temperature=1.0),
            mk(3, temperature=1.0, seed=5)]
    draws = [s.sample(x, seqs) for _ in range(3000)]
    assert {d[0] for d in draws} == set(torch.topk(x[0], 2).indices.tolist())
    assert {d[1] for d in draws} == {int(x[1].argmax())}
    p = torch.softmax(x[2], -1)
    top = int(p.argmax())
    assert abs(sum(d[2] == top for d in draws) / 3000 - float(p[top])) < 0.04
    assert len({d[3] for d in draws}) > 3
    hot = x.clone()
    hot[1] = 1e38
    errors: dict[int, Exception] = {}
    got = s.sample(hot[:3], [mk(0, temperature=1.0), mk(1, temperature=1e-30), mk(2, temperature=1.0, top_k=1)], errors)
    assert list(errors) == [1] and got[2] == int(hot[2].argmax()) and got[1] == 0


def test_padded_vocab_columns_never_sampled_c01():
    """The LM head cuts the padding columns before the Sampler sees the logits (sampling and
    the greedy argmax on the ranks): padded rows with large logits are never chosen."""
    from tpengine.model.layers.embedding import ParallelLMHead

    real, padded, hidden = 45, V, 8
    head = ParallelLMHead(0, padded, real, hidden, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        head.weight.copy_(torch.randn(padded, hidden, generator=g))
        head.weight[real:] = 50.0  # padded rows: large logits for a positive hidden state
    h = torch.rand(2, hidden, generator=g) + 0.5
    x = head(h)
    assert x.shape == (2, real)
    s = Sampler()
    seqs = [mk(0, temperature=1.0), mk(1, temperature=1.0, seed=3)]
    draws = [t for _ in range(200) for t in s.sample(x, seqs)]
    assert max(draws) < real
    assert max(s.sample(x, [mk(2, temperature=0)] * 2)) < real
    assert max(head.greedy(h).tolist()) < real
    assert (head.weight[real:] == 50.0).all()  # the padded rows themselves are untouched


def test_sampling_keys_are_sampling_params_fields():
    from dataclasses import fields

    from tpengine.sampling_params import SAMPLING_KEYS

    assert set(SAMPLING_KEYS) <= {f.name for f in fields(SamplingParams)}
    assert SAMPLING_KEYS == ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos",
                             "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                             "logit_bias", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                             "logprobs", "prompt_logprobs")


@pytest.mark.parametrize("cpu_kernels", [False, True])
def test_row_max_equals_torch_max_with_ties_infinities_and_nan(cpu_kernels):
    """The LM head's greedy pick (tpengine.backends.cpu.greedy.row_max) is ``max(dim=-1)`` exactly:
    same values, and the first index among equal maxima, also across blocks -- by torch ops per
    block, and (``cpu_kernels``) by the C kernel tpengine/backends/cpu/csrc/cpu_argmax.c."""
    from tpengine.backends.cpu import cpu_library
    from tpengine.backends.cpu.greedy import ROW_MAX_BLOCK, ROW_MAX_CANDIDATES, bound_row_argmax, row_max

    if cpu_kernels and cpu_library.load() is None:
        pytest.skip(f"needs the CPU C kernels: {cpu_library.unavailable_reason()}")

    g = torch.Generator().manual_seed(5)
    v = 96 * ROW_MAX_BLOCK  # SmolLM2's 49152 columns: the blocked path
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(9, v, generator=g).to(dtype)
        x[1, [7, 4000, 40000]] = 50.0  # ties in different blocks: the first one wins
        x[2, [ROW_MAX_BLOCK + 3, ROW_MAX_BLOCK + 9]] = 50.0  # ties in one block
        x[3] = 0.0  # all equal: index 0
        x[4, :] = float("-inf")
        x[4, v - 1] = -1.0  # the maximum in the last column
        x[5, 300] = float("inf")
        x[6, [100, 20000]] = float("nan")  # NaN counts as the maximum, as in torch.max
        x[7] = torch.randn(v, generator=g).to(dtype).round()  # many ties at small integers
        want_v, want_i = x.max(dim=-1)
        for block in ROW_MAX_CANDIDATES:  # every block the per-machine measurement may pick
            got_v, got_i = row_max(x, block, cpu_kernels)
            assert torch.equal(got_i, want_i), (dtype, block, got_i, want_i)
            assert torch.equal(got_v.isnan(), want_v.isnan())
            assert torch.equal(got_v.nan_to_num(), want_v.nan_to_num())
            assert got_i[1] == 7 and got_i[2] == ROW_MAX_BLOCK + 3 and got_i[3] == 0 and got_i[4] == v - 1
            assert got_i[6] == 100
        assert torch.equal(row_max(x[:, : v - 1], cpu_kernels=cpu_kernels)[1],
                           x[:, : v - 1].max(dim=-1).indices)  # fallbacks
        assert torch.equal(row_max(x[:, :1000], cpu_kernels=cpu_kernels)[1], x[:, :1000].max(dim=-1).indices)
        assert torch.equal(row_max(x[:3, :19], cpu_kernels=cpu_kernels)[1],
                           x[:3, :19].max(dim=-1).indices)  # < 64 columns
        # the vector kernels' last, partial stretch of columns (AVX2: 32 a step, the rest one at a time)
        y = torch.randn(7, 1000, generator=g).to(dtype)
        y[0, [5, 995]] = 60.0  # a tie across it: the first wins
        y[1, 997] = 70.0  # the maximum in it
        y[2, [996, 998]] = float("nan")  # the first NaN in it
        y[3, [40, 993]] = float("nan")  # a NaN before it wins
        y[4, [70, 33]] = float("nan")  # NaNs in two lanes: the first
        y[5, :] = float("-inf")  # all equal: index 0
        y[6, [0, 31, 32]] = 80.0  # the first column's lane wins the tie
        want = y.max(dim=-1).indices
        assert want.tolist() == [5, 997, 996, 40, 33, 0, 0]
        assert torch.equal(row_max(y, cpu_kernels=cpu_kernels)[1], want)
        if cpu_kernels:  # the head's bound row_argmax (one rank's greedy pick): the same indices, or row_max's
            argmax = bound_row_argmax(dtype)
            assert torch.equal(argmax(x), want_i) and torch.equal(argmax(y), want)
            assert torch.equal(argmax(x[:, 1::2]), x[:, 1::2].max(dim=-1).indices)  # strided: row_max's
            other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
            assert torch.equal(argmax(y.to(other)), y.to(other).max(dim=-1).indices)  # another dtype: row_max's


@pytest.mark.parametrize("cpu_kernels", [False, True])
def test_col_max_equals_torch_max_over_rows_with_ties_infinities_and_nan(cpu_kernels):
    """The transposed greedy pick (tpengine.backends.cpu.greedy.col_max) is ``max(dim=0)`` exactly, for
    every block the measurement may pick (and the C kernel, ``cpu_kernels``): the first row among equal
    maxima, NaN the largest; also across the kernel's per-thread row ranges and past 64 columns."""
    from tpengine.backends.cpu import cpu_library
    from tpengine.backends.cpu.greedy import ROW_MAX_BLOCK, ROW_MAX_CANDIDATES, col_max

    if cpu_kernels and cpu_library.load() is None:
        pytest.skip(f"needs the CPU C kernels: {cpu_library.unavailable_reason()}")

    g = torch.Generator().manual_seed(6)
    v = 96 * ROW_MAX_BLOCK
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(v, 9, generator=g).to(dtype)
        x[[7, 4000, 40000], 1] = 50.0  # ties in different blocks
        x[[ROW_MAX_BLOCK + 3, ROW_MAX_BLOCK + 9], 2] = 50.0  # ties in one block
        x[:, 3] = 0.0
        x[:, 4] = float("-inf")
        x[v - 1, 4] = -1.0
        x[300, 5] = float("inf")
        x[[100, 20000], 6] = float("nan")
        x[:, 7] = torch.randn(v, generator=g).to(dtype).round()
        want_v, want_i = x.max(dim=0)
        for block in ROW_MAX_CANDIDATES:
            got_v, got_i = col_max(x, block, cpu_kernels)
            assert torch.equal(got_i, want_i), (dtype, block, got_i, want_i)
            assert torch.equal(got_v.isnan(), want_v.isnan())
            assert torch.equal(got_v.nan_to_num(), want_v.nan_to_num())
        assert torch.equal(col_max(x[: v - 5], 512, cpu_kernels)[1], x[: v - 5].max(dim=0)[1])  # not a multiple: max
        wide = x.repeat(1, 9)[:, :70]  # 70 columns (two passes, of 64 and 6), rows 81 elements apart
        wide[:, 69] = -1.0
        wide[[v // 2 - 1, v // 2], 69] = 60.0  # a tie across the 2 threads' row ranges: the first wins
        assert torch.equal(col_max(wide, 512, cpu_kernels)[1], wide.max(dim=0)[1])
        assert col_max(wide, 512, cpu_kernels)[1][69] == v // 2 - 1


def test_greedy_through_the_transposed_logits_picks_the_argmax(tmp_path, monkeypatch):
    """A bfloat16 head with ``greedy_mm`` (chosen by measurement, here forced) picks the argmax of
    ``weight @ hidden.T`` over the real vocabulary (padding rows excluded), and the choice is timed
    once per machine, then cached."""
    from tpengine.backends.cpu import cpu_library, measured
    from tpengine.backends.cpu.greedy import bound_row_argmax, choose_greedy_path
    from tpengine.model.layers.embedding import ParallelLMHead

    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measured, "probe_busy", lambda: False)  # a quiet start: measured on given timings
    g = torch.Generator().manual_seed(7)
    head = ParallelLMHead(0, 1024, 1000, 64, dtype=torch.bfloat16, device="cpu")  # 24 padding rows
    head.weight.data.copy_(torch.randn(1024, 64, generator=g))
    head.weight.data[1000:] = 100.0  # padding rows would win if they were read
    hidden = torch.randn(5, 64, generator=g).bfloat16()
    want = torch.mm(head.weight, hidden.t())[:1000].float().argmax(dim=0)
    head.greedy_mm = False  # F.linear and row_max
    linear = torch.nn.functional.linear(hidden, head.weight)
    assert torch.equal(head.greedy(hidden), linear[:, :1000].float().argmax(-1))
    head.greedy_mm = True
    assert torch.equal(head.greedy(hidden), want)
    assert torch.equal(head.greedy(hidden[:1]), head._logits(hidden[:1])[:, :1000].float().argmax(-1))  # 1 row: mv
    head.row_argmax = bound_row_argmax(torch.bfloat16) if cpu_library.load() is not None else None
    assert torch.equal(head.greedy(hidden[:1]), head._logits(hidden[:1])[:, :1000].float().argmax(-1))  # its indices
    calls = []
    monkeypatch.setattr(measured, "measure", lambda c, *_: calls.append(sorted(c)) or {"linear": [2.0, 4.0],
                                                                                        "mm": [1.0, 2.0]})
    first = choose_greedy_path(head)
    assert (first.name, first.how, calls) == ("mm", "measured", [["linear", "mm"]] * 2)
    assert (choose_greedy_path(head).how, len(calls)) == ("cached", 2)


def test_row_max_block_is_measured_once_per_machine(tmp_path, monkeypatch):
    """The greedy pick's block is timed on this machine among the candidates that divide the
    shard's width (0: torch's max), then read back from the cache."""
    from tpengine.backends.cpu import measured
    from tpengine.backends.cpu.greedy import choose_row_max_block

    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measured, "probe_busy", lambda: False)  # a quiet start: measured on given timings
    fake = {"0": [30.0, 900.0], "256": [20.0, 450.0], "512": [21.0, 400.0], "1024": [40.0, 420.0]}
    calls = []
    monkeypatch.setattr(measured, "measure", lambda c, *_: calls.append(sorted(c)) or {k: fake[k] for k in c})
    first, block = choose_row_max_block(3072, torch.float32)  # 2048 and 4096 do not divide 3072
    assert calls == [["0", "1024", "256", "512"]] * 2
    assert (first.name, first.how, block) == ("512", "measured", 512)  # 21/20 + 400/400 < 20/20 + 450/400
    again, _ = choose_row_max_block(3072, torch.float32)
    assert (again.name, again.how, len(calls)) == ("512", "cached", 2)
    assert again.describe() == "512 (cached: 0 30/900 us, 256 20/450 us, 512 21/400 us, 1024 40/420 us)"
    fake["2048"] = [50.0, 500.0]
    # another process on the cores: the second pass 2x the first at block 512, the third 3x at 512 and 256
    runs = iter([{}, {"512": 2.0}, {"512": 3.0, "256": 3.0}])
    def slowed(c, *_):
        f = next(runs)
        return {k: [t * f.get(k, 1.0) for t in fake[k]] for k in c}
    monkeypatch.setattr(measured, "measure", slowed)
    noisy, _ = choose_row_max_block(6144, torch.float32)  # 512, 256, 1024: three ways, the first used, not cached
    assert (noisy.name, noisy.how) == ("512", "measured, noisy (not cached)")
    assert "row_max 6144 float32 rows 1/64" not in measured.read_cache(measured.cache_path())


def test_the_c_row_argmax_is_a_measured_candidate(tmp_path, monkeypatch):
    """With the C kernels the row argmax is timed beside torch's blocked passes (the portable C loop can
    lose to them): the head takes it only where it was faster, and keeps the fastest torch block."""
    from tpengine.backends.cpu import cpu_library, measured
    from tpengine.backends.cpu.greedy import ROW_MAX_KERNEL, choose_row_max_block

    if not cpu_library.has("tpe_row_argmax_f32"):
        pytest.skip(f"needs the C row argmax: {cpu_library.missing('tpe_row_argmax_f32')}")
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(measured, "probe_busy", lambda: False)
    fake = {"0": [30.0, 900.0], "256": [20.0, 450.0], "512": [21.0, 400.0], "1024": [40.0, 420.0],
            ROW_MAX_KERNEL: [9.0, 300.0]}
    monkeypatch.setattr(measured, "measure", lambda c, *_: {k: fake[k] for k in c})
    fast, block = choose_row_max_block(3072, torch.float32, cpu_kernels=True)
    assert (fast.name, block) == ("C", 512) and list(fast.times_us) == ["0", "256", "512", "1024", "C"]
    fake[ROW_MAX_KERNEL] = [60.0, 2000.0]
    slow, block = choose_row_max_block(3072, torch.bfloat16, cpu_kernels=True)
    assert (slow.name, block) == ("512", 512)
    assert list(choose_row_max_block(3072, torch.float16, cpu_kernels=True)[0].times_us) == ["0", "256", "512",
                                                                                               "1024"]
