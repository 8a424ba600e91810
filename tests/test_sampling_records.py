"""Records of requests that asked for logprobs, prompt_logprobs or n > 1, built from hand-made
engine outputs: the simple record, OpenAI's completions and chat bodies (batch lines), and the
server's streamed chunks."""

from __future__ import annotations

import asyncio
import json

from tpengine.engine.outputs import CompletionOutput, EngineOutput, Logprob, PositionLogprobs
from tpengine.frontend.output import openai_body, simple_record
from tpengine.sampling_params import SamplingParams
from tpengine.server.serving import Prepared, stream_events


def pos(tid, tok, lp, *top):
    return PositionLogprobs(Logprob(tid, lp, 1 if top and top[0][0] == tid else 2, tok),
                            [Logprob(t, x, r + 1, s) for r, (t, s, x) in enumerate(top)])


LPS = [pos(5, "Hi", -0.5, (5, "Hi", -0.5), (6, "Yo", -1.5)),
       pos(7, "é", float("-inf"), (8, "!", -0.1), (9, " ", -2.0))]
PROMPT_LPS = [None, pos(3, "a", -4.0, (4, "b", -1.0))]


def out_of(*samples, prompt_logprobs=None, finished=True):
    return EngineOutput("r", [1, 3], list(samples), prompt_logprobs=prompt_logprobs, num_cached_tokens=0,
                         ttft_s=0.5, latency_s=1.0, finished=finished)


def test_simple_record_with_logprobs_and_prompt_logprobs():
    rec = simple_record(out_of(CompletionOutput(0, "Hié", [5, 7], "length", LPS, -0.5), prompt_logprobs=PROMPT_LPS))
    assert rec == {
        "id": "r", "text": "Hié", "token_ids": [5, 7], "finish_reason": "length",
        "logprobs": [
            {"token_id": 5, "token": "Hi", "logprob": -0.5,
             "top_logprobs": [{"token_id": 5, "token": "Hi", "logprob": -0.5},
                              {"token_id": 6, "token": "Yo", "logprob": -1.5}]},
            {"token_id": 7, "token": "é", "logprob": -9999.0,
             "top_logprobs": [{"token_id": 8, "token": "!", "logprob": -0.1},
                              {"token_id": 9, "token": " ", "logprob": -2.0}]}],
        "prompt_logprobs": [None, {"token_id": 3, "token": "a", "logprob": -4.0,
                                   "top_logprobs": [{"token_id": 4, "token": "b", "logprob": -1.0}]}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}},
        "metrics": {"ttft_s": 0.5, "latency_s": 1.0}}
    json.dumps(rec, allow_nan=False)  # no infinity in the record


