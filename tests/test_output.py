"""Output records, the append+flush writer, --resume's done ids, and the progress summary."""

from __future__ import annotations

import io
import json

import pytest

from tpengine.engine.outputs import CompletionOutput, EngineOutput
from tpengine.frontend.output import error_record, make_record, openai_error_record, simple_record
from tpengine.frontend.progress import ProgressReporter, percentile
from tpengine.frontend.requests import parse_lines
from tpengine.frontend.writer import OutputWriter, read_done


def ok_out(rid="a", n=3):
    return EngineOutput(rid, [1, 2], [CompletionOutput(0, "hé!", list(range(10, 10 + n)), "length")],
                         ttft_s=0.1234567, latency_s=0.5, num_cached_tokens=1)


def test_simple_record_shape():
    rec = simple_record(ok_out())
    assert rec == {
        "id": "a", "text": "hé!", "token_ids": [10, 11, 12], "finish_reason": "length",
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 1}},
        "metrics": {"ttft_s": 0.123457, "latency_s": 0.5},
    }


def test_error_records():
    out = EngineOutput("b", [1] * 200, error="prompt has 200 tokens, max_model_len is 128",
                        error_field="prompt")
    assert simple_record(out) == {"id": "b", "error": {"message": out.error, "field": "prompt"}}
    assert error_record("c", "bad", None) == {"id": "c", "error": {"message": "bad"}}
    assert error_record("d", "bad", "max_tokens", line=5) == {
        "id": "d", "error": {"message": "bad", "field": "max_tokens", "line": 5}}
    assert openai_error_record("cid", 4, "bad", "body.max_tokens") == {
        "id": "batch_req_4", "custom_id": "cid", "response": None,
        "error": {"code": "invalid_request", "message": "bad", "param": "body.max_tokens", "line": 4}}


def test_openai_batch_records():
    (chat, comp, simple), errs = parse_lines([
        json.dumps({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]}}),
        json.dumps({"custom_id": "c2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}}),
        json.dumps({"id": "s", "prompt": "x"}),
    ])
    assert errs == []
    rec = make_record(chat, ok_out("c1"), model="smollm2")
    assert rec["id"] == "batch_req_1" and rec["custom_id"] == "c1" and rec["error"] is None
    resp = rec["response"]
    assert resp["status_code"] == 200 and resp["request_id"] == "req_1"
    body = resp["body"]
    assert body["object"] == "chat.completion" and body["model"] == "smollm2"  # the served model, not "gpt-x"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hé!"},
                                "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    assert isinstance(body["created"], int)
    body = make_record(comp, ok_out("c2"), model="smollm2")["response"]["body"]
    assert body["object"] == "text_completion" and body["model"] == "smollm2"
    assert body["choices"][0]["text"] == "hé!" and body["choices"][0]["finish_reason"] == "length"
    assert make_record(simple, ok_out("s"), model="m")["id"] == "s"
    err = make_record(chat, EngineOutput("c1", [1], error="too long", error_field="messages"), "m")
    assert err["response"] is None and err["error"]["message"] == "too long"
    assert err["error"]["param"] == "messages" and err["custom_id"] == "c1"


def test_writer_appends_and_flushes(tmp_path):
    p = tmp_path / "out.jsonl"
    w = OutputWriter(p)
    w.write(simple_record(ok_out("a")))
    # flushed: visible to another reader before close
    assert [json.loads(x)["id"] for x in p.read_text().splitlines()] == ["a"]
    w.write(error_record("b", "bad"))
    assert len(p.read_text(encoding="utf-8").splitlines()) == 2 and "hé!" in p.read_text(encoding="utf-8")
    w.close()
    with OutputWriter(p, append=True) as w2:
        w2.write(error_record("c", "bad"))
    assert read_done(p)[0] == {"a", "b", "c"}
    OutputWriter(p).close()  # not appending: truncates
    assert p.read_text() == ""


def test_writer_stdout(capsys):
    w = OutputWriter(None)
    w.write({"id": "x", "text": "ü"})
    w.close()
    assert json.loads(capsys.readouterr().out) == {"id": "x", "text": "ü"}


def test_read_done_ids_truncated_last_line(tmp_path):
    p = tmp_path / "out.jsonl"
    good = [simple_record(ok_out("a")), error_record("b", "bad"),
            openai_error_record("cid", 3, "bad", code="request_failed")]
    text = "".join(json.dumps(r) + "\n" for r in good)
    p.write_text(text + '{"id": "d", "text": "cut by a cra')
    assert read_done(p)[0] == {"a", "b", "cid"}
    assert p.read_text() == text  # the torn line is gone; appends start on a clean line
    with OutputWriter(p, append=True) as w:
        w.write(error_record("d", "x"))
    assert read_done(p)[0] == {"a", "b", "cid", "d"}
    assert read_done(tmp_path / "missing.jsonl")[0] == set()


def test_read_done_ids_no_repair_and_junk(tmp_path):
    p = tmp_path / "out.jsonl"
    p.write_text('{"id": "a"}\nnot json\n[1]\n{"id": "b"')
    assert read_done(p, repair=False)[0] == {"a"}
    assert p.read_text().endswith('{"id": "b"')


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0], 90) == 3.0
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([0, 10], 90) == pytest.approx(9.0)


