"""The OpenAI-compatible server on real ranks (tp=2, SmolLM2 in float32, 127.0.0.1), driven by the
official ``openai`` client: stream and non-stream texts equal the batch job's; 32 concurrent
streaming clients; multi-byte text streamed exactly; a disconnect frees blocks; bad requests are
400s naming the field; SIGTERM stops every rank cleanly."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import SMOLLM2_DIR
from launch import cli
from serving import SETTINGS, Server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(not (SMOLLM2_DIR / "config.json").is_file(), reason="needs make model")

GREEDY = {"temperature": 0.0, "max_tokens": 24}
COMPLETIONS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
CHATS = ["What is 2 + 2?", "Name three colors.", "Say hello in French."]
MULTIBYTE = "Écris « café crème » et 日本語 puis l'emoji 😀 trois fois :"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def server(smollm2_server):
    """The session's tp=2 SmolLM2 server (conftest), shared with test_server_clients.py."""
    return smollm2_server


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """The batch job's texts for the same requests (OpenAI Batch lines, tp=2)."""
    tmp = tmp_path_factory.mktemp("batch")
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": p, **GREEDY}}
             for i, p in enumerate(COMPLETIONS)]
    lines += [{"custom_id": f"m{i}", "method": "POST", "url": "/v1/chat/completions",
               "body": {"messages": [{"role": "user", "content": p}], **GREEDY}}
              for i, p in enumerate([*CHATS, MULTIBYTE])]
    prompts, out = tmp / "in.jsonl", tmp / "out.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cli(["--prompts", prompts, "--out", out, *SETTINGS], tp=2)
    recs = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in map(json.loads, out.read_text().splitlines())}
    return ({p: recs[f"c{i}"]["text"] for i, p in enumerate(COMPLETIONS)},
            {p: recs[f"m{i}"]["message"]["content"] for i, p in enumerate([*CHATS, MULTIBYTE])})


def chat_stream(client, content: str, **kw) -> tuple[list[str], str | None]:
    deltas, finish = [], None
    for chunk in client.chat.completions.create(model="smollm2-135m-instruct", stream=True,
                                                messages=[{"role": "user", "content": content}], **GREEDY, **kw):
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return deltas, finish


def test_texts_equal_the_batch_jobs(server, batch):
    completions, chats = batch
    c = server.client
    for p in COMPLETIONS:
        r = c.completions.create(model="smollm2-135m-instruct", prompt=p, **GREEDY)
        assert r.choices[0].text == completions[p] and r.model == "smollm2-135m-instruct"
        assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
        streamed = "".join(x.choices[0].text for x in c.completions.create(
            model="smollm2-135m-instruct", prompt=p, stream=True, **GREEDY) if x.choices)
        assert streamed == completions[p]
    for p in CHATS:
        r = c.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": p}],
                                      **GREEDY)
        assert r.choices[0].message.content == chats[p]
        assert "".join(chat_stream(c, p)[0]) == chats[p]


def test_multibyte_text_streams_exactly(server, batch):
    """Each delta holds whole characters only: a character whose bytes span tokens is sent once it is
    complete, never as U+FFFD (only the last delta may end in one, when max_tokens cuts a character,
    exactly as ``tokenizer.decode`` of the same ids does), and nothing is sent twice."""
    deltas, finish = chat_stream(server.client, MULTIBYTE)
    text = "".join(deltas)
    assert text == batch[1][MULTIBYTE] and finish == "length"
    assert "\ufffd" not in "".join(deltas[:-1]) and sum(ord(ch) > 0x7F for ch in text) >= 5, deltas


def test_32_concurrent_streaming_clients(server, batch):
    completions, chats = batch
    prompts = [CHATS[i % len(CHATS)] for i in range(32)]
    results: dict[int, str] = {}
    errors = []

    def one(i):
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
            results[i] = "".join(chat_stream(client, prompts[i])[0])
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == [] and len(results) == 32
    assert all(results[i] == chats[prompts[i]] for i in range(32))


