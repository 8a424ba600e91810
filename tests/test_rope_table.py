"""The per-position RoPE table (tpengine/model/layers/rope_table.py): bit for bit HF's rotary module's
rows, for one position alone (a decode step) and for a step's several, for the static rope types; the
module kept for the dynamic ones; a DecoderStack with a table length takes its step's rows from it."""

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tpengine.model.layers import rope_table
from tpengine.model.layers.fused import DecoderStack

LENGTH = 300
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


def llama_rotary(scaling, head_dim=80):
    return LlamaRotaryEmbedding(LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, rope_theta=500000.0,
                                            max_position_embeddings=512, rope_scaling=scaling))


def assert_rows_equal(rotary, table, like, kind=None):
    extra = () if kind is None else (kind,)
    for p in (0, 1, 63, 64, 65, 150, LENGTH - 1):  # one position alone, as a decode step calls the module
        cos, sin = rotary(like, torch.tensor([[p]]), *extra)
        assert torch.equal(table[0, p], cos[0, 0]) and torch.equal(table[1, p], sin[0, 0])
    positions = torch.tensor([3, 4, 5, 200, 201, 7])  # a step of several sequences
    cos, sin = rotary(like, positions[None], *extra)
    got = table.index_select(1, positions)
    assert torch.equal(got[0], cos[0]) and torch.equal(got[1], sin[0])


@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_equals_module(name, dtype, monkeypatch):
    monkeypatch.setattr(rope_table, "CHUNK_ELEMENTS", 80 * 64)  # several chunks of 64 positions
    rotary, like = llama_rotary(SCALINGS[name]), torch.zeros(1, 320, dtype=dtype)
    table = rope_table.build(rotary, LENGTH, like)
    assert table.shape == (2, LENGTH, 80) and table.dtype == dtype
    assert_rows_equal(rotary, table, like)


def test_per_layer_type_table():  # Gemma 3: the module takes the layer type
    config = Gemma3TextConfig(hidden_size=64, num_attention_heads=2, head_dim=32, num_hidden_layers=2,
                              vocab_size=100)
    rotary, like = Gemma3RotaryEmbedding(config), torch.zeros(1, 64)
    kind = config.layer_types[0]
    assert_rows_equal(rotary, rope_table.build(rotary, LENGTH, like, kind), like, kind)


def test_dynamic_and_longrope_keep_the_module():
    like = torch.zeros(1, 320)
    assert rope_table.build(llama_rotary({"rope_type": "dynamic", "factor": 2.0}), LENGTH, like) is None
    rotary = llama_rotary(None)
    rotary.rope_type = "longrope"
    assert rope_table.build(rotary, LENGTH, like) is None
    with pytest.raises(ValueError, match="at least one position"):
        rope_table.build(llama_rotary(None), 0, like)


def test_stack_takes_the_table():
    rotary = llama_rotary(SCALINGS["llama3"])
    stack = DecoderStack.__new__(DecoderStack)
    torch.nn.Module.__init__(stack)
    stack.rotary_emb = rotary
    h, positions = torch.zeros(2, 320), torch.tensor([17, 250])
    want = stack._rope(h, positions, None, None)  # no table length: the module
    stack.rope_table_len = LENGTH
    got = stack._rope(h, positions, None, None)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert stack._rope_tables[(None, torch.float32, h.device)].shape == (2, LENGTH, 80)
    stack.rope_types, stack.longrope_bound = [None], None
    stack.build_rope_tables(torch.bfloat16, h.device)  # the model runner's, before any step
    assert stack._rope_tables[(None, torch.bfloat16, h.device)].dtype == torch.bfloat16
