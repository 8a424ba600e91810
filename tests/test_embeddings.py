"""Embeddings (issue 58 item 3, vLLM's pooling runner): ``/v1/embeddings`` driven by the real ``openai``
client's ``embeddings.create`` against a tp=2 pooling server on SmolLM2 (MEAN pooling, prompts prefilled
in chunks of 16 tokens), compared with HF's final hidden states (``hidden_states[-1]``: after the final
norm) pooled the same way; float and base64; the bad inputs' 400s; the generation routes a pooling
server refuses and the ``/v1/embeddings`` a generating server refuses. Then ``LLM.embed`` at tp=1 in
this process on a tiny Llama (LAST and MEAN, chunked, normalized or not) against HF, and the pieces:
the pooler config, ``pool_rows``."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import pytest
import torch
import torch.nn.functional as F
from conftest import SMOLLM2_DIR, make_tiny_model

from tpengine.config import EngineConfig, PoolerConfig, load_config
from tpengine.engine.pooling import pool_rows
from tpengine.engine.step import StepKind, StepPlan

openai = pytest.importorskip("openai")

#: Inputs of one request: a short one, one chunked (longer than the server's 16-token steps).
TEXTS = ["Hello world", "The capital of France is Paris, a city of museums, bridges and a long river that "
         "runs through it."]
IDS = [[1, 504, 3575, 314], [42, 7, 19, 88, 600, 31, 2, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
TOL = 1e-5
#: HF's final hidden states per (model, prompt): each prompt runs through HF once
_HIDDEN: dict[tuple, torch.Tensor] = {}


def hf_pooled(model, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    """HF's final hidden states of ``ids`` (``output_hidden_states[-1]``: the final norm's output, as
    ``last_hidden_state``), pooled (LAST or MEAN) and normalized as the engine does."""
    key = (id(model), tuple(ids))
    if (h := _HIDDEN.get(key)) is None:
        with torch.no_grad():
            h = _HIDDEN[key] = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    v = h[-1] if pooling == "LAST" else h.mean(0)
    return F.normalize(v, dim=0) if normalize else v


@pytest.fixture(scope="module")
def hf_smollm2():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(SMOLLM2_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pool_server(tmp_path_factory):
    """A tp=2 pooling server on SmolLM2 in float32: MEAN pooling, 16-token steps (a longer prompt is
    prefilled in chunks), max_model_len 64."""
    if not (SMOLLM2_DIR / "config.json").is_file():
        pytest.skip("needs make model")
    from serving import Server

    server = Server(tmp_path_factory.mktemp("pool-server"), extra=(
        "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}', "--max-num-batched-tokens", "16",
        "--max-model-len", "64"))
    server.model = server.client.models.list().data[0].id
    yield server
    server.stop()


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_openai_client_embeddings_equal_hf_at_tp2(pool_server, hf_smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    text_ids = [tok(t)["input_ids"] for t in TEXTS]
    assert len(text_ids[1]) > 16  # prefilled in two chunks or more
    client, model = pool_server.client, pool_server.model
    for inputs, ids in ((TEXTS, text_ids), (IDS, IDS), (TEXTS[1], text_ids[1:]), (IDS[0], IDS[:1])):
        floats = client.embeddings.create(model=model, input=inputs, encoding_format="float")
        packed = client.embeddings.create(model=model, input=inputs)  # the SDK asks for base64 and decodes it
        assert floats.object == "list" and floats.model == model
        assert [d.index for d in floats.data] == list(range(len(ids)))
        assert all(d.object == "embedding" for d in floats.data)
        assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
        for f, b, prompt in zip(floats.data, packed.data, ids):
            ref = hf_pooled(hf_smollm2, prompt, "MEAN")
            got = torch.tensor(f.embedding)
            assert got.shape == (576,) and abs(float(got.norm()) - 1) < 1e-6
            assert (got - ref).abs().max() < TOL, prompt
            assert (torch.tensor(b.embedding) - ref).abs().max() < TOL
    # base64 on the wire: the float32 values' little-endian bytes
    status, body = _post(pool_server.url + "/v1/embeddings", {"input": IDS[0], "encoding_format": "base64"})
    assert status == 200
    raw = torch.frombuffer(bytearray(base64.b64decode(body["data"][0]["embedding"])), dtype=torch.float32)
    assert (raw - hf_pooled(hf_smollm2, IDS[0], "MEAN")).abs().max() < TOL
    # vLLM's normalize: false: the mean itself (entries up to ~10: the bound is relative)
    plain = client.embeddings.create(model=model, input=IDS[1], encoding_format="float",
                                     extra_body={"normalize": False})
    ref = hf_pooled(hf_smollm2, IDS[1], "MEAN", normalize=False)
    assert (torch.tensor(plain.data[0].embedding) - ref).abs().max() < TOL * ref.abs().max()


def test_bad_inputs_are_400s_naming_the_field(pool_server):
    client, model, url = pool_server.client, pool_server.model, pool_server.url + "/v1/embeddings"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=model, input="hi", dimensions=64)
    assert e.value.body["param"] == "dimensions" and "matryoshka" in e.value.body["message"]
    cases = [({"input": ""}, "input", "must be non-empty"),
             ({"input": []}, "input", "non-empty list"),
             ({"input": [[1, 2], []]}, "input", "non-empty lists of token ids, got [] at index 1"),
             ({"input": [49152]}, "input", "token id 49152 is out of range: vocab size is 49152"),
             ({"input": [5] * 65}, "input", "maximum context length is 64 tokens. However, you requested 65"),
             ({"input": "hi", "encoding_format": "int8"}, "encoding_format", 'must be "float" or "base64"'),
             ({}, "input", "is required")]
    for body, param, text in cases:
        status, err = _post(url, body)
        assert status == 400 and err["error"]["param"] == param and text in err["error"]["message"], (body, err)
    assert _post(url, {"input": "hi", "model": "other"})[0] == 404
    assert _post(url, {"input": [5] * 64})[0] == 200  # a prompt may fill max_model_len: no output token


def test_a_pooling_server_refuses_generation(pool_server):
    with pytest.raises(openai.BadRequestError) as e:
        pool_server.client.chat.completions.create(model=pool_server.model,
                                                   messages=[{"role": "user", "content": "hi"}])
    assert "does not support the Chat Completions API" in e.value.body["message"]
    assert "--runner pooling" in e.value.body["message"]
    for path, api in (("/v1/completions", "Completions"), ("/v1/responses", "Responses"), ("/v1/messages", "Messages")):
        status, err = _post(pool_server.url + path, {"prompt": "hi"})
        assert status == 400 and f"does not support the {api} API" in err["error"]["message"]


def test_a_generating_server_refuses_embeddings(smollm2_server):
    with pytest.raises(openai.BadRequestError) as e:
        smollm2_server.client.embeddings.create(model="smollm2-135m-instruct", input="hi")
    assert "does not support the Embeddings API" in e.value.body["message"]
    assert "--runner pooling" in e.value.body["message"]


@pytest.fixture
def torch_threads():
    """The process's torch thread count, restored after a test whose LLM sets its own (``threads``)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_llm_embed_at_tp1_equals_hf(tmp_path, torch_threads):
    from transformers import AutoModelForCausalLM

    from tpengine import LLM, PoolingParams

    folder = make_tiny_model(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [[1, 5, 9, 22, 7, 3, 100, 42, 8], list(range(3, 40)), [17], list(range(2, 66))]  # 37: 3 chunks; 64: max
    for pooling in ("LAST", "MEAN"):
        with LLM(str(folder), runner="pooling", pooler_config={"pooling_type": pooling}, max_model_len=64,
                 max_num_batched_tokens=16, num_kv_blocks=32, threads=1) as llm:
            assert llm.llm_engine.config.enable_prefix_caching == (pooling == "LAST")  # MEAN computes every token
            outs = llm.embed([{"prompt_token_ids": p} for p in prompts + prompts[1:2]])  # the repeat: a cache hit
            for p, o in zip(prompts + prompts[1:2], outs):
                assert o.error is None and o.prompt_token_ids == p and o.outputs.hidden_size == 64
                assert (torch.tensor(o.outputs.embedding) - hf_pooled(hf, p, pooling)).abs().max() < TOL, (pooling, p)
            plain = llm.embed(prompts[1], PoolingParams(normalize=False))[0].outputs.embedding
            ref = hf_pooled(hf, prompts[1], pooling, normalize=False)
            assert (torch.tensor(plain) - ref).abs().max() < TOL * ref.abs().max()
            bad = llm.embed([list(range(65)), [1, 2]], [PoolingParams(), PoolingParams(dimensions=8)])
            assert bad[0].outputs is None and "65 tokens, but max_model_len is 64" in bad[0].error
            assert bad[1].outputs is None and bad[1].error.startswith("dimensions: this model does not support")
            with pytest.raises(ValueError, match="LLM.generate generates text, but this LLM runs"):
                llm.generate([[1, 2, 3]])
            # every block is free after a request (prefill only); one aborted between its chunks ends without
            # an embedding, its blocks freed too
            engine, bm = llm.llm_engine, llm.llm_engine.scheduler.block_manager
            assert bm.num_free_blocks == bm.num_blocks
            engine.add_request("a", list(range(100, 137)), PoolingParams())  # new: no cached prefix
            assert engine.step() == [] and bm.num_free_blocks < bm.num_blocks  # its first chunk
            assert engine.abort_request("a") and not engine.abort_request("a")
            (out,) = engine.step()
            assert out.request_id == "a" and out.embedding is None and out.finish_reason == "abort"
            assert bm.num_free_blocks == bm.num_blocks and not engine.has_unfinished()


def test_pooler_config_and_runner_settings(tmp_path):
    cfg = EngineConfig(runner="pooling", pooler_config='{"pooling_type": "mean", "normalize": false}')
    assert cfg.pooler == PoolerConfig("MEAN", False) and not cfg.enable_prefix_caching
    toml = tmp_path / "pool.toml"
    toml.write_text('[engine]\nrunner = "pooling"\npooler_config = {pooling_type = "MEAN", normalize = false}\n')
    assert load_config(toml) == cfg
    assert EngineConfig(runner="pooling").pooler == PoolerConfig("LAST", True)
    assert PoolerConfig.parse({"use_activation": False, "pooling_type": None}) == PoolerConfig("LAST", False)
    pooling = {"runner": "pooling"}
    for settings, text in [({"runner": "embed"}, "invalid runner='embed': must be one of auto, generate, pooling"),
                           ({"pooler_config": "{}"}, "but runner is 'auto'; add runner pooling"),
                           ({**pooling, "pooler_config": '{"pooling": "LAST"}'}, "unknown key(s) ['pooling']"),
                           ({**pooling, "pooler_config": '{"pooling_type": "CLS"}'}, "must be one of LAST, MEAN"),
                           ({**pooling, "pooler_config": "LAST"}, "not JSON"),
                           ({**pooling, "speculative_config": {"num_speculative_tokens": 2}},
                            "a pooling engine (runner pooling) generates no tokens")]:
        with pytest.raises(ValueError) as e:
            EngineConfig(**settings)
        assert text in str(e.value), (settings, str(e.value))


def test_pool_rows_last_and_mean_per_sequence():
    hidden = torch.arange(12, dtype=torch.float32).view(6, 2)  # sequences of 1, 3 and 2 tokens
    cu = torch.tensor([0, 1, 4, 6])
    plan = StepPlan(StepKind.PREFILL, input_ids=torch.zeros(6, dtype=torch.int64), cu_seqlens_q=cu,
                    sample_idx=cu[1:] - 1)
    assert pool_rows(hidden, plan, "LAST").tolist() == [[0, 1], [6, 7], [10, 11]]
    assert pool_rows(hidden, plan, "MEAN").tolist() == [[0, 1], [2 + 4 + 6, 3 + 5 + 7], [8 + 10, 9 + 11]]