def test_progress_plain_lines_and_summary():
    buf = io.StringIO()
    pr = ProgressReporter(total=3, stream=buf, interval_s=0.0)
    pr.on_step({"num_running": 2, "num_waiting": 1})
    pr.on_output(EngineOutput("a", [1, 2], [CompletionOutput(token_ids=[5, 6, 7])], ttft_s=0.1, latency_s=0.5))
    pr.on_output(EngineOutput("b", [1], [CompletionOutput(token_ids=[5])], ttft_s=0.2, latency_s=0.2))
    pr.add_errors(1)
    assert "running 2, waiting 1" in buf.getvalue() and "[tpengine] 3/3 requests" in buf.getvalue()
    s = pr.print_summary()
    assert (s["requests_ok"], s["requests_error"], s["prompt_tokens"], s["output_tokens"]) == (2, 1, 3, 4)
    assert s["ttft_p50_s"] == pytest.approx(0.15)
    assert s["tpot_p50_s"] == pytest.approx(0.2)  # (0.5 - 0.1) / 2; 1-token request excluded
    out = buf.getvalue()
    assert "tpengine run summary" in out and "2 ok, 1 errors" in out and "TPOT p50 / p90" in out


def test_progress_rich_bar_runs():
    buf = io.StringIO()
    pr = ProgressReporter(total=1, stream=buf, live=True)
    pr.on_step(type("S", (), {"num_running": 1, "num_waiting": 0})())
    pr.on_output(EngineOutput("a", [1], [CompletionOutput(token_ids=[2, 3])], ttft_s=0.1, latency_s=0.2))
    pr.close()
    pr.close()
    assert "1/1" in buf.getvalue()


def test_invalid_line_records_are_not_done_ids(tmp_path):
    """A rejected duplicate line must not make --resume skip the valid request with that id."""
    p = tmp_path / "out.jsonl"
    with OutputWriter(p) as w:
        w.write(error_record("a", "duplicate id 'a' (first on line 1)", "id", line=3))
        w.write(openai_error_record("c", 4, "bad", "body.n"))
        w.write(error_record("t", "prompt too long"))  # failed at run time: done
        w.write(make_record(None, ok_out("z"), "m"))
    assert read_done(p) == ({"t", "z"}, {3, 4})


def test_position_logprobs_read_as_vllms_dict_of_token_id_to_logprob():
    from tpengine.engine.outputs import Logprob, PositionLogprobs

    pos = PositionLogprobs(Logprob(9, -3.0, 4, "z"), [Logprob(5, -0.1, 1, "a"), Logprob(7, -2.0, 2, "b")])
    assert list(pos) == [9, 5, 7] and len(pos) == 3 and 7 in pos and 8 not in pos
    assert pos[9].logprob == -3.0 and pos[5].decoded_token == "a" and pos[7].rank == 2
    same = PositionLogprobs(Logprob(5, -0.1, 1, "a"), [Logprob(5, -0.1, 1, "a")])
    assert dict(same) == {5: Logprob(5, -0.1, 1, "a")}  # the chosen token among the top: once


def test_echo_and_several_prompts_in_one_completions_body():
    """``echo``: the prompt's text first and its tokens' logprobs (first null, top trimmed to the
    request's k) before the completion's, offsets over the whole text; several prompts: choice
    index = prompt * n + sample, usage summed."""
    from tpengine.engine.outputs import Logprob, PositionLogprobs
    from tpengine.frontend.output import completion_body
    from tpengine.frontend.requests import EchoPrompt

    def pos(tid, text, lp, top):
        return PositionLogprobs(Logprob(tid, lp, 2, text), [Logprob(t, x, r + 1, s) for r, (t, s, x) in enumerate(top)])

    prompt_lp = [None, pos(8, " b", -1.5, [(9, " c", -0.5), (8, " b", -1.5)])]
    gen = [pos(9, " c", -0.5, [(9, " c", -0.5), (8, " b", -1.5)])]
    a = EngineOutput("a", [7, 8], [CompletionOutput(i, " c", [9], "length", gen) for i in range(2)],
                     prompt_logprobs=prompt_lp)
    b = EngineOutput("b", [7], [CompletionOutput(i, "", [], "length", []) for i in range(2)], num_cached_tokens=1)
    echo_a, echo_b = EchoPrompt("a b", ["a", " b"], 1), EchoPrompt("a", ["a"], 1)
    body = completion_body([a, b], [echo_a, echo_b], "m", "x", created=5, n=2).model_dump()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "a b c"), (1, "a b c"), (2, "a"), (3, "a")]
    assert body["choices"][0]["logprobs"] == {"text_offset": [0, 1, 3], "token_logprobs": [None, -1.5, -0.5],
                                              "tokens": ["a", " b", " c"],
                                              "top_logprobs": [None, {" c": -0.5, " b": -1.5},
                                                               {" c": -0.5, " b": -1.5}]}
    assert body["choices"][2]["logprobs"] == {"text_offset": [0], "token_logprobs": [None], "tokens": ["a"],
                                              "top_logprobs": [None]}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    bos = completion_body([a], [EchoPrompt("b", ["<s>", " b"], 1)], "m", "x", created=5).model_dump()["choices"][0]
    assert bos["logprobs"]["text_offset"] == [0, 3, 5]  # one running sum of token texts, as vLLM (a BOS included)
    assert bos["text"] == "b c"
    plain = completion_body([a], [None], "m", "x", created=5).model_dump()["choices"][0]
    assert plain["text"] == " c" and plain["logprobs"]["tokens"] == [" c"] and plain["logprobs"]["text_offset"] == [0]
