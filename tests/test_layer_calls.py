"""The kernel calls the CPU backend binds into the layers (tpengine/backends/cpu/layer_calls.py, and the
paged decode call, tpengine/backends/cpu/cpu_paged.py ``bind``): the model's one forward runs them with
their checks done once. They must give exactly what the layers' generic ops give -- the same tokens
and the same logprobs, bit for bit -- in float32 and bfloat16, with float, int8 and int4 weights, at
1..8 rows (the GEMV kernels) and above (torch's), and decode steps must actually take them."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from tpengine.backends.cpu import cpu_library, cpu_paged, layer_calls
from tpengine.config import EngineConfig
from tpengine.engine.llm_engine import LLMEngine
from tpengine.sampling_params import SamplingParams

#: the C kernels the bound calls run (AVX512-BF16 and AVX2 builds)
BOUND_KERNELS = ("tpe_paged_decode_f32", "tpe_paged_decode_bf16", *layer_calls.KERNELS)
needs_kernels = pytest.mark.skipif(cpu_library.missing(*BOUND_KERNELS) is not None,
                                   reason=str(cpu_library.missing(*BOUND_KERNELS)))
# head size 32 (the paged C kernel takes multiples of 32), widths multiples of 16
SHAPE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96}
BASE = {"max_model_len": 128, "kv_cache_gb": 0.05}
# no prefix caching: the second run of a prompt must prefill it whole, as the first did


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bound"), seed=4, **SHAPE)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """q/k/v biases (column-parallel, added by the GEMM) and random norm weights."""
    return make_tiny_model(tmp_path_factory.mktemp("bound-qwen2"), "qwen2", seed=5, random_biases=True, **SHAPE)


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple]:
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs = engine.generate([(str(i), p, sp) for i, p in enumerate(prompts)])
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob,
             [sorted((k, v.logprob) for k, v in pos.items()) for pos in o.outputs[0].logprobs]) for o in outs]


def checked_paged_calls(stack, calls: list) -> dict:
    """Each layer's paged call through the checked :func:`cpu_paged.decode`, counting in ``calls``."""
    def call(a):
        def run(qkv, rope, index):
            calls.append(qkv.shape[0])
            hq, hkv = a.num_heads, a.num_key_value_heads
            t = qkv.view(qkv.shape[0], hq + 2 * hkv, a.head_dim)
            return cpu_paged.decode(t[:, :hq], t[:, hq:hq + hkv], t[:, hq + hkv:], rope.cos, rope.sin, a.k_cache,
                                    a.v_cache, a.tp_q_to_kv, a.scaling, index).flatten(1)
        return run
    return {layer.self_attn.layer_idx: call(layer.self_attn) for layer in stack.layers}


@needs_kernels
@pytest.mark.parametrize("arch, dtype, quantization", [
    ("llama", "float32", None), ("llama", "bfloat16", None), ("llama", "float32", "int8"),
    ("llama", "bfloat16", "int8"), ("llama", "bfloat16", "int4"), ("qwen2", "float32", None),
    ("qwen2", "bfloat16", "int4")])
def test_bound_calls_equal_the_generic_ops(request, arch, dtype, quantization):
    model = request.getfixturevalue(arch)
    engine = LLMEngine(EngineConfig(model=str(model), dtype=dtype, quantization=quantization,
                                    enable_prefix_caching=False, **BASE))
    backend, stack = engine.runner.backend, engine.runner.model.model
    stack.bound_decode = None  # one-token steps through the layers' calls too (the program: test_cpu_program)
    assert len(backend.paged_calls) == 2 and stack.norm.bound is not None
    assert all(layer.mlp.bound_act is not None and layer.input_layernorm.bound is not None for layer in stack.layers)
    g = torch.Generator().manual_seed(1)
    batches = [[torch.randint(3, 1001, (n,), generator=g).tolist() for n in lens]
               for lens in ([7], [3, 17, 40], [5 + i for i in range(11)])]  # 1, 3 and 11 rows a step
    counted, bound = [], backend.paged_calls
    backend.paged_calls = {i: (lambda f: lambda *a: counted.append(a[0].shape[0]) or f(*a))(f)
                           for i, f in bound.items()}
    with_bound = [run(engine, b) for b in batches]
    # every decode step, once per layer (10 tokens: 1 from the prefill, 9 decodes a batch)
    assert counted == [rows for rows in (1, 3, 11) for _ in range(9 * 2)]
    layer_calls.bind_stack(stack, cpu_kernels=False)  # the layers' generic ops
    checked = []
    backend.paged_calls = checked_paged_calls(stack, checked)
    assert stack.norm.bound is None and all(layer.mlp.bound_act is None for layer in stack.layers)
    assert [run(engine, b) for b in batches] == with_bound
    assert checked == counted


def test_nothing_is_bound_where_the_kernels_do_not_apply(tmp_path):
    """Head size 16 (the paged kernel takes multiples of 32): no paged calls, decode steps take the
    gathered path; C kernels off: nothing bound at all."""
    small_heads = make_tiny_model(tmp_path, name="d16")  # hidden 64 / 4 heads
    engine = LLMEngine(EngineConfig(model=str(small_heads), **BASE))
    assert engine.runner.backend.paged_calls == {}
    assert engine.runner.backend.prepare(False, torch.tensor([3]), torch.tensor([[0]]), None, None,
                                         torch.tensor([4])).path == "gathered"
    llama = make_tiny_model(tmp_path, name="llama", **SHAPE)
    engine = LLMEngine(EngineConfig(model=str(llama), cpu_kernels=False, **BASE))
    stack = engine.runner.model.model
    assert engine.runner.backend.paged_calls == {} and stack.norm.bound is None
    assert all(layer.mlp.bound_act is None for layer in stack.layers)
    if not cpu_library.has(*BOUND_KERNELS):  # no C kernels on this machine: nothing bound even where cpu_kernels is on
        assert LLMEngine(EngineConfig(model=str(llama), **BASE)).runner.backend.paged_calls == {}
