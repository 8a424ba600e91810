"""No request ends a job: a request whose content raises after validation (while sampled or
detokenized in the engine, templated, tokenized or written in the job) gets its own error record,
and every other request's output is the one it gets without it. The whole-job test at tp=2 is
``test_mixed_file_at_tp2`` in tests/test_job_isolation.py."""

from __future__ import annotations

import pytest
from conftest import SMOLLM2_DIR, make_tiny_model

from tpengine.config import EngineConfig
from tpengine.engine.llm_engine import LLMEngine
from tpengine.sampling_params import SamplingParams

SEEDED = {"temperature": 0.8, "top_p": 0.9, "max_tokens": 8, "ignore_eos": True}
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12], "c": [13, 14, 15, 16, 17, 18, 19]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip("needs the SmolLM2 tokenizer (make model)")
    return make_tiny_model(tmp_path_factory.mktemp("isolation"), vocab_size=49152, max_position_embeddings=256)


def engine(model, tokenizer=None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), max_model_len=128, num_kv_blocks=64, block_size=4), tokenizer)


def run(e: LLMEngine, requests) -> dict:
    return {o.request_id: o for o in e.generate([(rid, ids, SamplingParams(**p)) for rid, ids, p in requests])}


def requests(params) -> list:
    return [(rid, ids, {**params, "seed": n}) for n, (rid, ids) in enumerate(PROMPTS.items())]


def test_sampling_failure_is_the_requests_own(model):
    """A temperature so small that logits / temperature overflow makes torch.multinomial raise for
    that row alone; the seeded rows sampled beside it draw exactly what they draw without it."""
    e = engine(model)
    clean = run(e, requests(SEEDED))
    bad = ("tiny-temperature", [20, 21, 22], {**SEEDED, "temperature": 1e-40})
    mixed = run(e, [*requests(SEEDED)[:2], bad, requests(SEEDED)[2]])
    assert mixed["tiny-temperature"].error == (
        "sampling failed: RuntimeError: probability tensor contains either `inf`, `nan` or element < 0")
    assert mixed["tiny-temperature"].token_ids == [] and mixed["tiny-temperature"].finish_reason is None
    for rid in PROMPTS:
        assert mixed[rid].error is None
        assert mixed[rid].token_ids == clean[rid].token_ids and len(clean[rid].token_ids) == 8
    s = e.stats()
    assert s.num_free_blocks == s.num_total_blocks and s.num_running == s.num_waiting == 0  # no block leaked


class PoisonedTokenizer:
    """The real tokenizer, except that decoding ``poison`` raises (no request content is known to make
    a Hugging Face tokenizer's decode raise, so the detokenizing path is reached by injection)."""

    def __init__(self, tokenizer, poison: int):
        self._tok, self.poison = tokenizer, poison

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def decode(self, ids, **kw):
        if self.poison in ids:
            raise IndexError(f"piece id {self.poison} is out of range")
        return self._tok.decode(ids, **kw)


def test_detokenizing_failure_is_the_requests_own(model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    clean = run(engine(model), requests(GREEDY))
    others = {t for rid in ("a", "c") for t in clean[rid].token_ids}
    poison = next(t for t in clean["b"].token_ids if t not in others)
    at = clean["b"].token_ids.index(poison)
    mixed = run(engine(model, PoisonedTokenizer(tok, poison)), requests(GREEDY))
    assert mixed["b"].error == f"detokenizing failed: IndexError: piece id {poison} is out of range"
    assert mixed["b"].token_ids == [] and len(clean["b"].token_ids) == 8 and at < 8
    for rid in ("a", "c"):
        assert mixed[rid].error is None and mixed[rid].token_ids == clean[rid].token_ids
        assert mixed[rid].text == clean[rid].text


def test_max_tokens_none_runs_to_the_context_limit(model):
    """An OpenAI chat request without max_tokens (``max_tokens=None``) runs to max_model_len, as vLLM."""
    out = run(engine(model), [("open", [5, 6, 7, 8, 9], {**GREEDY, "max_tokens": None})])["open"]
    assert out.finish_reason == "length" and len(out.token_ids) == 128 - 5