def test_disconnect_frees_blocks(server):
    stream = server.client.completions.create(model="smollm2-135m-instruct", prompt="Count: 1, 2, 3,", stream=True,
                                              max_tokens=900, temperature=0.0, extra_body={"ignore_eos": True})
    for n, _ in enumerate(stream):
        if n == 3:
            break
    m = server.metrics()
    assert m["tpengine:num_requests_running"] == 1 and m["tpengine:kv_cache_usage_perc"] > 0
    stream.close()  # the client goes away
    deadline = time.monotonic() + 60  # a bound, not an expectation: a loaded machine steps slowly
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["tpengine:num_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert m["tpengine:num_requests_running"] == 0 and m["tpengine:kv_cache_usage_perc"] == 0.0, m


@pytest.mark.parametrize(("body", "status", "param", "message"), [
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens",
     "max_tokens: must be an integer >= 0 (0: score the prompt only), got -1"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature", "temperature: must be a number >= 0, got \"hot\""),
    ({"prompt": "x", "bogus": 1, "echo": 1}, 400, "echo", "echo: must be true or false, got 1"),  # bogus: ignored
    ({"prompt": "apple" + " apple" * 999, "max_tokens": 100}, 400, "max_tokens", "this model's maximum context "
     "length (max_model_len) is 1024 tokens, but the request asks for 1100: 1000 in the prompt and 100 in the "
     "completion (max_tokens); ask for at most 24 tokens, or shorten the prompt"),
    ({"prompt": "apple" + " apple" * 1099}, 400, "prompt", "the prompt has 1100 tokens, but max_model_len is 1024 "
     "(the prompt must be at most 1023 tokens to leave room for one output token)"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs",
     "prompt_logprobs are not available when stream is true; ask without streaming"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model", "The model `gpt-4` does not exist; this server serves "
     "`smollm2-135m-instruct`"),
])
def test_bad_requests(server, body, status, param, message):
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == status and err["code"] == status and err["param"] == param
    assert err["message"].startswith(message) if message.endswith(" ") else err["message"] == message
    with pytest.raises(openai.BadRequestError if status == 400 else openai.NotFoundError) as e:
        server.client.completions.create(model=body.get("model", "smollm2-135m-instruct"), prompt=body["prompt"],
                                         extra_body={k: v for k, v in body.items() if k not in ("model", "prompt")})
    assert e.value.body["param"] == param


def test_a_request_that_fails_while_running_is_its_own_error(server, batch):
    """A temperature so small that sampling overflows fails in the engine: that request is a 500
    (non-streamed) or an error event (streamed); the server goes on answering the others."""
    body = {"model": "smollm2-135m-instruct", "prompt": "x", "max_tokens": 4, "temperature": 1e-40}
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    message = "sampling failed: RuntimeError: probability tensor contains either `inf`, `nan` or element < 0"
    assert e.value.code == 500 and json.loads(e.value.read())["error"]["message"] == message
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events = [line.decode() for line in urllib.request.urlopen(req, timeout=30) if line.startswith(b"data: ")]
    assert [json.loads(x[6:])["error"]["message"] for x in events if '"error"' in x] == [message]
    assert events[-1] == "data: [DONE]\n"
    p = COMPLETIONS[0]
    assert server.client.completions.create(model="smollm2-135m-instruct", prompt=p, **GREEDY).choices[0].text \
        == batch[0][p]


