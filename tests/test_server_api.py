"""The server's cross-cutting API surface (issue 58, items 4 and 5), as vLLM serves it: ``--api-key`` (401
with OpenAI's error object on every ``/v1`` route, the official ``openai`` client raising
``AuthenticationError``; ``/health``, ``/metrics``, ``/version`` and the tokenizer routes open), OpenAI's
error object for unknown routes and wrong methods, ``HEAD /health``, ``x-request-id`` (echoed or generated,
the response's id), ``/tokenize`` with ``tools`` counting what the chat request counts,
``stream_options.continuous_usage_stats``, ``return_tokens_as_token_ids``, and vLLM's remaining metrics.

The API-key server is the tiny random model at tp=1 with the Hermes tools template (cheap to start); the
rest runs on the session's SmolLM2 server (tp=2, conftest's ``smollm2_server``)."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import pytest
from conftest import SMOLLM2_DIR
from launch import REPO
from serving import Server, openai_client

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(not (SMOLLM2_DIR / "config.json").is_file(), reason="needs make model")

KEYS = ("sk-first-3f9c1a", "sk-second-77b2e0")
TEMPLATE = str(REPO / "examples" / "tool_chat_template_hermes.jinja")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "smollm2-135m-instruct"
MISSING = "Missing API key: send it as the header 'Authorization: Bearer <key>'"
WRONG = ("Incorrect API key provided: the key sent (the Authorization header's bearer token or the x-api-key header) "
         "is not an API key of this server")


def http(url: str, method: str = "GET", body: dict | None = None, headers: dict | None = None
         ) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of one raw HTTP request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        resp = urllib.request.urlopen(req, timeout=120)
    except urllib.error.HTTPError as e:
        resp = e
    with resp:
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()


def error(status: int, message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, tiny):
    """The tiny model at tp=1 behind two API keys, with the Hermes template (it renders tools)."""
    s = Server(tmp_path_factory.mktemp("keyed"), tp=1, extra=(
        "--model", str(tiny), "--max-model-len", "512", "--chat-template", TEMPLATE,
        "--api-key", KEYS[0], "--api-key", KEYS[1]))
    s.model = tiny.name
    yield s
    s.stop()


def test_api_key_guards_every_v1_route(keyed):
    client = openai_client(keyed.url, timeout=60).with_options(api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError) as e:
        client.chat.completions.create(model=keyed.model, messages=ASK, max_tokens=2)
    assert e.value.status_code == 401
    assert e.value.body == error(401, WRONG, "authentication_error")["error"]
    for path, method in (("/v1/models", "GET"), ("/v1/completions", "POST"), ("/v1/chat/completions", "POST"),
                         ("/v1/no-such-route", "GET")):
        status, headers, body = http(keyed.url + path, method, {} if method == "POST" else None)
        assert (status, headers["www-authenticate"], json.loads(body)) == (
            401, "Bearer", error(401, MISSING, "authentication_error")), path
    # either key, the scheme in any case; behind the check, the route's own answers
    for key, scheme in zip(KEYS, ("Bearer", "bearer")):
        client = openai_client(keyed.url, timeout=60).with_options(api_key=key)
        r = client.completions.create(model=keyed.model, prompt="Hello", max_tokens=3, temperature=0.0,
                                      extra_headers={"Authorization": f"{scheme} {key}"})
        assert r.usage.completion_tokens == 3
    status, _, body = http(keyed.url + "/v1/models", headers={"x-api-key": KEYS[1]})  # the anthropic SDK's header
    assert status == 200 and json.loads(body)["data"][0]["id"] == keyed.model
    status, _, body = http(keyed.url + "/v1/no-such-route", headers={"Authorization": f"Bearer {KEYS[1]}"})
    assert (status, json.loads(body)) == (404, error(404, "Not Found: no route GET /v1/no-such-route",
                                                     "not_found_error"))


def test_open_routes_and_no_key_in_the_log(keyed):
    assert http(keyed.url + "/health")[0] == 200
    assert http(keyed.url + "/version")[0] == 200
    status, _, text = http(keyed.url + "/metrics")
    assert status == 200 and b"tpengine:num_requests_running" in text
    status, _, body = http(keyed.url + "/tokenize", "POST", {"prompt": "Hello"})
    assert status == 200 and json.loads(body)["count"] == 1
    log = keyed.log.read_text()
    assert "2 API key(s) required on /v1" in log
    assert not any(k in log for k in KEYS)


def test_tokenize_counts_the_tools_as_the_chat_request_does(keyed):
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    _, _, plain = http(keyed.url + "/tokenize", "POST", {"messages": ASK})
    _, _, with_tools = http(keyed.url + "/tokenize", "POST", {"messages": ASK, "tools": TOOLS})
    status, _, chat = http(keyed.url + "/v1/chat/completions", "POST", {
        "messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1}, headers)
    assert status == 200
    counted = json.loads(with_tools)["count"]
    assert counted == json.loads(chat)["usage"]["prompt_tokens"]
    assert counted > json.loads(plain)["count"] + 40  # the tool's JSON schema is in the prompt
    status, _, body = http(keyed.url + "/tokenize", "POST", {"messages": ASK, "tools": 3})
    assert (status, json.loads(body)) == (400, error(400, "tools: must be a list of tools, got 3",
                                                     "invalid_request_error", "tools"))


def test_api_keys_from_the_flag_or_the_environment(monkeypatch):
    from tpengine.entrypoints.serve import api_keys

    monkeypatch.delenv("TPENGINE_API_KEY", raising=False)
    assert api_keys(None) == []
    monkeypatch.setenv("TPENGINE_API_KEY", "from-env")
    assert api_keys(None) == ["from-env"]
    assert api_keys(["a", "", "b"]) == ["a", "b"]  # the flag wins over the environment


def test_unknown_routes_wrong_methods_and_head(smollm2_server):
    url = smollm2_server.url
    status, _, body = http(url + "/v2/chat")
    assert (status, json.loads(body)) == (404, error(404, "Not Found: no route GET /v2/chat", "not_found_error"))
    status, headers, body = http(url + "/v1/chat/completions")
    assert (status, headers["allow"], json.loads(body)) == (405, "POST", error(
        405, "Method Not Allowed: GET /v1/chat/completions (this route takes POST)", "invalid_request_error"))
    status, headers, body = http(url + "/health", "HEAD")
    assert (status, body) == (200, b"")
    with pytest.raises(openai.NotFoundError) as e:
        smollm2_server.client.get("/no-such-route", cast_to=object)
    assert e.value.body["message"] == "Not Found: no route GET /v1/no-such-route"


def test_x_request_id_is_echoed_or_generated_and_is_the_responses_id(smollm2_server):
    url = smollm2_server.url
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, "temperature": 0.0}
    status, headers, out = http(url + "/v1/chat/completions", "POST", body, {"x-request-id": "trace-7f3a"})
    assert (status, headers["x-request-id"], json.loads(out)["id"]) == (200, "trace-7f3a", "chatcmpl-trace-7f3a")
    status, headers, out = http(url + "/v1/chat/completions", "POST", body)
    assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"])
    assert json.loads(out)["id"] == "chatcmpl-" + headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", http(url + "/health")[1]["x-request-id"])
    stream = smollm2_server.client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True,
                                                      extra_headers={"x-request-id": "s-1"})
    assert {chunk.id for chunk in stream} == {"cmpl-s-1"}


def test_a_running_request_id_is_refused(smollm2_server):
    s = smollm2_server
    first = s.client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=400, temperature=0.0,
                                             stream=True, extra_headers={"x-request-id": "dup-1"})
    next(iter(first))  # the role chunk: the request is in the engine
    with pytest.raises(openai.BadRequestError) as e:
        s.client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                         extra_headers={"x-request-id": "dup-1"})
    assert e.value.body["message"] == ("the request id 'chatcmpl-dup-1' (from the x-request-id header) is the id "
                                       "of a request still running; send a unique x-request-id")
    first.close()  # the disconnect aborts it
    deadline = time.monotonic() + 60
    while s.metrics()["tpengine:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert s.metrics()["tpengine:num_requests_running"] == 0


def test_continuous_usage_stats(smollm2_server):
    c = smollm2_server.client
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0.0, stream=True,
                                            stream_options=options, logprobs=True))
    final = chunks[-1].usage
    assert chunks[-1].choices == [] and final.completion_tokens == 6
    generated = 0
    for chunk in chunks[:-1]:
        generated += len(chunk.choices[0].logprobs.content) if chunk.choices[0].logprobs else 0
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.total_tokens) == (
            final.prompt_tokens, generated, final.prompt_tokens + generated)
    assert chunks[0].usage.completion_tokens == 0 and chunks[-2].usage.completion_tokens == 6
    # completions, two prompts: each choice's chunk counts its own prompt and tokens
    prompts = ["Once upon a time", "The capital of France is"]
    counts = [json.loads(http(smollm2_server.url + "/tokenize", "POST", {"prompt": p})[2])["count"] for p in prompts]
    seen: dict[int, int] = {}
    for chunk in c.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0.0, stream=True,
                                      logprobs=0, stream_options=options):
        if chunk.choices:
            i = chunk.choices[0].index
            seen[i] = seen.get(i, 0) + len(chunk.choices[0].logprobs.tokens)
            assert chunk.usage.completion_tokens == seen[i]
            assert chunk.usage.prompt_tokens == counts[i]
    assert seen == {0: 4, 1: 4}
    # without include_usage the option does nothing, as vLLM
    chunks = list(c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, stream=True,
                                            stream_options={"continuous_usage_stats": True}))
    assert all(chunk.usage is None for chunk in chunks)


def test_return_tokens_as_token_ids(smollm2_server):
    c = smollm2_server.client
    kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0, "logprobs": 2}
    plain = c.completions.create(**kw).choices[0].logprobs
    named = c.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    ids = [int(t.removeprefix("token_id:")) for t in named.tokens]
    assert all(t.startswith("token_id:") for t in named.tokens)
    texts = [json.loads(http(smollm2_server.url + "/detokenize", "POST", {"tokens": [i]})[2])["prompt"] for i in ids]
    assert texts == plain.tokens
    assert named.token_logprobs == plain.token_logprobs
    assert all(all(k.startswith("token_id:") for k in top) for top in named.top_logprobs)
    streamed = [t for chunk in c.completions.create(**kw, stream=True, extra_body={"return_tokens_as_token_ids": True})
                for t in (chunk.choices[0].logprobs.tokens if chunk.choices else [])]
    assert streamed == named.tokens
    chat = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0.0, logprobs=True,
                                     top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(re.fullmatch(r"token_id:\d+", t.token) for t in content)
    assert all(t.bytes == list(t.token.encode()) and len(t.top_logprobs) == 2 for t in content)


def _scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics without labels other than model_name: name -> value."""
    out = {}
    for line in urllib.request.urlopen(url + "/metrics", timeout=10).read().decode().splitlines():
        m = re.match(r'^(\w+:\w+)(\{model_name="[^"]*"\})? ([0-9.e+-]+)$', line)
        if m:
            out[m.group(1)] = float(m.group(3))
    return out


