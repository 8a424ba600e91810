"""The server as clients nobody here wrote use it (issue 36), on real ranks (tp=2, SmolLM2 in
float32), through the official ``openai`` client and raw HTTP: ``echo`` prompt scoring as
lm-eval's ``local-completions`` asks for it (the prompt logprobs equal Hugging Face's
``log_softmax`` within 1e-4), ``max_tokens`` 0, several prompts in one request with n > 1
(streamed and not), unknown fields accepted and logged once, ``/tokenize`` and ``/detokenize``,
``/version`` and ``/v1/models/{id}``, vLLM's length 400, and OpenAI's chunk shapes (``role`` only
in a choice's first chunk)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch
from conftest import SMOLLM2_DIR
from launch import cli
from serving import SETTINGS

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(not (SMOLLM2_DIR / "config.json").is_file(), reason="needs make model")

MODEL = "smollm2-135m-instruct"
TOL = 1e-4
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture
def server(smollm2_server):
    """The session's tp=2 SmolLM2 server (conftest), shared with test_server.py."""
    return smollm2_server


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM2_DIR)


@pytest.fixture(scope="module")
def hf_logprobs():
    """ids -> HF's float32 ``log_softmax`` of its logits ``[len(ids), V]`` (row p predicts token p + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(SMOLLM2_DIR, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


def post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(server, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(server.url + path, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sse_chunks(server, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed response (``[DONE]`` last, left out)."""
    req = urllib.request.Request(server.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events = [line.decode()[6:].strip() for line in urllib.request.urlopen(req, timeout=60)
              if line.startswith(b"data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_echo_scores_the_prompt_as_lm_eval_asks(server, tok, hf_logprobs):
    """lm-eval's loglikelihood request: token-id prompts, ``echo``, ``max_tokens`` 1, ``logprobs``
    1, greedy. Each choice holds its prompt's tokens then the generated one: the first prompt
    token's logprob null, the others HF's within 1e-4, offsets over the whole text."""
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    status, r = post(server, "/v1/completions", {"model": MODEL, "prompt": ids, "echo": True, "max_tokens": 1,
                                                 "logprobs": 1, "temperature": 0.0})
    assert status == 200, r
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["prompt_tokens"] == sum(map(len, ids)) and r["usage"]["completion_tokens"] == 3
    for p, prompt_ids, c in zip(PROMPTS, ids, r["choices"]):
        lp = c["logprobs"]
        want = hf_logprobs(prompt_ids)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt_ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for j in range(1, len(prompt_ids)):
            assert lp["token_logprobs"][j] == pytest.approx(float(want[j - 1, prompt_ids[j]]), abs=TOL)
            top = lp["top_logprobs"][j]
            best = int(want[j - 1].argmax())
            assert top[tok.decode([best])] == pytest.approx(float(want[j - 1, best]), abs=TOL)
            assert lp["tokens"][j] in top and len(top) in (1, 2)
        greedy = int(want[-1].argmax())
        assert lp["tokens"][-1] == tok.decode([greedy])
        assert lp["token_logprobs"][-1] == pytest.approx(float(want[-1, greedy]), abs=TOL)
        assert c["text"] == p + tok.decode([greedy])  # the prompt's text (decoded ids), then the completion
        assert lp["text_offset"][0] == 0 and lp["text_offset"][-1] == len(p)
        assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:-1], lp["tokens"]))


def test_max_tokens_0_with_echo_scores_without_generating(server, tok, hf_logprobs):
    p = PROMPTS[1]
    r = server.client.completions.create(model=MODEL, prompt=p, echo=True, max_tokens=0, logprobs=2)
    (c,) = r.choices
    ids = tok(p)["input_ids"]
    assert (c.text, c.finish_reason, r.usage.completion_tokens, r.usage.prompt_tokens) == (p, "length", 0, len(ids))
    assert c.logprobs.tokens == [tok.decode([t]) for t in ids]
    want = hf_logprobs(ids)
    assert c.logprobs.token_logprobs[1:] == pytest.approx([float(want[j - 1, ids[j]]) for j in range(1, len(ids))],
                                                          abs=TOL)
    assert all(len(top) in (2, 3) for top in c.logprobs.top_logprobs[1:])
    plain = server.client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0.0)
    echoed = server.client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0.0, echo=True)
    assert echoed.choices[0].text == p + plain.choices[0].text and echoed.choices[0].logprobs is None


