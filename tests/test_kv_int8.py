"""The int8 KV cache (``kv_cache_dtype="int8"``, tpengine/backends/kv_quant.py): the quantization's round
trip bound; the paged decode C kernel over an int8 cache (``cpu_paged_i8.c``: RoPE, the quantizing store,
attention) against the torch reference on the dequantized cache, with GQA maps, a padding row, a sliding
window and a soft cap; the engine's int8 cache at tp 2 against tp 1 and against the float32 cache; the
flag's exact error for vLLM's fp8 names."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import CONFIGS, DECODE_LENS, _cache, _gen, _slot

from tpengine.backends import kv_quant
from tpengine.backends import reference as ref
from tpengine.backends.cpu import cpu_library, cpu_paged

I8 = tuple(cpu_paged.I8_KERNELS.values())
needs_kernels = pytest.mark.skipif(cpu_library.missing(*I8) is not None, reason=str(cpu_library.missing(*I8)))


def test_quantize_round_trip_is_within_half_a_step_of_each_row():
    """Each row's codes span [-127, 127] with its absmax at +-127, and every element reads back within half
    a quantization step (absmax / 254) plus float32 rounding; an all-zero row stays zero (scale 0)."""
    g = _gen(3)
    x = torch.randn(5, 7, 64, generator=g) * torch.logspace(-3, 3, 7)[None, :, None]
    x[2, 3] = 0.0
    x[1, 1, 5] = -50.0  # an outlier: the row's step grows with it
    for src in (x, x.to(torch.bfloat16)):
        codes, scale = kv_quant.quantize(src)
        assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (5, 7)
        amax = src.float().abs().amax(-1)
        assert torch.equal(codes.abs().amax(-1), torch.where(amax > 0, 127, 0).to(torch.int8))
        back = kv_quant.dequantize(codes, scale, torch.float32)
        err = (back - src.float()).abs().amax(-1)
        assert bool((err <= amax / 254 * (1 + 1e-5) + 1e-30).all())
        assert torch.equal(back[2, 3], torch.zeros(64)) and float(scale[2, 3]) == 0.0


def rope(x, cos, sin):
    """HF's ``x * cos + rotate_half(x) * sin`` per head, in x's dtype."""
    h = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin[:, None]


def int8_case(d, bs, q_to_kv, dtype, lens, seed=0):
    """A decode step over an int8 cache: the fused q/k/v rows, RoPE tables, the quantized caches and their
    scales, block tables, slots, lengths and the head map."""
    g = _gen(seed)
    hq, hkv = len(q_to_kv), max(q_to_kv) + 1
    kc, vc, bt = _cache(lens, bs, hkv, d, g)
    (kq, ks), (vq, vs) = kv_quant.quantize(kc.to(dtype)), kv_quant.quantize(vc.to(dtype) * 3)
    qkv = torch.randn(len(lens), hq + 2 * hkv, d, generator=g).to(dtype)
    pos = torch.tensor([max(n - 1, 0) for n in lens])
    ang = torch.cat([pos[:, None] * (1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))] * 2, dim=-1)
    slots = torch.tensor([_slot(bt, i, n - 1, bs) if n else -1 for i, n in enumerate(lens)])
    return (qkv, ang.cos().to(dtype), ang.sin().to(dtype), kq, vq, (ks, vs), bt, slots, torch.tensor(lens),
            torch.tensor(q_to_kv))


def int8_reference(q, k_cache, v_cache, kv_scales, block_tables, lens, q_to_kv, scale, window, cap):
    """The int8 kernel's arithmetic in torch (``cpu_paged_i8.c``'s header): each query head ``q [B, Hq, D]``
    quantized as a cache row (:func:`kv_quant.quantize`); its scores the exact integer dot products with the key
    codes times ``k_scale x (q_scale x scale)`` in float32 (the kernel's order), soft-capped; the softmax's
    weights ``w = exp(s - max) x v_scale`` in float32 rounded to 15 bits (``wq = round(w x 32767 / max w)``); the
    output the exact integer sums of ``wq x`` the value codes times ``max w / 32767 / sum exp``. Returns
    ``[B, Hq, D]`` float32 (a zero-length row: zeros)."""
    codes, q_scale = kv_quant.quantize(q)
    bs, out, sc = k_cache.shape[1], torch.zeros(q.shape), torch.tensor(scale, dtype=torch.float32)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        lo = max(n - window, 0) if window else 0
        pos = torch.arange(lo, n)
        blk, off = block_tables[b, pos // bs], pos % bs
        kq, vq = k_cache[blk, off][:, q_to_kv].long(), v_cache[blk, off][:, q_to_kv].long()  # [n, Hq, D] per head
        ks, vs = kv_scales[0][blk, off][:, q_to_kv].T, kv_scales[1][blk, off][:, q_to_kv].T  # [Hq, n]
        dots = torch.einsum("nhd,hd->hn", kq, codes[b].long()).float()  # exact: |dot| < 2^24
        s = dots * (ks * (q_scale[b][:, None] * sc))
        s = s if cap is None else torch.tanh(s / cap) * cap
        e = torch.exp(s - s.amax(1, keepdim=True))
        w = e * vs
        wmax = w.amax(1, keepdim=True)
        wq = torch.round(w * (torch.tensor(32767.0) / wmax)).long()
        f = wmax.double() / 32767 / e.sum(1, keepdim=True).double()
        out[b] = (torch.einsum("hn,nhd->hd", wq, vq).double() * f).float()
    return out


@needs_kernels
@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d, bs, q_to_kv, window, cap", [
    pytest.param(*CONFIGS[0].values, None, None, id="d64-mha"),
    pytest.param(*CONFIGS[1].values, None, None, id="d128-gqa3"),
    pytest.param(*CONFIGS[3].values, None, None, id="d128-uneven"),
    pytest.param(64, 16, [0, 0, 0, 1, 1, 1], 24, 30.0, id="d64-window-cap"),
    pytest.param(96, 16, [0, 0, 1, 1], None, None, id="d96-half-piece"),
])
def test_paged_decode_over_int8_equals_the_reference_on_the_dequantized_cache(d, bs, q_to_kv, window, cap, dtype,
                                                                               threads):
    """RoPE in place as torch rounds it; the new keys and values quantized into the cache bit for bit as
    kv_quant.quantize (codes and scales); attention equal to :func:`int8_reference` (the kernel's arithmetic:
    float32 within 1e-5; bfloat16 within its output rounding) and within the query's int8 rounding of the
    float32 reference over the dequantized cache; the padding row zero."""
    lens = DECODE_LENS + [300]
    qkv, cos, sin, kc, vc, scales, bt, slots, lens_t, qmap = int8_case(d, bs, q_to_kv, dtype, lens)
    hq, hkv = len(q_to_kv), max(q_to_kv) + 1
    if window is not None:  # the blocks before every row's window freed: never read
        for b, n in enumerate(lens):
            bt[b, : max(n - window, 0) // bs] = -1
    q0, k0, v0 = (x.clone() for x in (qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]))
    q0, k0 = rope(q0, cos, sin), rope(k0, cos, sin)
    kc0, vc0, sc0 = kc.clone(), vc.clone(), tuple(s.clone() for s in scales)
    ref.store_kvcache(k0, v0, kc0, vc0, slots, kv_scales=sc0)
    want = int8_reference(q0, kc0, vc0, sc0, bt, lens_t, qmap, d ** -0.5, window, cap)
    exact_q = ref.decode_attention(q0.float(), kc0, vc0, bt, lens_t, qmap, d ** -0.5, window, cap, kv_scales=sc0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run = cpu_paged.bind(kc, vc, qmap, d ** -0.5, 0, window or 0, cap or 0.0, scales, dtype)
        out = run(qkv.flatten(1), cpu_paged.Rope((cos, sin), dtype), cpu_paged.paged_index(slots, bt, lens_t))
    finally:
        torch.set_num_threads(before)
    out = out.view(len(lens), hq, d)
    assert torch.equal(qkv[:, :hq], q0) and torch.equal(qkv[:, hq:hq + hkv], k0)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    assert all(torch.equal(a, b) for a, b in zip(scales, sc0))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), want, **tol)
    torch.testing.assert_close(out.float(), exact_q, atol=0.1, rtol=0)  # the query's rounding to int8 (|v| <~ 10)
    assert (out.float() - exact_q).abs().max() > 1e-5  # ... which is there
    assert torch.equal(out[DECODE_LENS.index(0)], torch.zeros(hq, d, dtype=dtype))


@needs_kernels
def test_int8_pv_sums_stay_exact_past_the_int32_windows_and_split_spans_merge():
    """P.V's int32 sums are flushed to float32 every 512 keys: over 1300 keys of equal weight (zero queries) on
    value rows of codes 127 (each key adds 32767 x 127: an int32 sum would overflow after 516 keys) the output is
    the value row; random rows of the same length equal :func:`int8_reference` at 1 thread (float32 within 1e-5).
    At 2 threads the one work item (one KV head) is split into two spans of 650 keys whose softmax partials are
    merged: the same within the weights' 15-bit rounding (each span rounds to its own largest weight), and not
    bit-equal (the split ran)."""
    n, q_to_kv, before = 1300, [0, 0, 0], torch.get_num_threads()
    try:
        for const in (True, False):
            qkv, cos, sin, kc, vc, scales, bt, slots, lens, qmap = int8_case(64, 16, q_to_kv, torch.float32, [n], 5)
            if const:
                qkv[:, :3], qkv[:, 4:] = 0.0, 1.27
                vc.fill_(127), scales[1].fill_(0.01)
            q0, outs = rope(qkv[:, :3], cos, sin), []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                run = cpu_paged.bind(kc, vc, qmap, 0.125, 0, 0, 0.0, scales, torch.float32)
                x = qkv.clone().flatten(1)
                idx = cpu_paged.paged_index(torch.full((1,), -1), bt, lens)  # nothing stored: both runs alike
                outs.append(run(x, cpu_paged.Rope((cos, sin), torch.float32), idx).view(1, 3, 64))
            if const:
                for out in outs:
                    torch.testing.assert_close(out, torch.full((1, 3, 64), 1.27), atol=1e-6, rtol=1e-6)
            else:
                want = int8_reference(q0, kc, vc, scales, bt, lens, qmap, 0.125, None, None)
                torch.testing.assert_close(outs[0], want, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(outs[1], want, atol=3e-4, rtol=0)
                assert not torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_paged_decode_over_int8_checks_before_writing():
    """A bad block id raises decode's exact error and leaves the int8 cache and its scales unwritten."""
    qkv, cos, sin, kc, vc, scales, bt, slots, lens, qmap = int8_case(64, 16, [0, 1], torch.float32, [20, 5])
    bt[0, 1] = 10_000
    kc0, sc0 = kc.clone(), scales[0].clone()
    with pytest.raises(IndexError, match=r"paged decode: block_tables\[0\] = .* is out of range"):
        cpu_paged.decode(qkv[:, :2], qkv[:, 2:4], qkv[:, 4:], cos, sin, kc, vc, qmap, 0.125,
                         cpu_paged.paged_index(slots, bt, lens), kv_scales=scales)
    assert torch.equal(kc, kc0) and torch.equal(scales[0], sc0)


NEW = 24
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def engine_prompts() -> list[list[int]]:
    """Three prompts: the second shares the first's first 16 tokens (a prefix-cache hit of 4 blocks), the
    third repeats itself (the n-gram proposer drafts)."""
    g = torch.Generator().manual_seed(7)
    a, b = (torch.randint(3, 1001, (n,), generator=g).tolist() for n in (22, 6))
    return [a, a[:16] + b, [11, 12, 13, 14] * 5]


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """The tiny Llama (head size 32: the paged C kernel) with an int8 cache at tp 1 and 2 in a cache too
    small for the three sequences at once (preemption and recompute), chunks of 16 tokens, prefix caching
    and n-gram speculation; at tp 1 also the float32 cache (``auto``) and the torch paths (C kernels off)."""
    from conftest import make_tiny_model
    from launch import run_engine_jobs

    root = tmp_path_factory.mktemp("kv-int8")
    model = make_tiny_model(root, "llama", seed=5, head_dim=32, random_biases=True)
    reqs = [[f"p{i}", p, {"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True, "logprobs": 0}]
            for i, p in enumerate(engine_prompts())]

    def job(key, **kw):
        return {"key": key, "requests": reqs, "config": {
            "model": str(model), "dtype": "float32", "max_model_len": 64, "block_size": 4,
            "max_num_batched_tokens": 16, "num_kv_blocks": 14, "cpu_linear": "plain", "speculative_config": SPEC,
            "threads": 1,
            **kw}}
    return {1: run_engine_jobs(root, 1, [job("int8", kv_cache_dtype="int8"), job("auto"),
                                         job("int8-torch", kv_cache_dtype="int8", cpu_kernels=False)], tag="-kv8"),
            2: run_engine_jobs(root, 2, [job("int8", kv_cache_dtype="int8")], tag="-kv8")}


def by_id(job: dict, field: str = "token_ids") -> list:
    """The three requests' token ids (or their sample records, ``field="outputs"``) in prompt order."""
    outs = {o["request_id"]: o for o in job["outputs"]}
    return [outs[f"p{i}"][field] if field == "token_ids" else outs[f"p{i}"]["outputs"][0] for i in range(3)]


def test_int8_cache_at_tp2_gives_tp1s_tokens_with_preemption_prefix_caching_and_speculation(engine_runs):
    """Per-head scales do not depend on the split: tp 2's tokens are tp 1's, every one, through preemption,
    prefix-cache hits and accepted n-gram drafts; the C kernels' tokens are the torch paths'."""
    one, two = engine_runs[1]["int8"], engine_runs[2]["int8"]
    assert by_id(two) == by_id(one) and all(len(t) == NEW for t in by_id(one))
    assert by_id(engine_runs[1]["int8-torch"]) == by_id(one)
    for job in (one, two):
        stats = job["stats"]
        assert stats["num_preemptions"] > 0 and stats["cached_prompt_tokens"] >= 16, stats
        assert stats["spec_num_accepted_tokens"] > 0, stats
        assert stats["num_free_blocks"] == 14, stats


def test_int8_cache_stays_close_to_the_float32_cache(engine_runs):
    """Greedy text over the int8 cache against the float32 cache on the tiny model: the first 8 tokens of
    every sequence equal, and the chosen tokens' log-probabilities within 0.005 while the texts agree (the
    tiny random model's next-token distribution is nearly flat, log-probabilities ~ -6.3 of ln(1001), so a
    near-tie may part the texts after that; measured: |difference| < 0.001)."""
    int8, auto = engine_runs[1]["int8"], engine_runs[1]["auto"]
    for a, b in zip(by_id(int8, "outputs"), by_id(auto, "outputs")):
        ta, tb = a["token_ids"], b["token_ids"]
        assert ta[:8] == tb[:8], (ta, tb)
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        diffs = [abs(a["logprobs"][i]["chosen"]["logprob"] - b["logprobs"][i]["chosen"]["logprob"])
                 for i in range(same)]
        assert max(diffs) < 0.005, diffs


def test_flag_reaches_the_config_and_fp8_names_are_refused_by_name(tmp_path, monkeypatch):
    """``--kv-cache-dtype int8`` sets the one config field (``tpengine run``; ``serve`` and ``LLM`` take the
    same field); vLLM's fp8 names and anything else exit 2 with one error line naming the valid values."""
    from typer.testing import CliRunner

    import tpengine.entrypoints.run as run
    from tpengine.config import EngineConfig
    from tpengine.entrypoints.cli import app

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    seen = []
    monkeypatch.setattr(run, "run_engine", lambda job: seen.append(job) or 0)
    base = ["run", "--prompts", str(tmp_path / "in.jsonl"), "--model", str(model), "--out", str(tmp_path / "o.jsonl")]
    r = CliRunner().invoke(app, [*base, "--kv-cache-dtype", "int8"])
    assert r.exit_code == 0, r.output
    assert seen[0].config.kv_cache_dtype == "int8" and EngineConfig().kv_cache_dtype == "auto"
    seen[0].close()
    for value, why in (("fp8", " (vLLM's fp8 KV cache is not emulated on this engine's CPU path; int8 takes the "
                                "same bytes)"), ("int4", "")):
        r = CliRunner().invoke(app, [*base, "--kv-cache-dtype", value])
        assert r.exit_code == 2, r.output
        assert f"error: invalid kv_cache_dtype='{value}': must be one of auto, int8{why}" in r.output.splitlines()
        with pytest.raises(ValueError) as e:
            EngineConfig(kv_cache_dtype=value)
        assert str(e.value) == f"invalid kv_cache_dtype='{value}': must be one of auto, int8{why}"


@needs_kernels
def test_bench_kv_summarizes_paired_rounds_and_times_both_kernels():
    """make bench-kv's pieces: int8's speed is bfloat16's best TPOT over int8's (and the median of the paired
    rounds), the agreement counts tokens before the first difference, and the kernel part times both
    caches (2 layers, 64 keys: a smoke run)."""
    from benchmarks.bench_kv import agreement, byte_bound, kernel_times, summarize

    runs = {"auto": {"tpot_s": [0.030, 0.020, 0.026], "ttft_s": [1.0, 1.2, 1.1], "token_ids": [[1, 2, 3]] * 3,
                     "load_s": 2.0},
            "int8": {"tpot_s": [0.020, 0.016, 0.020], "ttft_s": [1.0, 1.0, 1.0], "token_ids": [[1, 2, 4]] * 3,
                     "load_s": 2.0}}
    s = summarize(runs)
    assert s["speedup_best"] == 1.25 and s["speedup_paired_median"] == 1.3 and s["goal"] == 1.3
    assert s["auto"]["tpot_best_ms"] == 20.0 and s["int8"]["tpot_median_ms"] == 20.0
    assert s["tokens_equal_before_first_difference"] == [2, 2, 2] and agreement([5], [5, 6]) == 1
    # a row's byte bound: (W + 2 x L) / (W + 1 x L) per token's KV bytes 2 and 1, W 100, L 50: 200 / 150
    runs["auto"]["weight_bytes"] = 100
    s = summarize(runs, {"auto": 2, "int8": 1}, 50)
    assert s["byte_bound"] == 1.333 and s["weight_bytes"] == 100 and byte_bound(0, {"auto": 2, "int8": 1}, 9) == 2
    k = kernel_times(2, [0, 0, 1], 64, 64, rounds=1)
    assert set(k) == {"auto", "int8", "ratio"} and all(k[c]["best_ms"] > 0 for c in ("auto", "int8"))
