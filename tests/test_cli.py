"""The main job end to end through the CLI (``python -m tpengine.run`` / ``torchrun``):
cases C09, C10, C12, C18, pre-load validation at tp=2, an empty request file, ``--resume``
after a kill, and the ids of ``--skip-invalid`` error records (with ``--resume``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import SMOLLM2_DIR
from launch import START_TIMEOUT, cli, command, popen

from tpengine.engine.outputs import CompletionOutput, EngineOutput


def write_jsonl(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def records(path):
    recs = [json.loads(x) for x in Path(path).read_text().splitlines()]
    by_id = {r["id"]: r for r in recs}
    assert len(by_id) == len(recs), "an id was written twice"
    return by_id


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SMOLLM2_DIR))


def text_of_tokens(tok, n):
    """A text that tokenizes to exactly ``n`` tokens."""
    text = "apple" + " apple" * (n - 1)
    assert len(tok(text).input_ids) == n
    return text


def test_c09_invalid_and_overlong_requests_at_tp2(tiny, tok, tmp_path):
    a = {"id": "a", "prompt": "short one", "max_tokens": 8, "temperature": 0}
    lines = [a,
             {"id": "b", "prompt": text_of_tokens(tok, 200), "max_tokens": 8},
             {"id": "c", "prompt": text_of_tokens(tok, 120), "max_tokens": 50, "temperature": 0},
             {"id": "d", "prompt": "", "max_tokens": 8},
             {"id": "e", "prompt": "x", "max_tokens": -1},
             {"id": "e0", "prompt": "x y", "max_tokens": 0, "prompt_logprobs": 1},
             {"id": "f", "prompt": "x", "max_tokens": 1, "temperature": 0},
             {**a, "id": "a2"}]
    out = tmp_path / "out.jsonl"
    common = ["--model", tiny, "--max-model-len", 128, "--kv-cache-gb", 0.01]
    prompts = write_jsonl(tmp_path / "in.jsonl", lines)
    cli(["--prompts", prompts, "--out", out, "--skip-invalid", *common], tp=2)
    r = records(out)
    assert set(r) == {"a", "b", "c", "d", "e", "e0", "f", "a2"}
    assert "200" in r["b"]["error"]["message"] and "128" in r["b"]["error"]["message"]
    assert r["c"]["finish_reason"] == "length"
    usage = r["c"]["usage"]
    assert 1 <= usage["completion_tokens"] and usage["prompt_tokens"] + usage["completion_tokens"] <= 128
    assert r["d"]["error"] == {"message": "prompt: must be non-empty", "field": "prompt", "line": 4}
    assert r["e"]["error"]["field"] == "max_tokens" and ">= 0" in r["e"]["error"]["message"]
    e0 = r["e0"]  # max_tokens 0: the prompt scored, nothing generated
    assert (e0["text"], e0["token_ids"], e0["finish_reason"], e0["usage"]["completion_tokens"]) == ("", [], "length", 0)
    assert e0["prompt_logprobs"][0] is None and len(e0["prompt_logprobs"]) == e0["usage"]["prompt_tokens"] >= 2
    assert r["f"]["usage"]["completion_tokens"] == 1 and r["f"]["finish_reason"] in ("length", "stop")
    assert r["a"]["token_ids"] == r["a2"]["token_ids"] and len(r["a"]["token_ids"]) == 8
    # "a" alone at tp=1 (exact mode) gives the same tokens
    solo = cli(["--prompts", write_jsonl(tmp_path / "a.jsonl", [a]), *common])
    assert json.loads(solo.stdout)["token_ids"] == r["a"]["token_ids"]


def test_invalid_file_exits_every_rank_before_loading(tiny, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": "x", "max_tokens": -1}])
    out = tmp_path / "out.jsonl"
    t0 = time.monotonic()
    p = cli(["--prompts", bad, "--out", out, "--model", tiny], tp=2, timeout=60, check=False)
    assert p.returncode != 0 and time.monotonic() - t0 < 60
    assert p.stderr.count("line 2 (id '1'): field 'max_tokens': must be an integer >= 0 (0: score the prompt only), "
                          "got -1") == 1
    assert not out.exists()


def test_empty_prompts_file_exits_0_without_loading_at_tp2(tmp_path):
    prompts = tmp_path / "empty.jsonl"
    prompts.write_bytes(b"\xef\xbb\xbf\n\n   \n")  # a BOM and blank lines: no requests
    no_weights = tmp_path / "no-weights"  # loading this model would fail
    no_weights.mkdir()
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "old"}\n')
    p = cli(["--prompts", prompts, "--out", out, "--model", no_weights], tp=2, timeout=60, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count(f"no requests in {prompts}: nothing to do") == 1  # rank 0 only
    assert out.read_bytes() == b"" and p.stdout == ""
    # --resume keeps what --out holds; without --out nothing is written to stdout
    out.write_text('{"id": "old"}\n')
    p = cli(["--prompts", prompts, "--out", out, "--model", no_weights, "--resume"], timeout=60)
    assert out.read_text() == '{"id": "old"}\n'
    p = cli(["--prompts", prompts, "--model", no_weights], timeout=60)
    assert p.stdout == "" and p.stderr.strip().splitlines()[-1] == f"no requests in {prompts}: nothing to do"


def test_c12b_generation_config_eos_list(tiny, tok, tmp_path):
    req = {"id": "n", "prompt": "hello world", "max_tokens": 8, "temperature": 0}
    first = json.loads(cli(["--prompts", write_jsonl(tmp_path / "1.jsonl", [req]), "--model", tiny]).stdout)
    g = first["token_ids"]
    assert len(g) == 8
    k = next(i for i in range(2, 8) if g[i] not in g[:i] and g[i] != tok.eos_token_id)
    model = tmp_path / "tiny-eos"
    shutil.copytree(tiny, model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [tok.eos_token_id, g[k]]
    (model / "generation_config.json").write_text(json.dumps(gen))
    lines = [req, {**req, "id": "i", "ignore_eos": True}]
    out = tmp_path / "out.jsonl"
    cli(["--prompts", write_jsonl(tmp_path / "2.jsonl", lines), "--model", model, "--out", out])
    r = records(out)
    assert r["n"]["finish_reason"] == "stop" and r["n"]["token_ids"] == g[: k + 1]
    assert r["n"]["text"] == tok.decode(g[:k], skip_special_tokens=True)  # B itself not shown
    assert r["i"]["finish_reason"] == "length" and r["i"]["token_ids"] == g


@pytest.mark.slow
def test_c10_c12a_c18_smollm2(tok, tmp_path):
    if not (SMOLLM2_DIR / "config.json").is_file():
        pytest.skip("needs models/smollm2-135m-instruct (make model)")
    cfg = ["--config", "configs/smollm2-135m.toml", "--kv-cache-gb", 0.1, "--max-model-len", 512]
    alpha = {"id": "alpha", "prompt": "Here is the English alphabet: ABC", "max_tokens": 40, "temperature": 0}
    ok_msgs = [{"role": "user", "content": "Are you ok?"}]
    lines = [alpha, {"id": "hi", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 64,
                     "temperature": 0}, {"id": "ok", "messages": ok_msgs, "max_tokens": 16, "temperature": 0}]
    out = tmp_path / "out.jsonl"
    cli(["--prompts", write_jsonl(tmp_path / "1.jsonl", lines), "--out", out, *cfg])
    r = records(out)
    # C12 (a): the chat answer ends on <|im_end|> before max_tokens, which is not shown
    assert r["hi"]["finish_reason"] == "stop" and r["hi"]["usage"]["completion_tokens"] < 64
    assert "<|im_end|>" not in r["hi"]["text"] and r["hi"]["text"]
    # C18: the engine's prompt is exactly apply_chat_template's ids
    ids = tok.apply_chat_template(ok_msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert r["ok"]["usage"]["prompt_tokens"] == len(ids)
    # C10: a stop string starting mid-token, first occurring at its offset -> cut exactly there
    T, g = r["alpha"]["text"], r["alpha"]["token_ids"]
    assert len(T) >= 20
    starts = {len(tok.decode(g[:i], skip_special_tokens=True)) for i in range(len(g) + 1)}
    off = next(o for o in range(5, len(T) - 4) if o not in starts and T.find(T[o:o + 4]) == o)
    S = T[off:off + 4]
    lines = [{**alpha, "id": "s1", "stop": [S]}, {**alpha, "id": "s2", "stop": [S], "stream": False}]
    out2 = tmp_path / "out2.jsonl"
    cli(["--prompts", write_jsonl(tmp_path / "2.jsonl", lines), "--out", out2, *cfg])
    for rec in records(out2).values():
        assert rec["text"] == T[:off] and rec["finish_reason"] == "stop", (S, rec)


@pytest.mark.slow
def test_resume_after_kill(tiny, tmp_path, measuring):
    # measuring: its jobs decode ~1000 single rows of the 49152-word head, whose default layout (oneDNN's
    # packed) runs one row about 2x slower than the C GEMV a measurement picks (docs/notes/test-suite.md)
    lines = [{"id": f"r{i}", "prompt": f"story number {i}", "max_tokens": 60, "temperature": 0}
             for i in range(8)]
    prompts = write_jsonl(tmp_path / "in.jsonl", lines)
    common = ["--prompts", prompts, "--model", tiny, "--max-num-seqs", 1, "--kv-cache-gb", 0.01]
    ref_out = tmp_path / "ref.jsonl"
    cli([*common, "--out", ref_out])
    ref = records(ref_out)
    out = tmp_path / "out.jsonl"
    proc = popen(command("tpengine.run", [*common, "--out", out]), stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not (out.exists() and out.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait()
    n_before = out.read_text().count("\n")
    assert 2 <= n_before < len(lines)
    with open(out, "a") as fh:
        fh.write('{"id": "r7", "text": "torn wri')  # a write cut by the crash
    cli([*common, "--out", out, "--resume"])
    r = records(out)
    assert set(r) == set(ref)
    for rid, rec in r.items():
        assert rec["token_ids"] == ref[rid]["token_ids"] and rec["text"] == ref[rid]["text"]


def test_summary_lists_peak_memory_of_every_rank_at_tp2(tiny, tmp_path):
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi", "max_tokens": 2, "temperature": 0}])
    p = cli(["--prompts", prompts, "--out", tmp_path / "out.jsonl", "--model", tiny, "--max-model-len", 64,
             "--kv-cache-gb", 0.01, "--kv-cache-dtype", "int8"], tp=2)
    m = re.search(r"peak memory per rank\W+0: (\d+\.\d\d) GiB, 1: (\d+\.\d\d) GiB\W", p.stderr)
    assert m, p.stderr[-3000:]
    assert all(0.05 < float(x) < 64 for x in m.groups())  # each rank holds torch + a model: > 50 MiB
    # an int8 cache: K and V of 2 layers, 1 KV head of 16 per rank, a byte each and a float32 scale per row
    assert re.search(r"KV cache \(rank 0\)\W+int8, 80 B/token, \d+ blocks", p.stderr), p.stderr[-3000:]


def test_peak_rss_functions():
    from tpengine.engine.memory import format_peak_rss, gather_peak_rss, peak_rss_bytes

    peak = peak_rss_bytes()
    assert 2**20 < peak < 2**40
    assert gather_peak_rss()[0] >= peak  # size 1: this process only, never lower than before
    assert len(gather_peak_rss()) == 1
    assert format_peak_rss([int(1.23 * 2**30), int(1.2 * 2**30)]) == "0: 1.23 GiB, 1: 1.20 GiB"


def test_resolve_model_dir(tmp_path):
    from tpengine.entrypoints.setup import resolve_model_dir

    base = tmp_path / "m"
    (tmp_path / "m-tp2").mkdir()
    (tmp_path / "m-tp2" / "manifest.json").write_text("{}")
    assert resolve_model_dir(str(base), 2) == str(tmp_path / "m-tp2")
    assert resolve_model_dir(str(base) + "/", 2) == str(tmp_path / "m-tp2")
    assert resolve_model_dir(str(base), 3) == str(base)


def test_sampling_defaults_precedence(tmp_path):
    from tpengine.entrypoints.setup import sampling_defaults
    from tpengine.errors import UserError

    cfg = tmp_path / "c.toml"
    cfg.write_text('[engine]\ndtype = "float32"\n[sampling]\ntemperature = 0.0\nmax_tokens = 256\n')
    assert sampling_defaults(cfg) == {"temperature": 0.0, "max_tokens": 256}
    assert sampling_defaults(cfg, max_tokens=5, temperature=None) == {"temperature": 0.0, "max_tokens": 5}
    assert sampling_defaults(None, temperature=0.5) == {"temperature": 0.5}
    with pytest.raises(UserError, match=r"max_tokens must be >= 0 \(0: score the prompt only\), got -1"):
        sampling_defaults(cfg, max_tokens=-1)
    cfg.write_text("[sampling]\ntemprature = 0.0\n")
    with pytest.raises(UserError, match=r"unknown \[sampling\] key\(s\) \['temprature'\]"):
        sampling_defaults(cfg)


class FakeEngine:
    """What ``drive`` uses of LLMEngine: a tokenizer (one id per character), ``generate``
    (answers each request with its first prompt id), its config and runner; ``crash_after``: raise after that many
    outputs, as a killed run would stop."""

    vocab_size = 1000

    def __init__(self, crash_after=None):
        from types import SimpleNamespace

        self.crash_after = crash_after
        # (the batch chat lines' reasoning split: none; the summary's KV cache line: its kind and size)
        self.config = SimpleNamespace(reasoning_parser=None, kv_cache_dtype="auto")
        self.runner = SimpleNamespace(num_blocks=8, kv_bytes_per_token=512)

    def tokenizer(self, text):
        return {"input_ids": [ord(c) for c in text]}

    def generate(self, batch, on_output, on_step):
        for n, (rid, ids, _params) in enumerate(batch):
            if n == self.crash_after:
                raise RuntimeError("killed")
            on_output(EngineOutput(rid, ids, [CompletionOutput(0, chr(ids[0]), ids[:1], "length")],
                                    ttft_s=0.25, latency_s=0.5))


def test_skip_invalid_error_records_never_share_an_id_and_resume(tmp_path):
    from tpengine.frontend.job import drive
    from tpengine.frontend.requests import parse_requests
    from tpengine.frontend.writer import OutputWriter, read_done

    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    with open(prompts, "a") as fh:
        fh.write('{"id": "a", "prompt": "z"}\n{not json\n{"id": "3", "prompt": "w"}\n')
    requests, errors = parse_requests(prompts, {"temperature": 0.0})
    assert [r.id for r in requests] == ["a", "b", "3"]
    out = tmp_path / "out.jsonl"
    with pytest.raises(RuntimeError, match="killed"):  # killed before any request finished
        drive(FakeEngine(crash_after=0), requests, errors, OutputWriter(out), (set(), set()), "m")
    invalid = [
        {"id": "a#line3", "error": {"message": "id: duplicate id 'a' (first on line 1)", "field": "id", "line": 3}},
        {"id": "3#line4", "error": {"message": "invalid JSON: Expecting property name enclosed in double quotes "
                                               "at column 2", "line": 4}},  # its default id "3" is line 5's
    ]
    assert [json.loads(x) for x in out.read_text().splitlines()] == invalid

    def ok(rid, ch):
        return {"id": rid, "text": ch, "token_ids": [ord(ch)], "finish_reason": "length",
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}},
                "metrics": {"ttft_s": 0.25, "latency_s": 0.5}}

    # --resume: the error record for line 3 does not count as request "a" done
    drive(FakeEngine(), requests, errors, OutputWriter(out, append=True), read_done(out), "m")
    final = [*invalid, ok("a", "x"), ok("b", "y"), ok("3", "w")]
    assert [json.loads(x) for x in out.read_text().splitlines()] == final
    assert records(out).keys() == {"a#line3", "3#line4", "a", "b", "3"}
    # all done: nothing added
    drive(FakeEngine(), requests, errors, OutputWriter(out, append=True), read_done(out), "m")
    assert [json.loads(x) for x in out.read_text().splitlines()] == final


def test_duplicate_custom_id_error_record():
    from tpengine.frontend.job import error_records as _error_records
    from tpengine.frontend.requests import parse_lines

    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    requests, errors = parse_lines([json.dumps(line), json.dumps(line), json.dumps({**line, "body": {}})])
    assert [r.id for r in requests] == ["c"]
    rec = _error_records(errors, {"c", "c#line2", "c#line2#2"})[0][1]  # a request may carry "c#line2" itself
    assert rec["custom_id"] == "c#line2#3"
    assert _error_records(errors, {"c"}) == [
        (2, {"id": "batch_req_2", "custom_id": "c#line2", "response": None,
             "error": {"code": "invalid_request", "message": "custom_id: duplicate id 'c' (first on line 1)",
                       "param": "custom_id", "line": 2}}),
        (3, {"id": "batch_req_3", "custom_id": "c#line3", "response": None,
             "error": {"code": "invalid_request", "message": "body.prompt: is required; custom_id: duplicate id "
                                                            "'c' (first on line 1)",
                       "param": "body.prompt", "line": 3}}),
    ]


def test_skip_invalid_with_every_line_invalid_writes_errors_without_loading_at_tp2(tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"id": "a", "prompt": ""}\n{not json\n{"id": "a", "prompt": "x", "max_tokens": -1}\n')
    no_weights = tmp_path / "no-weights"  # loading this model would fail
    no_weights.mkdir()
    out = tmp_path / "out.jsonl"
    p = cli(["--prompts", prompts, "--out", out, "--model", no_weights, "--skip-invalid"], tp=2, timeout=60,
            check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count(f"no valid requests in {prompts}: writing 3 error record(s), no model loaded") == 1
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in got] == ["a", "1", "a#line3"]  # a bad JSON line: its default id
    assert [r["error"]["line"] for r in got] == [1, 2, 3] and all("text" not in r for r in got)
    # --resume appends nothing new: those lines are still invalid and their records are there
    p = cli(["--prompts", prompts, "--out", out, "--model", no_weights, "--skip-invalid", "--resume"], timeout=60)
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["a", "1", "a#line3"]