def test_vllms_remaining_metrics(smollm2_server):
    url, c = smollm2_server.url, smollm2_server.client
    before = _scrape(url)
    usages = [c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Count to {k}."}],
                                        max_tokens=5, temperature=0.0).usage for k in (3, 4)]
    after = _scrape(url)

    def moved(name: str) -> float:
        return after[f"tpengine:{name}"] - before.get(f"tpengine:{name}", 0.0)

    for phase in ("queue", "prefill", "decode", "inference"):
        assert moved(f"request_{phase}_time_seconds_count") == 2, phase
    assert moved("inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages) == 8
    assert moved("prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    assert moved("prefix_cache_hits_total") == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert moved("iteration_tokens_total_sum") == sum(u.prompt_tokens - u.prompt_tokens_details.cached_tokens
                                                      + u.completion_tokens - 1 for u in usages)
    assert moved("num_preemptions_total") == 0
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    info = re.search(r"^tpengine:cache_config_info\{(.*)\} 1\.0$", text, re.M)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
    assert {k: labels[k] for k in ("block_size", "cache_dtype", "enable_prefix_caching", "engine")} == {
        "block_size": "16", "cache_dtype": "float32", "enable_prefix_caching": "True", "engine": "0"}
    assert int(labels["num_gpu_blocks"]) > 0


def test_metrics_prefix_vllm():
    from tpengine.engine.stats import EngineStats
    from tpengine.server.metrics import ServerMetrics

    m = ServerMetrics("tiny", "vllm")
    m.observe_step(EngineStats(1, 1, 0, 10, 1, 2, 6, 8, 1, 0, cached_prompt_tokens=4, computed_tokens=7), [])
    text = m.render().decode()
    assert 'vllm:num_preemptions_total{model_name="tiny"} 2.0' in text
    assert 'vllm:prefix_cache_hits_total{model_name="tiny"} 4.0' in text
    assert 'vllm:iteration_tokens_total_sum{model_name="tiny"} 7.0' in text
    assert "tpengine:" not in text
    with pytest.raises(ValueError, match="metrics prefix must be one of tpengine, vllm, got 'sglang'"):
        ServerMetrics("tiny", "sglang")


def test_a_batch_line_refuses_return_tokens_as_token_ids():
    from pydantic import ValidationError

    from tpengine.protocol.requests import BatchRequestLine

    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "Hi", "logprobs": 1, "return_tokens_as_token_ids": True}}
    with pytest.raises(ValidationError, match="is served by tpengine serve only, not in a batch job; use false or "
                                              "omit it"):
        BatchRequestLine.model_validate(line)


def test_framework_validation_errors_are_openai_errors():
    import asyncio
    from types import SimpleNamespace

    from fastapi.exceptions import RequestValidationError

    from tpengine.server.middleware import _validation_error

    exc = RequestValidationError([{"loc": ("path", "n"), "msg": "Input should be a valid integer", "type": "int"}])
    resp = asyncio.run(_validation_error(SimpleNamespace(), exc))
    assert (resp.status_code, json.loads(resp.body)) == (400, error(
        400, "path.n: Input should be a valid integer", "invalid_request_error", "n"))