def test_sigterm_stops_every_rank_cleanly(tmp_path):
    """Idle for longer than dist_timeout_s, no rank times out or spins (the IDLE heartbeat). Then
    SIGTERM to rank 0 (as a process manager stops a server): a short request in flight finishes, a
    long one is aborted when the drain timeout passes (its stream still ends properly), every rank
    exits 0 within 10 s."""
    # dist_timeout_s 10: 4 let a rank time out before the first step on a loaded machine (its peer slow to start)
    s = Server(tmp_path, extra=("--drain-timeout-s", "3", "--dist-timeout-s", "10"))
    pids = s.rank_pids()
    before = {r: cpu_seconds(pid) for r, pid in pids.items()}
    time.sleep(12)  # > dist_timeout_s without a request (the idle wait itself is what is tested)
    used = {r: cpu_seconds(pid) - before[r] for r, pid in pids.items()}
    assert s.proc.poll() is None and all(u < 0.5 for u in used.values()), used  # blocked, not spinning

    def stream(max_tokens):
        return s.client.completions.create(model="smollm2-135m-instruct", prompt="Count: 1, 2, 3,", stream=True,
                                           max_tokens=max_tokens, temperature=0.0, extra_body={"ignore_eos": True})

    short, long = stream(8), stream(900)
    next(iter(short)), next(iter(long))
    ranks = s.rank_pids()
    assert set(ranks) == {0, 1}
    t0 = time.monotonic()
    os.kill(ranks[0], signal.SIGTERM)
    finish = {}
    for name, st in (("short", short), ("long", long)):
        for chunk in st:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish[name] = chunk.choices[0].finish_reason
    assert finish == {"short": "length", "long": "abort"}
    assert s.proc.wait(15) == 0 and time.monotonic() - t0 < 10
    log = s.log.read_text()
    assert "[tpengine rank 0/2] server stopped (exit 0)" in log and "[tpengine rank 1/2] server stopped (exit 0)" in log


def test_crashed_rank_is_a_503_and_every_rank_exits_non_zero(tmp_path):
    s = Server(tmp_path)
    body = {"model": "smollm2-135m-instruct", "prompt": "Count: 1, 2, 3,", "max_tokens": 900, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(s.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=60)
    for _ in range(6):  # a few events of the stream in flight
        resp.readline()
    os.kill(s.rank_pids()[1], signal.SIGKILL)
    events = [line.decode() for line in resp if line.startswith(b"data: ")]
    errors = [json.loads(e[6:])["error"] for e in events if '"error"' in e]
    assert events[-1] == "data: [DONE]\n" and [e["code"] for e in errors] == [503], events[-3:]
    assert errors[0]["message"].startswith("the engine failed: RuntimeError: ")
    assert s.proc.wait(30) != 0
    assert "[tpengine rank 0/2] server stopped (exit 1)" in s.log.read_text()


@pytest.mark.parametrize(("data", "message"), [
    (b"[" * 100_000 + b"]" * 100_000, "the request body is not valid JSON: nested too deeply"),
    (b"not json", "the request body is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    (b"[1, 2]", "the request body must be a JSON object"),
])
def test_bodies_that_are_not_a_json_object(server, data, message):
    req = urllib.request.Request(server.url + "/v1/completions", data=data,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["message"] == message


def test_n_samples_and_logprobs_stream_as_they_are_returned(server):
    """n=3 seeded samples with top-2 logprobs: the streamed deltas of each index join into that
    choice's text and logprobs of the non-streamed response, sample k is the single request seeded
    7 + k, and the chat logprobs of a greedy answer are those of its own tokens."""
    c = server.client
    kw = {"model": "smollm2-135m-instruct", "max_tokens": 12, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    r = c.completions.create(prompt="Once upon a time", n=3, seed=7, logprobs=2, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 36
    for k, ch in enumerate(r.choices):
        single = c.completions.create(prompt="Once upon a time", seed=7 + k, logprobs=2, **kw).choices[0]
        assert (single.text, single.logprobs.tokens) == (ch.text, ch.logprobs.tokens)
        assert len(ch.logprobs.token_logprobs) == 12 and all(lp <= 0 for lp in ch.logprobs.token_logprobs)
        assert all(len(top) in (2, 3) for top in ch.logprobs.top_logprobs)
    texts, tokens = {0: "", 1: "", 2: ""}, {0: [], 1: [], 2: []}
    for chunk in c.completions.create(prompt="Once upon a time", n=3, seed=7, logprobs=2, stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            tokens[ch.index] += ch.logprobs.tokens if ch.logprobs else []
    assert [texts[k] for k in range(3)] == [ch.text for ch in r.choices]
    assert [tokens[k] for k in range(3)] == [ch.logprobs.tokens for ch in r.choices]
    chat = c.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    shown = content[:-1] if chat.choices[0].finish_reason == "stop" else content  # an EOS has no text
    assert "".join(t.token for t in shown) == chat.choices[0].message.content and len(content) <= 8
    assert all(t.top_logprobs[0].token == t.token and len(t.top_logprobs) == 3 for t in content)  # greedy: top 1