def test_prompt_lists_with_n_samples_streamed_and_not(server, tok):
    """Three prompts (strings, then the same as token-id lists), n=2 seeded samples: choice
    ``index`` = prompt * 2 + sample, each equal to that prompt sent alone; the stream's deltas per
    index join into the same texts; usage counts every prompt and sample."""
    kw = {"model": MODEL, "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 2, "extra_body": {"ignore_eos": True}}
    alone = [[ch.text for ch in server.client.completions.create(prompt=p, **kw).choices] for p in PROMPTS]
    want = [t for texts in alone for t in texts]
    for prompt in (PROMPTS, [tok(p)["input_ids"] for p in PROMPTS]):
        r = server.client.completions.create(prompt=prompt, **kw)
        assert [ch.index for ch in r.choices] == list(range(6))
        assert [ch.text for ch in r.choices] == want
        assert r.usage.completion_tokens == 48
        assert r.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in PROMPTS)
        texts, finish = [""] * 6, [None] * 6
        stream = server.client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True},
                                                  **kw)
        usage = None
        for chunk in stream:
            usage = chunk.usage or usage
            for ch in chunk.choices:
                texts[ch.index] += ch.text
                finish[ch.index] = ch.finish_reason or finish[ch.index]
        assert texts == want and finish == ["length"] * 6 and usage.completion_tokens == 48
    chunks = sse_chunks(server, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[:2], "echo": True,
                                                    "max_tokens": 3, "temperature": 0.0})
    joined = {0: "", 1: ""}
    for ch in (c for chunk in chunks for c in chunk["choices"]):
        joined[ch["index"]] += ch["text"]
    plain = server.client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=3, temperature=0.0)
    assert [joined[0], joined[1]] == [p + ch.text for p, ch in zip(PROMPTS[:2], plain.choices)]


def test_unknown_fields_are_accepted_and_logged_once(server):
    extra = {"service_tier": "auto", "reasoning_effort": "low", "frobnicate": {"x": 1}}
    for _ in range(2):
        r = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi",
                                                                           "refusal": None}],
                                                  max_tokens=2, temperature=0.0, user="u1", metadata={"a": "b"},
                                                  extra_body=extra)
        assert r.choices[0].finish_reason == "length"
    log = server.log.read_text()
    for name in extra:
        assert log.count(f"ignoring the unknown field {name!r} of ChatCompletionRequest") == 1, log[-2000:]
    assert log.count("ignoring the unknown field 'refusal' of ChatMessage") == 1
    with pytest.raises(openai.BadRequestError) as e:  # a known field with a bad value is still a 400
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2, extra_body={"top_k": "ten", "frobnicate": 1})
    assert e.value.body["param"] == "top_k"


def test_tokenize_detokenize_version_and_model_card(server, tok):
    text = "Écris « café » 😀"
    status, r = post(server, "/tokenize", {"model": MODEL, "prompt": text})
    ids = tok(text)["input_ids"]
    assert status == 200 and r == {"count": len(ids), "max_model_len": 1024, "tokens": ids, "token_strs": None}
    status, r2 = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert r2["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert r2["token_strs"] == tok.convert_ids_to_tokens(r2["tokens"])
    assert post(server, "/detokenize", {"model": MODEL, "tokens": ids}) == (200, {"prompt": tok.decode(ids)})
    assert tok.decode(ids) == text  # the round trip
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    status, r = post(server, "/tokenize", {"messages": messages})
    want = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert status == 200 and r["tokens"] == want and r["count"] == len(want)
    chat = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == len(want)  # the same tokens the chat endpoint runs
    status, err = post(server, "/detokenize", {"tokens": [1, 10 ** 6]})
    assert status == 400 and err["error"]["message"] == "token id 1000000 is out of range: vocab size is 49152"
    status, err = post(server, "/tokenize", {"prompt": 3})
    assert status == 400 and err["error"]["message"] == "prompt: must be a string, got 3"
    status, info = get(server, "/tokenizer_info")  # what lm-eval's remote tokenizer reads
    assert status == 200 and (info["eos_token"], info["chat_template"]) == (tok.eos_token, tok.chat_template)
    from tpengine import __version__

    assert get(server, "/version") == (200, {"version": __version__})
    status, card = get(server, f"/v1/models/{MODEL}")
    assert status == 200 and (card["id"], card["object"], card["max_model_len"]) == (MODEL, "model", 1024)
    assert server.client.models.retrieve(MODEL).id == MODEL
    status, err = get(server, "/v1/models/gpt-4")
    assert status == 404 and err["error"]["message"] == ("The model `gpt-4` does not exist; this server serves "
                                                         "`smollm2-135m-instruct`")


def test_length_rule_names_both_numbers(server):
    """Prompt + max_tokens beyond max_model_len is a 400 naming both (vLLM's rule); without
    max_tokens the same prompt runs to the limit."""
    prompt = "apple" + " apple" * 1009  # 1010 tokens
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_completion_tokens=2000)
    assert e.value.body["param"] == "max_completion_tokens" and "1024" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=15)
    assert e.value.body["message"] == ("this model's maximum context length (max_model_len) is 1024 tokens, but the "
                                       "request asks for 1025: 1010 in the prompt and 15 in the completion "
                                       "(max_tokens); ask for at most 14 tokens, or shorten the prompt")
    r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=14, temperature=0.0,
                                         extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 14
    long_chat = "apple" + " apple" * 899  # 900 tokens, and the template's
    status, r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": long_chat}],
                                                      "temperature": 0.0, "ignore_eos": True})
    assert status == 200 and r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["total_tokens"] == 1024


