"""The decoder families beyond Llama (tpengine.model.families): Gemma, Gemma 2, Gemma 3, Phi-3 (LongRoPE),
OLMo 2, OLMo 3, Granite, and a Mistral whose window is shorter than its prompts, token for token equal to
HF ``generate`` in float32 through the engine at tp 1, 2 and 3 (4 query heads: an uneven split), with
prefix caching, chunked prefill, preemption, n-gram speculative decoding, a structured output and int8
weights; the batch job at tp 3 and ``LLM`` at tp 1. (Each family's logits at tp 1-4 from full and split
folders, and in bfloat16: test_tp_model.py.)

One launch per tp size runs every family's engine jobs (tests/workers/engine_generate.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model
from hf_reference import greedy
from launch import cli, run_engine_jobs

# name -> (arch, make_tiny_model overrides); conftest.FAMILY_DEFAULTS sets each family's own features
FAMILY_MODELS = {
    "gemma2": ("gemma2", dict(tie_word_embeddings=True)),
    "gemma3": ("gemma3_text", dict(tie_word_embeddings=True)),
    # LongRoPE: prompts and outputs cross original_max_position_embeddings=16
    "phi3": ("phi3", dict(original_max_position_embeddings=16, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(8)],
        "long_factor": [3.0 + 2.0 * i for i in range(8)]})),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    "gemma": ("gemma", dict(tie_word_embeddings=True)),
    "olmo3": ("olmo3", {}),
    "mistral": ("mistral", dict(sliding_window=8)),  # every layer slides, over prompts up to 38 tokens
}
LENGTHS = (5, 37, 1, 12, 20)
NEW = 10
GREEDY = {"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": 64}
INT8 = ("gemma2", "phi3", "granite")  # (OLMo 2's norm over the whole projection sums across ranks: tp 2 != tp 1)


def prompts() -> list[list[int]]:
    """:data:`LENGTHS` random prompts, a sixth that shares the 37-token one's first 32 (two full blocks:
    a prefix-cache hit when it runs after it), and a seventh that repeats itself (the n-gram proposer's
    lookup finds its last token earlier, so speculation always drafts)."""
    g = torch.Generator().manual_seed(5)
    out = [torch.randint(3, 1001, (n,), generator=g).tolist() for n in LENGTHS]
    return out + [out[1][:32] + torch.randint(3, 1001, (6,), generator=g).tolist(), [7, 8, 9, 10] * 6]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    # (intermediate 128: the int8 kernels take rows of a multiple of 16; 43/43/42 per rank at tp 3)
    return {name: make_tiny_model(root, arch, name=name, seed=4, random_biases=True, intermediate_size=128, **kw)
            for name, (arch, kw) in FAMILY_MODELS.items()}


@pytest.fixture(scope="module")
def hf(models):
    """HF's greedy continuations of :func:`prompts`, one prompt at a time (a LongRoPE batch would switch
    every row to the long factors together), eager attention, never stopping at EOS."""
    return {name: greedy(d, prompts(), NEW, stop_at_eos=False, attn="eager", batched=False)
            for name, d in models.items()}


def cfg(d, **kw) -> dict:
    return {"model": str(d), "dtype": "float32", "max_model_len": 256, "kv_cache_gb": 0.05, "cpu_linear": "plain",
            **kw}


def reqs(ids=None, **params) -> list[list]:
    ps = prompts()
    return [[f"p{i}", ps[i], {**GREEDY, **params}] for i in (ids if ids is not None else range(len(ps)))]


def jobs_for(models, tp: int) -> list[dict]:
    jobs = []
    for name, d in models.items():
        # chunks of 16 tokens, the shared prompt after the one it shares with (a prefix-cache hit); Phi-3's
        # LongRoPE decides per chunk, so its prompts run whole (DecoderStack._rope)
        chunk = 2048 if name == "phi3" else 16
        jobs.append({"key": f"{name}/greedy", "config": cfg(d, max_num_batched_tokens=chunk),
                     "waves": [reqs([0, 1, 2, 3, 4, 6]), reqs([5])]})
        if tp == 2:  # speculation with preemption: a cache too small for every sequence at once
            jobs.append({"key": f"{name}/spec", "config": cfg(d, max_num_batched_tokens=chunk, num_kv_blocks=8,
                                                               speculative_config=SPEC), "requests": reqs()})
        if tp in (1, 2) and name in INT8:
            jobs.append({"key": f"{name}/int8", "config": cfg(d, quantization="int8"), "requests": reqs(range(5))})
    if tp == 2:
        choice = {"temperature": 0.0, "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}}
        jobs.append({"key": "gemma2/choice", "config": cfg(models["gemma2"]), "requests": [["c", prompts()[0],
                                                                                         choice]]})
    return jobs


@pytest.fixture(scope="module")
def results(models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("family-runs")
    return {tp: run_engine_jobs(tmp, tp, jobs_for(models, tp)) for tp in (1, 2, 3)}


def tokens(result: dict) -> dict[str, list[int]]:
    return {o["request_id"]: o["token_ids"] for o in result["outputs"]}


@pytest.mark.parametrize("tp", (1, 2, 3))
@pytest.mark.parametrize("name", list(FAMILY_MODELS))
def test_greedy_equals_hf(hf, results, name, tp):
    """Every prompt's tokens equal HF's, chunked prefill and a prefix-cache hit included."""
    got = tokens(results[tp][f"{name}/greedy"])
    assert [got[f"p{i}"] for i in range(len(prompts()))] == hf[name]
    stats = results[tp][f"{name}/greedy"]["stats"]
    assert stats["cached_prompt_tokens"] >= 32, stats  # the sixth prompt's two shared blocks


@pytest.mark.parametrize("name", list(FAMILY_MODELS))
def test_speculation_and_preemption_equal_hf(hf, results, name):
    """n-gram speculation at tp 2 with a KV cache of 8 blocks (preemption): still HF's tokens. (Whether the
    proposer finds a draft depends on a random model repeating itself: counted over every family below.)"""
    job = results[2][f"{name}/spec"]
    got = tokens(job)
    assert [got[f"p{i}"] for i in range(len(prompts()))] == hf[name]
    assert job["stats"]["num_preemptions"] > 0, job["stats"]


def test_speculation_drafted_and_accepted(results):
    stats = [results[2][f"{name}/spec"]["stats"] for name in FAMILY_MODELS]
    assert sum(s["spec_num_drafts"] > 0 for s in stats) >= len(stats) // 2
    assert sum(s["spec_num_accepted_tokens"] for s in stats) > 0


@pytest.mark.parametrize("name", INT8)
def test_int8_tp2_equals_tp1(results, name):
    one, two = tokens(results[1][f"{name}/int8"]), tokens(results[2][f"{name}/int8"])
    assert one == two and all(len(t) == NEW for t in one.values())


def test_structured_choice(results):
    out = results[2]["gemma2/choice"]["outputs"][0]
    assert out["text"] in ("yes", "no")


def test_batch_job_tp3_equals_hf(models, hf, tmp_path):
    """The batch job (``tpengine.run``) at tp 3 on Gemma 2 and OLMo 2: HF's tokens, record by record."""
    for name in ("gemma2", "olmo2"):
        src, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}-out.jsonl"
        src.write_text("".join(json.dumps({"id": f"p{i}", "prompt_token_ids": p, **GREEDY}) + "\n"
                               for i, p in enumerate(prompts())))
        cli(["--prompts", str(src), "--model", str(models[name]), "--out", str(out), "--dtype", "float32",
             "--max-model-len", "256"], tp=3)
        got = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
        assert [got[f"p{i}"] for i in range(len(prompts()))] == hf[name]


