"""Sampling defaults from generation_config.json (tpengine.entrypoints.generation_defaults): the keys taken,
do_sample false, bad values, the setting (auto / ignore / a folder), the precedence of request >
CLI > [sampling] table > generation_config.json > built-in defaults, the printed line, and the
LLM API's get_default_sampling_params."""

from __future__ import annotations

import json
import shutil

import pytest

from tpengine.config import EngineConfig
from tpengine.entrypoints.generation_defaults import (
    defaults_line,
    generation_config_file,
    generation_defaults,
    read_generation_defaults,
)
from tpengine.entrypoints.setup import model_sampling_defaults, sampling_defaults
from tpengine.errors import UserError
from tpengine.frontend.requests import parse_lines


def folder(tmp_path, cfg, name="m"):
    d = tmp_path / name
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps(cfg))
    return d


def test_read_generation_defaults(tmp_path):
    d = folder(tmp_path, {"bos_token_id": 1, "eos_token_id": [2, 3], "temperature": 0.6, "top_p": 0.95,
                          "top_k": 20, "min_p": 0, "repetition_penalty": 1.3, "max_new_tokens": 64,
                          "do_sample": True, "num_beams": 1, "max_length": 100})
    got = read_generation_defaults(d / "generation_config.json")
    assert got == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.3,
                   "max_tokens": 64}
    assert [type(got[k]) for k in ("temperature", "min_p", "top_k", "max_tokens")] == [float, float, int, int]
    greedy = folder(tmp_path, {"temperature": 0.7, "do_sample": False, "top_p": None}, "g")
    assert read_generation_defaults(greedy / "generation_config.json") == {"temperature": 0.0}
    none = folder(tmp_path, {"bos_token_id": 1, "eos_token_id": 2, "_from_model_config": True}, "n")
    assert read_generation_defaults(none / "generation_config.json") == {}


@pytest.mark.parametrize("cfg, msg", [
    ({"repetition_penalty": 0}, "invalid repetition_penalty=0: repetition_penalty must be > 0, got 0"),
    ({"top_p": 1.5}, "invalid top_p=1.5: top_p must be in (0, 1], got 1.5"),
    ({"top_k": "50"}, 'invalid top_k="50": top_k must be an integer, got \'50\''),
    ({"max_new_tokens": -1}, "invalid max_new_tokens=-1: max_tokens must be >= 0 (0: score the prompt only), got -1"),
    ({"do_sample": "no"}, 'invalid do_sample="no": must be true or false'),
    ({"temperature": -1, "do_sample": True}, "invalid temperature=-1: temperature must be >= 0, got -1"),
])
def test_bad_values_name_the_file_and_key(tmp_path, cfg, msg):
    p = folder(tmp_path, cfg) / "generation_config.json"
    with pytest.raises(UserError) as e:
        read_generation_defaults(p)
    assert str(e.value) == f"{p}: {msg}"


def test_bad_files(tmp_path):
    (tmp_path / "a.json").write_text("{nope")
    with pytest.raises(UserError, match=r"a.json is not valid JSON: Expecting property name"):
        read_generation_defaults(tmp_path / "a.json")
    (tmp_path / "b.json").write_text("[1]")
    with pytest.raises(UserError) as e:
        read_generation_defaults(tmp_path / "b.json")
    assert str(e.value) == f"{tmp_path / 'b.json'} must hold a JSON object, got list"


def test_the_setting(tmp_path):
    d = folder(tmp_path, {"repetition_penalty": 1.3})
    other = folder(tmp_path, {"temperature": 0.5}, "other")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert generation_config_file("auto", d) == d / "generation_config.json"
    assert generation_config_file("auto", empty) is None
    assert generation_config_file("ignore", d) is None
    assert generation_defaults(str(other), d) == (other / "generation_config.json", {"temperature": 0.5})
    assert generation_defaults("ignore", d) == (None, {})
    with pytest.raises(UserError) as e:
        generation_config_file(str(empty), d)
    assert str(e.value) == f"--generation-config {str(empty)!r}: the folder holds no generation_config.json"
    with pytest.raises(UserError) as e:
        generation_config_file(str(tmp_path / "nope"), d)
    assert str(e.value) == (f"--generation-config {str(tmp_path / 'nope')!r}: must be auto, ignore or a folder "
                            f"holding a generation_config.json; {str(tmp_path / 'nope')!r} is not a folder")
    assert EngineConfig().generation_config == "auto"
    with pytest.raises(ValueError, match="invalid generation_config=''"):
        EngineConfig(generation_config="")


