"""GPU-only checks (marked ``gpu``; skipped without CUDA), on SmolLM2-135M-Instruct at tp=1 in
bfloat16 (the "auto" dtype on CUDA) with the Triton backend:

* defaults on CUDA: bf16, Triton kernels, CUDA graphs captured;
* KV cache sized from free memory after the warm-up prefill, and a largest-size step still fits;
* CUDA-graph decode equals eager decode (exactly for a batch that fills a bucket; for a padded
  batch any divergence must be a near tie);
* case C17 in bf16: batch composition (alone / together / joining while others decode) keeps
  step-1 logits within 2e-2 and changes tokens only at near ties.

``scripts/gpu_check.sh`` runs this file on a GPU machine.
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import SMOLLM2_DIR

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = {"temperature": 0.0, "ignore_eos": True}
#: C17 bf16: step-1 logits within this of the solo run (absolute + relative, as torch.testing)
LOGIT_TOL = 2e-2
#: C17 near tie: top-2 gap below this, or within two bf16 ulps of the top logit (bf16 logits are
#: quantised: one ulp is 0.0625 for values in [8, 16), so a gap < 1e-2 alone means an exact tie)
NEAR_TIE = 1e-2


def bf16_ulp(x: float) -> float:
    return 2.0 ** (torch.tensor(abs(x) or 1.0).log2().floor().item() - 7)


def engine(**kw):
    from tpengine.config import EngineConfig
    from tpengine.engine.llm_engine import LLMEngine

    if not (SMOLLM2_DIR / "config.json").is_file():
        pytest.fail(f"{SMOLLM2_DIR} is missing: run `make model` first")
    gc.collect()  # a previous test's engine may just have been dropped
    torch.cuda.empty_cache()
    return LLMEngine(EngineConfig(**{"model": str(SMOLLM2_DIR), "max_model_len": 512, "num_kv_blocks": 1024,
                                     **kw}))


def close(e) -> None:
    e.shutdown()
    del e
    gc.collect()
    torch.cuda.empty_cache()


def generate(e, prompts: dict[str, list[int]], max_tokens: int | dict[str, int]):
    """Greedy run (``max_tokens`` for all, or per id); returns ``({id: tokens}, {id: [step logits,
    float32 CPU]})`` (rank 0)."""
    from tpengine.sampling_params import SamplingParams

    logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    sample = e.sampler.sample

    def record(rows, seqs):
        for row, s in zip(rows, seqs):
            logits[s.request_id].append(row.float().cpu())
        return sample(rows, seqs)

    e.sampler.sample = record
    try:
        per = max_tokens if isinstance(max_tokens, dict) else dict.fromkeys(prompts, max_tokens)
        outs = e.generate([(rid, ids, SamplingParams(max_tokens=per[rid], **GREEDY))
                           for rid, ids in prompts.items()])
    finally:
        e.sampler.sample = sample
    return {o.request_id: o.token_ids for o in outs}, logits


def divergence_is_near_tie(tokens, ref_tokens, ref_logits) -> tuple[bool, str]:
    """True if ``tokens`` equals ``ref_tokens`` or first differs where the reference's top-2
    logits are a near tie."""
    t = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
    if t is None:
        return len(tokens) == len(ref_tokens), "equal"
    top2 = ref_logits[t].topk(2).values
    gap = float(top2[0] - top2[1])
    ok = gap < NEAR_TIE or gap <= 2 * bf16_ulp(float(top2[0]))
    return ok, f"first divergence at step {t}: top-2 gap {gap:.4g} (top logit {float(top2[0]):.4g})"


@pytest.fixture(scope="module")
def chat_prompts() -> list[list[int]]:
    from test_engine import CHAT
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True)["input_ids"]) for q in CHAT]


def test_cuda_defaults():
    from tpengine.backends.cuda.attention import TritonAttentionBackend

    e = engine()
    try:
        r = e.runner
        assert r.dtype is torch.bfloat16 and r.kv_cache.dtype is torch.bfloat16
        assert r.kv_cache.device.type == "cuda" and isinstance(r.backend, TritonAttentionBackend)
        assert r.graphs is not None and sorted(r.graphs.graphs) == r.graphs.batch_sizes
    finally:
        close(e)
    e = engine(enforce_eager=True)
    try:
        assert e.runner.graphs is None
    finally:
        close(e)


def test_kv_cache_sized_after_warmup():
    """No num_kv_blocks: blocks from gpu_memory_utilization x free memory less the warm-up peak;
    a prefill of max_num_batched_tokens then decodes still run (no OOM), and the cache takes no
    more than the budget."""
    from tpengine.engine.step import StepKind, StepPlan

    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    e = engine(num_kv_blocks=None, gpu_memory_utilization=0.5, max_model_len=2048,
               max_num_batched_tokens=8192)
    try:
        r = e.runner
        kv_bytes = r.kv_cache.numel() * r.kv_cache.element_size()
        assert r.num_blocks >= 2048 // 16
        assert kv_bytes <= 0.5 * free_before
        lens = [2048] * 4
        cu = torch.tensor([0, *lens]).cumsum(0)
        n = int(cu[-1])
        bt = torch.arange(4 * 128).view(4, 128)
        slots = torch.cat([bt[i].repeat_interleave(16) * 16 + torch.arange(16).repeat(128) for i in range(4)])
        plan = StepPlan(StepKind.PREFILL, input_ids=torch.randint(0, 1000, (n,)),
                        positions=torch.cat([torch.arange(x) for x in lens]), slot_mapping=slots,
                        block_tables=bt, cu_seqlens_q=cu, cu_seqlens_k=cu, context_lens=torch.tensor(lens),
                        sample_idx=cu[1:] - 1)
        assert r.execute(plan).shape[0] == 4
        torch.cuda.synchronize()
    finally:
        close(e)


@pytest.mark.parametrize("n", [8, 3], ids=["bucket-8", "padded-3-to-4"])
def test_cuda_graphs_equal_eager(chat_prompts, n):
    prompts = {f"c{i}": p for i, p in enumerate(chat_prompts[:n])}
    outs = {}
    for eager in (True, False):
        e = engine(enforce_eager=eager)
        try:
            if not eager:
                replays, run = [], e.runner.graphs.run

                def counted(input_ids, *tensors, replays=replays, run=run):
                    replays.append(len(input_ids))
                    return run(input_ids, *tensors)

                e.runner.graphs.run = counted
            outs[eager] = generate(e, prompts, 32)
        finally:
            close(e)
    assert replays and max(replays) == n  # decode steps did replay graphs
    (want, want_logits), (got, _) = outs[True], outs[False]
    if n == 8:
        assert got == want
    else:
        for rid in prompts:
            ok, why = divergence_is_near_tie(got[rid], want[rid], want_logits[rid])
            assert ok, f"{rid}: {why}"


def test_c17_bf16_batch_composition():
    """C17 on GPU: SmolLM2 bf16, prompts of 5, 37 and 1 tokens, greedy, 24 tokens: alone,
    together, and P3 joining while P2 decodes (max_num_seqs 2; P1 stops after 12 tokens, so P3
    is prefilled between P2's decode steps and then decodes beside it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    text = ("The history of the city goes back to a small fishing village on the river, where traders "
            "from the north and the south met every spring to exchange salt, furs, grain and news of "
            "the wider world beyond the mountains.")
    ids = tok(text)["input_ids"]
    assert len(ids) >= 37
    prompts = {"P1": ids[:5], "P2": ids[3:40], "P3": ids[10:11]}
    e = engine()
    try:
        alone = {rid: generate(e, {rid: p}, 24) for rid, p in prompts.items()}
        together = generate(e, prompts, 24)
    finally:
        close(e)
    e = engine(max_num_seqs=2)
    try:
        join = generate(e, prompts, {"P1": 12, "P2": 24, "P3": 24})
        stats = e.stats()
        # P3 decoded beside P2: fewer decode steps than P1, then P2, then P3 (11 + 12 + 23)
        assert stats.prefill_steps == 2 and stats.decode_steps < 11 + 12 + 23
    finally:
        close(e)
    for rid in prompts:
        solo_tokens, solo_logits = alone[rid][0][rid], alone[rid][1][rid]
        assert len(solo_tokens) == 24
        for name, (tokens, logits) in (("together", together), ("join", join)):
            torch.testing.assert_close(logits[rid][0], solo_logits[0], atol=LOGIT_TOL, rtol=LOGIT_TOL,
                                       msg=lambda m, rid=rid, name=name: f"{rid} {name} step-1 logits: {m}")
            ok, why = divergence_is_near_tie(tokens[rid], solo_tokens[: len(tokens[rid])], solo_logits)
            assert ok, f"{rid} {name}: {why}"