def _keys_are_sdk_fields(obj: dict, model) -> None:
    """Every key of ``obj`` (recursively, through nested models and lists of them) is a field of
    the ``openai`` SDK's pydantic ``model``."""
    import typing

    for k, v in obj.items():
        assert k in model.model_fields, (k, model.__name__)
        ann = model.model_fields[k].annotation
        inner = [a for a in typing.get_args(ann) or (ann,) for a in (typing.get_args(a) or (a,))]
        sub = next((a for a in inner if isinstance(a, type) and hasattr(a, "model_fields")), None)
        if sub is not None and isinstance(v, dict):
            _keys_are_sdk_fields(v, sub)
        elif sub is not None and isinstance(v, list):
            for x in v:
                if isinstance(x, dict):
                    _keys_are_sdk_fields(x, sub)


def test_chunks_have_openai_shapes_and_role_only_first(server):
    from openai.types import Completion
    from openai.types.chat import ChatCompletionChunk

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 6,
            "temperature": 1.0, "seed": 1, "n": 2, "logprobs": True, "top_logprobs": 1, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    chunks = sse_chunks(server, "/v1/chat/completions", body)
    firsts = {}
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        _keys_are_sdk_fields(chunk, ChatCompletionChunk)
        for ch in chunk["choices"]:
            if ch["index"] not in firsts:
                firsts[ch["index"]] = ch["delta"]
            else:
                assert "role" not in ch["delta"], ch
    assert firsts == {0: {"role": "assistant", "content": ""}, 1: {"role": "assistant", "content": ""}}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    for chunk in sse_chunks(server, "/v1/completions", {"model": MODEL, "prompt": PROMPTS, "max_tokens": 3,
                                                        "logprobs": 1, "echo": True}):
        # the SDK builds stream chunks without validating (OpenAI's own have a null finish_reason and
        # echo's null first logprob), so only the field names are checked here
        _keys_are_sdk_fields(chunk, Completion)


def test_the_batch_jobs_openai_lines_echo_as_the_server_does(server, tmp_path):
    """``echo`` (with ``max_tokens`` 0 too) in OpenAI Batch completions lines: the same choices as
    the server's, text and logprobs."""
    bodies = [{"prompt": PROMPTS[0], "echo": True, "max_tokens": 3, "logprobs": 1, "temperature": 0.0},
              {"prompt": PROMPTS[1], "echo": True, "max_tokens": 0, "logprobs": 0}]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/completions", "body": b}
             for i, b in enumerate(bodies)]
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cli(["--prompts", prompts, "--out", out, *SETTINGS], tp=2)
    recs = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.read_text().splitlines())}
    for i, b in enumerate(bodies):
        status, want = post(server, "/v1/completions", {"model": MODEL, **b})
        assert status == 200
        got = recs[f"e{i}"]
        assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
        for g, w in zip(got["choices"], want["choices"]):
            assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
            assert g["logprobs"]["token_logprobs"] == pytest.approx(w["logprobs"]["token_logprobs"], abs=TOL)
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    assert recs["e1"]["choices"][0]["text"] == PROMPTS[1] and recs["e1"]["usage"]["completion_tokens"] == 0
