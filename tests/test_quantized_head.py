"""The quantized embedding / LM head (tpengine/model/quant/weights.py, embedding.py, loader.py) and
grouped int8: rows read back out of the packed layouts equal the reference dequantize, the
grouped int8 kernel against ``x @ dequant(w).T``, the lookup, the LM head and its greedy argmax
on quantized rows, and a tied model holding ONE quantized table (exact weight bytes)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from tpengine.distributed import TPInfo
from tpengine.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tpengine.model.loader import load_model
from tpengine.model.quant.apply import quantize_linear, quantize_weight
from tpengine.model.quant.arith import (
    _int4_values,
    dequantize_int4,
    dequantize_int8,
    int4_pack_layout,
    quantize_int4,
    quantize_int8,
)
from tpengine.model.quant.weights import Int8Weight, QuantScheme, check_quantization

SCHEMES = {"int8": QuantScheme("int8"), "int8-32": QuantScheme("int8", 32), "int4-32": QuantScheme("int4", 32),
           "int4-64": QuantScheme("int4", 64)}


def weight(out: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, k, generator=g) * 0.05


def reference(w: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype) -> torch.Tensor:
    """float32 dequantize of ``w`` quantized by ``scheme`` with the reference functions."""
    if scheme.name == "int8":
        return dequantize_int8(*quantize_int8(w, dtype, group_size=scheme.group_size))
    return dequantize_int4(*quantize_int4(w, scheme.group_size, dtype), scheme.group_size)


@pytest.mark.parametrize("rows", [16, 48, 80, 1008, 1520, 2064])
def test_int4_pack_layout_reads_rows_back(rows):
    """The layout learnt from torch's packing reads every value of a random [rows, 576] matrix back."""
    layout = int4_pack_layout(rows)
    # blocks of 64 rows with AVX512, 32 with AVX2 (one block of all the rows below that)
    assert layout.rows == rows and layout.block in (32, 64, rows) and layout.tail == rows % layout.block
    q = torch.randint(0, 16, (rows, 576), generator=torch.Generator().manual_seed(rows), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(_int4_values(packed, layout, torch.arange(rows), 576), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("rows", [501, 1001, 1536])
def test_rows_equal_reference_dequant(rows, name, dtype):
    """``rows(ids)`` is the reference dequantize of those rows, rounded once to the model dtype, for
    any ids shape; ``dequantize()`` is the whole reference; a vocabulary shard (rows [0, 500) and
    [500, rows)) quantizes to the same values as those rows of the whole table."""
    scheme, w = SCHEMES[name], weight(rows, 128, seed=rows).to(dtype)
    m = quantize_weight(w, scheme, dtype)
    ref = reference(w, scheme, dtype)
    assert torch.equal(m.dequantize(), ref)
    ids = torch.tensor([[0, rows - 1, 7], [rows // 2, 499, 500]])
    got = m.rows(ids)
    assert got.shape == (2, 3, 128) and got.dtype == dtype
    assert torch.equal(got, ref[ids].to(dtype))
    for a, b in ((0, 500), (500, rows)):
        assert torch.equal(quantize_weight(w[a:b], scheme, dtype).dequantize(), ref[a:b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_grouped_int8_kernel_head_shape(batch, dtype):
    """Grouped int8 (group 32, GGUF Q8_0) at the LM head's input width 576 (4096 vocabulary rows
    here): the two-nibble kernel equals ``x @ dequant(w).T``."""
    w = weight(4096, 576, seed=5)
    q, s = quantize_int8(w.to(dtype), dtype, group_size=32)
    m = Int8Weight(q, s, 32)
    assert m.group_size == 32 and m.nbytes == 4096 * 576 + 2 * (576 // 32) * 4096 * 2 * dtype.itemsize
    x = torch.randn(batch, 576, generator=torch.Generator().manual_seed(batch)).to(dtype)
    ref = x.float() @ dequantize_int8(q, s).T
    got = m(x)
    assert got.shape == (batch, 4096) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=1e-2)


def test_int8_weight_per_channel_forms():
    """Per-channel scales come as [out] or [out, 1] (group_size None or in): the same fast-path buffers."""
    q, s = quantize_int8(weight(32, 64), torch.float32)
    for m in (Int8Weight(q, s), Int8Weight(q, s[:, None]), Int8Weight(q, s[:, None], 64)):
        assert m.group_size is None and sorted(n for n, _ in m.named_buffers()) == ["qweight", "scales"]
        assert m.scales.shape == (32,) and torch.equal(m.dequantize(), dequantize_int8(q, s))


def test_int8_weight_errors():
    q, s = quantize_int8(weight(32, 64), torch.float32, group_size=32)
    with pytest.raises(ValueError) as e:
        Int8Weight(q.int(), s, 32)
    assert str(e.value) == "Int8Weight: q must be a 2-D int8 tensor, not torch.int32 of shape [32, 64]"
    with pytest.raises(ValueError) as e:
        Int8Weight(q, s)
    assert str(e.value) == "Int8Weight: per-channel scales must be [32] or [32, 1], not [32, 2]"
    with pytest.raises(ValueError) as e:
        Int8Weight(q, s[:, :1], 32)
    assert str(e.value) == "Int8Weight: scales must be [32, 2] for group size 32, not [32, 1]"
    with pytest.raises(ValueError) as e:
        Int8Weight(q, s, 16)
    assert str(e.value) == "Int8Weight: group size 16 must divide the 64 input columns and be one of 32, 64, 128, 256"
    with pytest.raises(ValueError) as e:
        QuantScheme.of("int8", 48)
    assert str(e.value) == "invalid int8 group size 48: must be unset (per output channel) or one of 32, 64, 128, 256"


def test_scheme_vocab():
    """--quantization's schemes quantize the embedding / LM head too: int8 per channel under int8, int4
    group 32 with coded zeros (as the linears) under int4."""
    assert QuantScheme.of("int8") == QuantScheme("int8", None, QuantScheme("int8", None))
    assert QuantScheme.of("int8", 32) == QuantScheme("int8", 32, QuantScheme("int8", None))
    coded = QuantScheme("int4", 32, None, zero_codes=True)
    assert QuantScheme.of("int4") == QuantScheme("int4", 32, coded, zero_codes=True)
    assert QuantScheme.of("int4", 64) == QuantScheme("int4", 64, coded, zero_codes=True)
    from conftest import tiny_config

    tiny = tiny_config("llama", intermediate_size=128)  # hidden 64
    from tpengine.errors import UserError

    with pytest.raises(UserError) as e:
        check_quantization(tiny, 1, QuantScheme("int4", 32, QuantScheme("int4", 128)))
    assert str(e.value) == ("--quantization int4: the embedding / LM head (int4, group size 128) has 64 input "
                            "features, not a multiple of 128")
    check_quantization(tiny, 2, QuantScheme.of("int4"))


@pytest.mark.parametrize("name", list(SCHEMES))
def test_vocab_layers_on_quantized_rows(name):
    """A tied quantized embedding / LM head pair (tp=1): the lookup is the dequantized rows, the
    head's logits ``hidden @ dequant.T`` (float32), its greedy argmax that of its own logits."""
    v, h, scheme = 1001, 64, SCHEMES[name]
    embed = VocabParallelEmbedding(0, v, v, h, dtype=torch.float32, device="cpu")
    embed.weight.data.copy_(weight(v, h, seed=9))
    quantize_linear(embed, scheme)
    assert ("_layout" in vars(embed.quant)) == (scheme.group_size is not None)  # learnt at load, not in a step
    head = ParallelLMHead(0, v, v, h, dtype=torch.float32, device="cpu")
    head.weight, head.quant = None, embed.quant
    deq = embed.quant.dequantize()
    ids = torch.tensor([0, 3, 1000, 3])
    assert embed.weight is None and torch.equal(embed(ids), deq[ids])
    hidden = torch.randn(4, h, generator=torch.Generator().manual_seed(1))
    logits = head(hidden)
    assert logits.shape == (4, v)
    torch.testing.assert_close(logits, hidden @ deq.T, atol=1e-5, rtol=1e-5)
    assert torch.equal(head.greedy(hidden), logits.argmax(dim=-1))


# ---------------------------------------------------------------------------------- loader
def tiny(tmp_path, tied: bool):
    return make_tiny_model(tmp_path, "llama", seed=4, name=f"llama-{tied}", intermediate_size=128,
                           tie_word_embeddings=tied)


def load(path, quantization):
    return load_model(path, TPInfo(0, 1, 0, torch.device("cpu")), torch.float32, quantization=quantization)


def linear_bytes(hf, per_weight: float, per_row: int = 0, per_group: int = 0) -> int:
    """Bytes of the tiny llama's quantized linears (hidden 64, intermediate 128, kv 32, 2 layers)."""
    h, i, kv = hf.hidden_size, hf.intermediate_size, hf.num_key_value_heads * (hf.hidden_size // hf.num_attention_heads)
    shapes = [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)]
    per_layer = sum(int(o * k * per_weight) + o * per_row + o * (k // 32) * per_group for o, k in shapes)
    return hf.num_hidden_layers * per_layer


@pytest.mark.parametrize("tied", [True, False])
def test_loader_quantizes_vocab_layers(tmp_path, tied):
    """--quantization int8 / int4 quantize the embedding and the LM head: a tied model holds ONE
    quantized table (the same module and storage, no float vocabulary rows left), an untied one
    two; the weight bytes are exact (int4 pads the 1001 rows to 1008); a scheme with vocab None
    keeps them float."""
    path = tiny(tmp_path, tied)
    norms = (2 * 2 + 1) * 64 * 4
    tables = 1 if tied else 2
    for scheme, table, linears in (
            ("int8", 1001 * 64 + 1001 * 4, None),
            ("int4", 1008 * 64 // 2 + 1008 * 2 * (4 + 1), None),  # int4 g32, a scale and a zero code a group
            (QuantScheme("int4", 32, QuantScheme("int4", 32)), 1008 * 64 // 2 + 1008 * 2 * 2 * 4, "int4"),
            (QuantScheme("int4", 32, QuantScheme("int8", 32)), 1008 * 64 + 2 * (2 * 1008 * 2 * 4), "int4"),
            (QuantScheme("int4", 32, None), 1001 * 64 * 4, "int4")):
        loaded = load(path, scheme)
        model, hf = loaded.module, loaded.hf_config
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        kind = linears or scheme
        lin = (linear_bytes(hf, 1, per_row=4) if kind == "int8" else linear_bytes(hf, 0.5, per_group=4 + 1)
               if kind == "int4" and scheme == "int4" else linear_bytes(hf, 0.5, per_group=2 * 4))
        if isinstance(scheme, QuantScheme) and scheme.vocab is None:
            assert embed.quant is None and head.quant is None and embed.weight is not None
            assert loaded.weight_bytes == norms + lin + tables * table
            continue
        assert embed.weight is None and head.weight is None
        assert not [n for n, p in model.named_parameters() if p.shape[0] == 1001]  # no float vocabulary rows
        assert (embed.quant is head.quant) == tied
        bufs = lambda m: {b.data_ptr() for b in m.buffers()}  # noqa: E731
        assert (bufs(embed.quant) == bufs(head.quant)) == tied
        assert loaded.weight_bytes == norms + lin + tables * table, scheme
        ids = torch.tensor([5, 1000])
        assert torch.equal(embed(ids), embed.quant.dequantize()[ids])