def test_printed_line(tmp_path):
    d = folder(tmp_path, {"repetition_penalty": 1.3, "max_new_tokens": 40, "temperature": 0.2})
    values, line = model_sampling_defaults(EngineConfig(model=str(d)))
    assert values == {"repetition_penalty": 1.3, "max_tokens": 40, "temperature": 0.2}
    assert line == (f"tpengine: sampling defaults from {d}/generation_config.json: temperature=0.2, "
                    "repetition_penalty=1.3, max_tokens=40 (--generation-config ignore to use tpengine's own)")
    assert model_sampling_defaults(EngineConfig(model=str(d), generation_config="ignore")) == ({}, None)
    assert defaults_line(d / "generation_config.json", {}) is None
    assert defaults_line(None, {"temperature": 0.0}) is None


def test_precedence_request_cli_table_model_builtin(tmp_path):
    model = {"repetition_penalty": 1.3, "max_tokens": 40, "temperature": 0.7, "top_k": 20}
    toml = tmp_path / "c.toml"
    toml.write_text("[sampling]\ntemperature = 0.5\ntop_k = 5\n")
    defaults = sampling_defaults(toml, model, temperature=0.0, max_tokens=None)
    assert defaults == {"repetition_penalty": 1.3, "max_tokens": 40, "temperature": 0.0, "top_k": 5}
    lines = [json.dumps(o) for o in (
        {"id": "plain", "prompt": "x"},
        {"id": "own", "prompt": "x", "repetition_penalty": 1.0, "max_tokens": 3, "top_k": 0},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "x"}]}})]
    reqs, errs = parse_lines(lines, defaults)
    assert errs == []
    got = {r.id: (r.params.repetition_penalty, r.params.max_tokens, r.params.temperature, r.params.top_k)
           for r in reqs}
    # generation_config's max_new_tokens replaces the per-format default (16, chat None) too
    assert got == {"plain": (1.3, 40, 0.0, 5), "own": (1.0, 3, 0.0, 0), "chat": (1.3, 40, 0.0, 5)}
    reqs, _ = parse_lines(lines, sampling_defaults(None, {}))  # --generation-config ignore: built-in
    assert {r.id: (r.params.repetition_penalty, r.params.max_tokens, r.params.temperature) for r in reqs} == {
        "plain": (1.0, 16, 1.0), "own": (1.0, 3, 1.0), "chat": (1.0, None, 1.0)}


def test_shard_split_side_files_carry_generation_config(tmp_path):
    from conftest import REPO

    from shard_tool.common import side_files

    src = REPO / "models" / "smollm2-135m-instruct"
    d = tmp_path / "m"
    d.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(src / name, d / name)
    assert "generation_config.json" in [p.name for p in side_files(d)]


def test_the_job_takes_the_models_defaults_and_says_so(tmp_path):
    from conftest import make_tiny_model

    from tpengine.entrypoints.run import prepare

    model = make_tiny_model(tmp_path / "models")
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "repetition_penalty": 1.3}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n"
                       + json.dumps({"id": "b", "prompt": "x", "repetition_penalty": 1.1}) + "\n")
    job = prepare(prompts, tmp_path / "out.jsonl", None, False, False, {"max_tokens": None, "temperature": 0.0},
                  {"model": str(model)}, world_size=1)
    try:
        assert {r.id: (r.params.repetition_penalty, r.params.temperature) for r in job.requests} == {
            "a": (1.3, 0.0), "b": (1.1, 0.0)}
        assert job.defaults_line == (f"tpengine: sampling defaults from {model}/generation_config.json: "
                                     "repetition_penalty=1.3 (--generation-config ignore to use tpengine's own)")
    finally:
        job.close()
    job = prepare(prompts, None, None, False, False, {}, {"model": str(model), "generation_config": "ignore"},
                  world_size=1)
    assert job.defaults_line is None and [r.params.repetition_penalty for r in job.requests] == [1.0, 1.1]
    job.close()
    (model / "generation_config.json").write_text(json.dumps({"top_k": -5}))
    with pytest.raises(UserError) as e:
        prepare(prompts, None, None, False, False, {}, {"model": str(model)}, world_size=1)
    assert str(e.value) == (f"{model}/generation_config.json: invalid top_k=-5: top_k must be >= -1 (0 or -1: "
                            "disabled), got -5")


@pytest.mark.parametrize("value", ["x", [2, "3"], True, -1])
def test_a_bad_eos_token_id_is_named(tmp_path, value):
    from tpengine.engine.llm_engine import eos_token_ids

    d = folder(tmp_path, {"eos_token_id": value})
    with pytest.raises(UserError) as e:
        eos_token_ids(str(d), None)
    assert str(e.value) == (f"{d}/generation_config.json: invalid eos_token_id={json.dumps(value)}: must be a token "
                            "id >= 0 or a list of them")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert eos_token_ids(str(d), None) == {2, 7}
