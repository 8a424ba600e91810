"""The whole job at tp=2: a file in which every kind of request that fails after validation sits
between normal ones exits 0 with one record per line, and the normal records equal a clean run's."""

from __future__ import annotations

import json

import pytest
from conftest import SMOLLM2_DIR, make_tiny_model
from launch import cli

GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
# Llama-2 / Mistral chat templates refuse two user turns in a row with exactly this call
ALTERNATE = ("{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
             "{% endif %}{% endfor %}")
TOKENIZER_TYPE_ERROR = ("TypeError: TextEncodeInput must be Union[TextInputSequence, "
                        "Tuple[InputSequence, InputSequence]]")
NORMAL = [
    {"id": "n1", "prompt": "Hello there", **GREEDY},
    {"id": "n2", "messages": [{"role": "user", "content": "Hi"}], **GREEDY},
    {"id": "n3", "prompt_token_ids": [5, 6, 7, 8], **GREEDY},
    {"id": "\ud800", "prompt": "an id UTF-8 cannot encode", **GREEDY},
    {"custom_id": "n4", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "Once upon", "max_tokens": 5, "temperature": 0.7, "seed": 3}},
]
FAILING = {  # id -> (line, the error message of its record)
    "surrogate": ({"id": "surrogate", "prompt": "x\ud800y", **GREEDY},
                  "tokenizing failed: the text holds an unpaired surrogate U+D800 at character 1, which is not "
                  f"Unicode text ({TOKENIZER_TYPE_ERROR})"),
    "alternate": ({"id": "alternate", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
                  "applying the chat template failed: TemplateError: Conversation roles must alternate "
                  "user/assistant/user/assistant/..."),
    "chat-surrogate": ({"custom_id": "chat-surrogate", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"messages": [{"role": "user", "content": "\udfff"}], "max_tokens": 4}},
                       "applying the chat template failed: the text holds an unpaired surrogate U+DFFF at character "
                       f"0, which is not Unicode text ({TOKENIZER_TYPE_ERROR})"),
    "vocab": ({"id": "vocab", "prompt_token_ids": [3, 49152]}, "token id 49152 is out of range: vocab size is 49152"),
    "overlong": ({"id": "overlong", "prompt_token_ids": [5] * 80},
                 "request 'overlong': prompt has 80 tokens, but max_model_len is 64 (prompt must be at most 63 "
                 "tokens to leave room for one output token)"),
    "tiny-temperature": ({"id": "tiny-temperature", "prompt": "abc", "temperature": 1e-40, "max_tokens": 4},
                         "sampling failed: RuntimeError: probability tensor contains either `inf`, `nan` or "
                         "element < 0"),
    "invalid": ({"id": "invalid", "prompt": 5}, "prompt: must be a non-empty string (or a list of integer token ids "
                ">= 0, or a list holding one non-empty string), got 5"),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip("needs the SmolLM2 tokenizer (make model)")
    d = make_tiny_model(tmp_path_factory.mktemp("job-isolation"), vocab_size=49152, max_position_embeddings=512)
    template = d / "chat_template.jinja"
    template.write_text(ALTERNATE + template.read_text())
    return d


def error_message(rec: dict) -> str | None:
    err = rec.get("error")
    return err.get("message") if isinstance(err, dict) else None


def run(model, tmp_path, name: str, lines: list[dict]) -> list[dict]:
    prompts, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.out.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cli(["--prompts", prompts, "--out", out, "--model", model, "--max-model-len", 64, "--skip-invalid"], tp=2)
    return [json.loads(x) for x in out.read_text().splitlines()]


def record_id(rec: dict) -> str:
    return rec.get("custom_id", rec.get("id"))


def test_mixed_file_at_tp2(model, tmp_path):
    clean = {record_id(r): r for r in run(model, tmp_path, "clean", NORMAL)}
    mixed_lines = [x for pair in zip(NORMAL, list(FAILING.values())) for x in (pair[0], pair[1][0])]
    mixed_lines += [x for x, _ in list(FAILING.values())[len(NORMAL):]]
    recs = run(model, tmp_path, "mixed", mixed_lines)
    assert len(recs) == len(mixed_lines) == 12  # one record per line
    got = {record_id(r): r for r in recs}
    assert set(got) == {record_id(x) for x in NORMAL} | set(FAILING)
    for rid, (_, message) in FAILING.items():
        assert error_message(got[rid]) == message, rid
    for rid, rec in clean.items():
        assert error_message(rec) is None and result(got[rid]) == result(rec), rid


def result(rec: dict) -> dict:
    """What a record says about its request's output (not times, nor ids made from line numbers)."""
    if "custom_id" in rec:
        return {k: rec["response"]["body"][k] for k in ("choices", "usage", "model", "object")}
    return {k: rec[k] for k in ("text", "token_ids", "finish_reason", "usage")}