# Gemma's own chat template (its tokenizer_config.json): no system role, alternating turns
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


@pytest.fixture(scope="module")
def gemma2_chat(tmp_path_factory):
    """A Gemma 2 of the SmolLM2 tokenizer's vocabulary, with Gemma's own chat template."""
    d = make_tiny_model(tmp_path_factory.mktemp("gemma2-chat"), "gemma2", name="gemma2-chat", vocab_size=49152)
    (d / "chat_template.jinja").write_text(GEMMA_TEMPLATE)
    return d


def test_server_tp3(gemma2_chat, tmp_path):
    """``tpengine serve`` at tp 3 on a Gemma 2: token-id completions equal HF's greedy ones; a chat with a
    system message is a 400 carrying the template's own error, a chat without one runs."""
    import openai
    from serving import Server

    ps = [p[:20] for p in prompts()[:3]]
    want = greedy(gemma2_chat, ps, NEW, stop_at_eos=False, attn="eager", batched=False)
    server = Server(tmp_path, tp=3, extra=("--model", str(gemma2_chat), "--max-model-len", "256"))
    try:
        c = server.client
        got = [c.completions.create(model="gemma2-chat", prompt=p, temperature=0.0, max_tokens=NEW, logprobs=0,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}) for p in ps]
        assert [[int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens] for r in got] == want
        r = c.chat.completions.create(model="gemma2-chat", messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=2, temperature=0.0)
        assert r.usage.completion_tokens == 2
        with pytest.raises(openai.BadRequestError, match="System role not supported"):
            c.chat.completions.create(model="gemma2-chat", max_tokens=2, messages=[
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    finally:
        server.stop()


def test_llm_tp1_equals_hf(models, hf, gemma2_chat):
    """``LLM`` in this process at tp 1 (Granite, Phi-3 and Gemma 2), and Gemma's own chat template: a
    conversation it renders runs, one with a system message gets the template's own error as its output."""
    from tpengine import LLM, SamplingParams

    for name in ("granite", "phi3"):
        with LLM(str(models[name]), dtype="float32", max_model_len=256, kv_cache_gb=0.05) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                                SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
            assert [list(o.outputs[0].token_ids) for o in outs] == hf[name]
    with LLM(str(gemma2_chat), dtype="float32", max_model_len=256, kv_cache_gb=0.05) as llm:
        ok, bad = llm.chat([[{"role": "user", "content": "Hi"}],
                            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]],
                           SamplingParams(max_tokens=2, temperature=0.0))
        text = llm.llm_engine.tokenizer.decode(ok.prompt_token_ids)
    assert ok.error is None and len(ok.outputs[0].token_ids) == 2
    assert text.endswith("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"), text
    assert "System role not supported" in bad.error