def test_simple_record_with_n_samples():
    rec = simple_record(out_of(CompletionOutput(0, "a", [5], "length"), CompletionOutput(1, "bc", [6, 7], "stop")))
    assert rec == {
        "id": "r",
        "outputs": [{"index": 0, "text": "a", "token_ids": [5], "finish_reason": "length"},
                    {"index": 1, "text": "bc", "token_ids": [6, 7], "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}},
        "metrics": {"ttft_s": 0.5, "latency_s": 1.0}}
    rec = simple_record(out_of(CompletionOutput(0, "Hié", [5, 7], "length", LPS), CompletionOutput(1, "", [], "stop",
                                                                                                   []),
                               prompt_logprobs=PROMPT_LPS))
    assert [o["logprobs"] for o in rec["outputs"]][1] == [] and rec["outputs"][0]["logprobs"][1]["token_id"] == 7
    assert rec["prompt_logprobs"][0] is None and list(rec) == ["id", "outputs", "prompt_logprobs", "usage", "metrics"]


def test_completions_body_logprobs_n_and_prompt_logprobs():
    out = out_of(CompletionOutput(0, "Hié", [5, 7], "length", LPS), CompletionOutput(1, "x", [9], "stop", [
        pos(9, "x", -0.25)]), prompt_logprobs=PROMPT_LPS)
    body = openai_body(out, False, "m", "1", created=7).model_dump()
    c0, c1 = body["choices"]
    assert c0 == {"index": 0, "text": "Hié", "finish_reason": "length",
                  "logprobs": {"text_offset": [0, 2], "token_logprobs": [-0.5, -9999.0], "tokens": ["Hi", "é"],
                               "top_logprobs": [{"Hi": -0.5, "Yo": -1.5}, {"!": -0.1, " ": -2.0, "é": -9999.0}]},
                  "prompt_logprobs": [None, {3: {"logprob": -4.0, "rank": 2, "decoded_token": "a"},
                                             4: {"logprob": -1.0, "rank": 1, "decoded_token": "b"}}]}
    assert c1["index"] == 1 and c1["logprobs"] == {"text_offset": [0], "token_logprobs": [-0.25], "tokens": ["x"],
                                                   "top_logprobs": [{"x": -0.25}]}
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["total_tokens"] == 5
    assert json.loads(json.dumps(body))["choices"][0]["prompt_logprobs"][1]["3"]["rank"] == 2  # JSON keys: str


def test_chat_body_logprobs_and_prompt_logprobs():
    out = out_of(CompletionOutput(0, "Hié", [5, 7], "length", LPS), prompt_logprobs=PROMPT_LPS)
    body = openai_body(out, True, "m", "1", created=7).model_dump()
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hié"},
                                "finish_reason": "length",
                                "logprobs": {"content": [
                                    {"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                                     "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                                                      {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]}]},
                                    {"token": "é", "logprob": -9999.0, "bytes": [195, 169],
                                     "top_logprobs": [{"token": "!", "logprob": -0.1, "bytes": [33]},
                                                      {"token": " ", "logprob": -2.0, "bytes": [32]}]}]}}]
    assert body["prompt_logprobs"] == [None, {3: {"logprob": -4.0, "rank": 2, "decoded_token": "a"},
                                              4: {"logprob": -1.0, "rank": 1, "decoded_token": "b"}}]
    plain = openai_body(out_of(CompletionOutput(0, "a", [5], "stop")), True, "m", "1", created=7).model_dump()
    assert "prompt_logprobs" not in plain and plain["choices"][0]["logprobs"] is None


def events(chat, outs, n=1, include_usage=True):
    p = Prepared("r", chat, [[1, 3]], SamplingParams(n=n, logprobs=1), True, include_usage, 7, [None])

    async def gen():
        for o in outs:
            yield o

    async def collect():
        return [e async for e in stream_events(p, gen(), "m")]

    evs = asyncio.run(collect())
    assert evs[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in evs[:-1]]


def test_stream_chunks_carry_index_and_their_tokens_logprobs():
    partial = out_of(CompletionOutput(0, "Hi", [5], None, LPS[:1]), CompletionOutput(1, "", [], None, []),
                     finished=False)
    final = out_of(CompletionOutput(0, "Hié", [5, 7], "length", LPS), CompletionOutput(1, "x", [9], "stop",
                                                                                        [pos(9, "x", -0.25)]))
    chunks = events(False, [partial, final], n=2)
    choices = [c["choices"] for c in chunks]
    assert choices[:-1] == [
        [{"index": 0, "text": "Hi", "finish_reason": None, "logprobs": {
            "text_offset": [0], "token_logprobs": [-0.5], "tokens": ["Hi"],
            "top_logprobs": [{"Hi": -0.5, "Yo": -1.5}]}}],
        [{"index": 0, "text": "é", "finish_reason": "length", "logprobs": {
            "text_offset": [2], "token_logprobs": [-9999.0], "tokens": ["é"],
            "top_logprobs": [{"!": -0.1, " ": -2.0, "é": -9999.0}]}}],
        [{"index": 1, "text": "x", "finish_reason": "stop", "logprobs": {
            "text_offset": [0], "token_logprobs": [-0.25], "tokens": ["x"], "top_logprobs": [{"x": -0.25}]}}]]
    assert choices[-1] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_chat_stream_role_chunk_per_sample_and_logprobs():
    final = out_of(CompletionOutput(0, "Hi", [5], "stop", LPS[:1]), CompletionOutput(1, "", [], "length", []))
    chunks = events(True, [final], n=2, include_usage=False)
    assert [c["choices"][0]["index"] for c in chunks] == [0, 1, 0, 1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[2]["choices"][0] == {
        "index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop",
        "logprobs": {"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": [
            {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
            {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]}]}]}}
    assert chunks[3]["choices"][0] == {"index": 1, "delta": {"content": ""}, "finish_reason": "length",
                                       "logprobs": {"content": []}}
