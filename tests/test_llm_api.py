"""The Python API ``from tpengine import LLM, SamplingParams`` (vLLM's offline ``LLM``): at tp=1 in
process, greedy float32 outputs equal Hugging Face ``generate`` token for token, chat prompts are the
tokenizer's chat template, a prompt that cannot run is its own error; under torchrun at tp=2 every
rank gets the same outputs, equal to tp=1's."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
from conftest import REPO, SMOLLM2_DIR, make_tiny_model
from hf_reference import greedy
from launch import torchrun

from tpengine import LLM, CompletionOutput, RequestOutput, SamplingParams
from tpengine.errors import UserError

SETTINGS = {"dtype": "float32", "max_model_len": 64, "num_kv_blocks": 64, "block_size": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = ["The capital of France is", "Hello", "1 2 3 4"]
CONV = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip("needs the SmolLM2 tokenizer (make model)")
    return make_tiny_model(tmp_path_factory.mktemp("llm-api"), vocab_size=49152, max_position_embeddings=256)


@pytest.fixture(scope="module")
def llm(model):
    with LLM(str(model), **SETTINGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def tok(llm):
    return llm.llm_engine.tokenizer


def template_ids(tok, conv, add_generation_prompt=True) -> list[int]:
    out = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def check_greedy(model, outs, prompt_ids, max_new=12):
    """Each output's tokens are HF greedy ``generate``'s, its text their decoding."""
    assert [o.prompt_token_ids for o in outs] == prompt_ids
    ref = greedy(model, prompt_ids, max_new)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, r in zip(outs, ref):
        (c,) = o.outputs
        assert isinstance(c, CompletionOutput) and c.index == 0 and o.finished and o.error is None
        assert c.finish_reason == ("length" if len(r) == max_new else "stop")


def test_generate_greedy_equals_hf(model, llm, tok):
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(isinstance(o, RequestOutput) for o in outs)
    assert [o.prompt for o in outs] == PROMPTS
    ids = [int(o.request_id) for o in outs]
    assert ids == list(range(ids[0], ids[0] + 3))
    check_greedy(model, outs, [tok(p)["input_ids"] for p in PROMPTS])
    for o in outs:
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    (one,) = llm.generate(PROMPTS[0], GREEDY)  # a single string is one prompt
    assert one.outputs[0].token_ids == outs[0].outputs[0].token_ids and one.prompt == PROMPTS[0]


def test_token_id_prompts(model, llm):
    outs = llm.generate([[5, 6, 7], {"prompt_token_ids": [8, 9]}, {"prompt": "Hello"}], GREEDY)
    assert [o.prompt for o in outs] == [None, None, "Hello"]
    check_greedy(model, outs[:2], [[5, 6, 7], [8, 9]])
    (single,) = llm.generate([5, 6, 7], GREEDY)  # a list of ints is one prompt
    assert single.prompt_token_ids == [5, 6, 7] and single.outputs == outs[0].outputs


def test_max_tokens_0_scores_the_prompt(llm):
    """vLLM's prompt scoring through the Python API: nothing generated, the prompt logprobs those a
    one-token request gets."""
    (scored, ref) = llm.generate([[5, 6, 7, 8]] * 2, [SamplingParams(max_tokens=0, prompt_logprobs=2, n=2),
                                                     SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0)])
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in scored.outputs] == [(0, "", [], "length"),
                                                                                        (1, "", [], "length")]
    assert scored.prompt_logprobs == ref.prompt_logprobs and len(scored.prompt_logprobs) == 4


def test_list_of_sampling_params(llm):
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)]
    outs = llm.generate(["Hello"] * 4, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 6, 6]
    assert outs[1].outputs[0].token_ids[:3] == outs[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == outs[3].outputs[0].token_ids  # the same seed samples the same
    (default,) = llm.generate([[5, 6, 7]], [SamplingParams(temperature=0.0)])  # max_tokens 16 by default
    assert len(default.outputs[0].token_ids) == 16 or default.outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError) as e:
        llm.generate(["a", "b", "c"], params[:2])
    assert str(e.value) == ("got 2 sampling_params for 3 prompts: pass one SamplingParams for all, "
                            "or a list with one per prompt")
    with pytest.raises(TypeError) as e:
        llm.generate(["a"], {"temperature": 0})
    assert str(e.value) == ("sampling_params must be a SamplingParams, a list of them (one per prompt) or None, "
                            "got dict {'temperature': 0}")
    with pytest.raises(TypeError) as e:
        llm.generate(["a", 3.5])
    assert str(e.value) == ("prompts[1] must be a str, a list of token ids (ints), {'prompt': str} or "
                            "{'prompt_token_ids': [int, ...]}, got float 3.5")
    assert llm.generate([]) == []


def test_chat_applies_the_chat_template(model, llm, tok):
    (out,) = llm.chat(CONV, GREEDY)
    assert out.prompt is None
    check_greedy(model, [out], [template_ids(tok, CONV)])
    convs = [CONV, [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]]
    outs = llm.chat(convs, GREEDY)
    assert [o.prompt_token_ids for o in outs] == [template_ids(tok, CONV),
                                                 template_ids(tok, [{"role": "user", "content": "a\nb"}])]
    assert outs[0].outputs == out.outputs
    (raw,) = llm.chat(CONV, GREEDY, add_generation_prompt=False)
    assert raw.prompt_token_ids == template_ids(tok, CONV, add_generation_prompt=False) != out.prompt_token_ids
    (default,) = llm.chat(CONV)  # SamplingParams(): max_tokens 16, as vLLM's LLM.chat
    assert len(default.outputs[0].token_ids) == 16 or default.outputs[0].finish_reason == "stop"
    with pytest.raises(UserError) as e:
        llm.chat([CONV, [{"role": "user"}]])
    assert str(e.value) == ("conversation 1: messages[0].content: is required: must be a string "
                            "(or a list of text parts)")


def test_a_prompt_that_cannot_run_is_its_own_error(llm, tok):
    long = "x" * 400
    n = len(tok(long)["input_ids"])
    outs = llm.generate([long, "Hello", {"prompt_token_ids": []}, [5, 49152]], GREEDY)
    (ok,) = llm.generate(["Hello"], GREEDY)
    bad = [outs[i] for i in (0, 2, 3)]
    assert [o.error for o in bad] == [
        f"request {outs[0].request_id!r}: prompt has {n} tokens, but max_model_len is 64 (prompt must be at "
        "most 63 tokens to leave room for one output token)",
        "the prompt has no tokens",
        "token id 49152 is out of range: vocab size is 49152",
    ]
    assert all(o.outputs == [] and o.finished for o in bad)
    assert [o.prompt_token_ids for o in bad] == [tok(long)["input_ids"], [], []]
    assert outs[1].error is None and outs[1].outputs == ok.outputs


def test_engine_settings_are_checked(model):
    with pytest.raises(UserError) as e:
        LLM(str(model), max_num_seq=4, foo=1)
    assert str(e.value) == (
        "unknown engine setting(s) ['foo', 'max_num_seq']; valid: attention_backend, block_size, cpu_huge_pages, "
        "cpu_kernels, cpu_linear, data_parallel_size, dist_timeout_s, dtype, enable_chunked_prefill, "
        "enable_expert_parallel, "
        "enable_prefix_caching, enforce_eager, generation_config, "
        "gpu_memory_utilization, kv_cache_dtype, kv_cache_gb, kv_mirror, max_model_len, max_num_batched_tokens, "
        "max_num_seqs, model, num_kv_blocks, pipeline_parallel_size, pooler_config, pp_layer_partition, quantization, "
        "reasoning_parser, runner, seed, speculative_config, structured_outputs_backend, tensor_parallel_size, "
        "threads")
    with pytest.raises(UserError) as e:
        LLM(str(model), tensor_parallel_size=2)
    assert str(e.value) == ("data_parallel_size=1 x tensor_parallel_size=2 does not fit the world size 1 (torchrun's "
                            "--nnodes x --nproc_per_node): it must be data_parallel_size x tensor_parallel_size "
                            "(1 x 1), or launch 2 rank(s) for these sizes")
    with pytest.raises(ValueError) as e:
        LLM(str(model), block_size=0)
    assert str(e.value) == "invalid block_size=0: must be an integer >= 1"
    with pytest.raises(UserError) as e:
        LLM(str(model) + "-missing")
    assert str(e.value) == f"model folder {str(model) + '-missing'!r} does not exist"


def load_worker():
    spec = importlib.util.spec_from_file_location("llm_api_worker", REPO / "tests" / "workers" / "llm_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tp2_every_rank_gets_the_tp1_outputs(model, llm, tmp_path):
    workload = {
        "model": str(model), "settings": SETTINGS, "prompts": [*PROMPTS, [5, 6, 7], "Hello", "x" * 400],
        "params": [{"temperature": 0.0, "max_tokens": 12}] * 4 + [{"temperature": 0.8, "seed": 3, "max_tokens": 8}]
        + [{"temperature": 0.0}],
        "conversations": [CONV, [{"role": "user", "content": "Name a planet."}]],
        "chat_params": {"temperature": 0.0, "max_tokens": 10},
    }
    (tmp_path / "workload.json").write_text(json.dumps(workload))
    torchrun("llm_api.py", 2, [str(tmp_path / "workload.json"), str(tmp_path)], timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0] == ranks[1]
    with LLM(str(model), **SETTINGS) as fresh:  # tp=1, request ids from "0" as in the workers
        tp1 = load_worker().run_workload(fresh, workload)
    assert fresh.llm_engine is None
    with pytest.raises(RuntimeError) as e:
        fresh.generate("Hello")
    assert str(e.value) == "this LLM is shut down: create a new LLM"
    fresh.shutdown()  # a second shutdown does nothing
    assert {"world_size": 2, **tp1} == ranks[0]
    assert [o["request_id"] for o in tp1["generate"] + tp1["chat"]] == [str(i) for i in range(8)]
    assert [o["error"] is not None for o in tp1["generate"]] == [False] * 5 + [True]
    assert [len(o["outputs"]) for o in tp1["chat"]] == [1, 1]
    # the in-process engine of the other tests gives the same tokens (greedy prompts)
    again = llm.generate(PROMPTS, GREEDY)
    assert [dataclasses.asdict(o)["outputs"] for o in again] == [o["outputs"] for o in tp1["generate"][:3]]


def test_chat_template_options(llm, tok):
    conv = CONV + [{"role": "assistant", "content": "Hello"}]
    (out,) = llm.chat(conv, GREEDY, add_generation_prompt=False, continue_final_message=True,
                      chat_template_kwargs={"unused": 1})
    want = tok.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True, tokenize=True)
    assert out.prompt_token_ids == list(want["input_ids"]) and out.error is None
    assert out.prompt_token_ids[-1:] == tok("Hello", add_special_tokens=False)["input_ids"]
    with pytest.raises(UserError) as e:
        llm.chat(conv, GREEDY, continue_final_message=True)  # add_generation_prompt is True by default, as vLLM
    assert str(e.value) == ("conversation 0: continue_final_message: cannot be true together with "
                            "add_generation_prompt true (continue the final message, or open a new assistant "
                            "turn: set add_generation_prompt false)")
    with pytest.raises(UserError) as e:
        llm.chat(CONV, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert str(e.value) == ('conversation 0: continue_final_message: needs the last message to be the "assistant" '
                            'message to continue, got role "user"')


def test_default_sampling_params_from_generation_config(model, llm, tmp_path, capsys):
    import json

    assert llm.get_default_sampling_params() == SamplingParams()  # the tiny model's file sets no sampling key
    g = tmp_path / "g"
    g.mkdir()
    (g / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.3, "max_new_tokens": 5,
                                                          "do_sample": False}))
    capsys.readouterr()
    with LLM(str(model), generation_config=str(g), **SETTINGS) as other:
        assert other.get_default_sampling_params() == SamplingParams(repetition_penalty=1.3, max_tokens=5,
                                                                     temperature=0.0)
    assert (f"tpengine: sampling defaults from {g}/generation_config.json: temperature=0.0, repetition_penalty=1.3, "
            "max_tokens=5 (--generation-config ignore to use tpengine's own)\n") in capsys.readouterr().err
    with pytest.raises(UserError) as e:
        LLM(str(model), generation_config=str(tmp_path / "none"), **SETTINGS)
    assert "is not a folder" in str(e.value)
