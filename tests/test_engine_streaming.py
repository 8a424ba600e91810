"""The engine's serving API on rank 0 (tp=1, in process): a streaming request's outputs so far grow
token by token to its final output, which equals the same request unstreamed; an aborted request
ends at once with its blocks freed; a duplicate live request id is that request's error."""

from __future__ import annotations

import pytest
from conftest import SMOLLM2_DIR, make_tiny_model

from tpengine.config import EngineConfig
from tpengine.engine.llm_engine import LLMEngine
from tpengine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip("needs the SmolLM2 tokenizer (make model)")
    model = make_tiny_model(tmp_path_factory.mktemp("streaming"), vocab_size=49152, max_position_embeddings=256)
    return LLMEngine(EngineConfig(model=str(model), max_model_len=128, num_kv_blocks=64, block_size=4))


def drain(engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_stream_outputs_grow_to_the_final_output(engine):
    prompt = engine.tokenizer("Stream me a story")["input_ids"]
    engine.add_request("plain", prompt, GREEDY)
    (plain,) = drain(engine)
    engine.add_request("s", prompt, GREEDY, stream=True)
    engine.add_request("other", prompt[:3], GREEDY)  # not streamed: only its final output
    outs = drain(engine)
    partial = [o for o in outs if o.request_id == "s" and not o.finished]
    (final,) = [o for o in outs if o.request_id == "s" and o.finished]
    assert [o.request_id for o in outs if o.request_id == "other"] == ["other"]
    assert [len(o.token_ids) for o in partial] == list(range(1, 12))  # one more token each step; the 12th is final
    for a, b in zip(partial, partial[1:]):
        assert b.text.startswith(a.text) and b.token_ids[: len(a.token_ids)] == a.token_ids
    assert all(o.finish_reason is None and o.latency_s is None for o in partial)
    assert final.text == plain.text and final.token_ids == plain.token_ids and final.finish_reason == "length"
    assert final.text.startswith(partial[-1].text)


def test_abort_frees_blocks_at_once(engine):
    engine.add_request("long", list(range(5, 25)), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    s = engine.stats()
    assert s.num_running == 1 and s.num_free_blocks < s.num_total_blocks
    assert engine.abort_request("long") is True
    assert engine.abort_request("long") is False and engine.abort_request("never") is False
    s = engine.stats()
    assert s.num_running == 0 and s.num_free_blocks == s.num_total_blocks
    (out,) = engine.step()
    assert out.request_id == "long" and out.finish_reason == "abort" and out.finished and len(out.token_ids) == 2
    assert not engine.has_unfinished()


def test_duplicate_live_request_id(engine):
    engine.add_request("dup", [5, 6, 7], GREEDY)
    engine.add_request("dup", [8, 9], GREEDY)
    outs = drain(engine)
    errors = [o for o in outs if o.error is not None]
    assert [(o.request_id, o.error, o.error_field) for o in errors] == [
        ("dup", "request id 'dup' is already running", "prompt")]
    assert [len(o.token_ids) for o in outs if o.error is None] == [12]
