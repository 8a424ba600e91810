"""The CPU decode program (tpengine/backends/cpu/decode_program.py): the decode step's kernels bound
once. It must give exactly what the model's own forward gives -- the same tokens and the same
logprobs, bit for bit -- in float32 and bfloat16, with float, int8 and int4 weights, at 1..8 rows
(the GEMV kernels) and above (torch's), and it must be the path decode steps actually take."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from tpengine.backends.cpu import cpu_library
from tpengine.backends.cpu import decode_program as cpu_decode_program
from tpengine.config import EngineConfig
from tpengine.engine.llm_engine import LLMEngine
from tpengine.sampling_params import SamplingParams

# the program's tests; its declining (no program without the C kernels) runs on every machine
#: the C kernels the decode program calls (AVX512-BF16 and AVX2 builds)
PROGRAM_KERNELS = ("tpe_paged_decode_f32", "tpe_paged_decode_bf16", *cpu_decode_program.KERNELS)
needs_kernels = pytest.mark.skipif(cpu_library.missing(*PROGRAM_KERNELS) is not None,
                                   reason=str(cpu_library.missing(*PROGRAM_KERNELS)))
# head size 32 (the paged C kernel takes multiples of 32), widths multiples of 16
SHAPE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96}
BASE = {"max_model_len": 128, "kv_cache_gb": 0.05}
# no prefix caching: the second run of a prompt must prefill it whole, as the first did


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("program"), seed=4, **SHAPE)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """q/k/v biases (column-parallel, added by the GEMM) and random norm weights."""
    return make_tiny_model(tmp_path_factory.mktemp("program-qwen2"), "qwen2", seed=5, random_biases=True, **SHAPE)


class Counting:
    """The runner's program, counting the steps it ran."""

    def __init__(self, program):
        self.program, self.calls = program, 0

    def __call__(self, *args):
        self.calls += 1
        return self.program(*args)


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple]:
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs = engine.generate([(str(i), p, sp) for i, p in enumerate(prompts)])
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob,
             [sorted((k, v.logprob) for k, v in pos.items()) for pos in o.outputs[0].logprobs]) for o in outs]


@needs_kernels
@pytest.mark.parametrize("arch, dtype, quantization", [
    ("llama", "float32", None), ("llama", "bfloat16", None), ("llama", "float32", "int8"),
    ("llama", "bfloat16", "int8"), ("llama", "bfloat16", "int4"), ("qwen2", "float32", None),
    ("qwen2", "bfloat16", "int4")])
def test_program_equals_the_model_forward(request, arch, dtype, quantization):
    model = request.getfixturevalue(arch)
    engine = LLMEngine(EngineConfig(model=str(model), dtype=dtype, quantization=quantization,
                                    enable_prefix_caching=False, **BASE))
    runner = engine.runner
    assert runner.backend.program is not None
    g = torch.Generator().manual_seed(1)
    batches = [[torch.randint(3, 1001, (n,), generator=g).tolist() for n in lens]
               for lens in ([7], [3, 17, 40], [5 + i for i in range(11)])]  # 1, 3 and 11 rows a step
    counting = Counting(runner.backend.program)
    runner.backend.program = counting
    with_program = [run(engine, b) for b in batches]
    assert counting.calls == 3 * 9  # every decode step (10 tokens: 1 from the prefill, 9 decodes a batch)
    runner.backend.program = None
    assert [run(engine, b) for b in batches] == with_program


def test_program_declines_what_it_does_not_cover(tmp_path):
    """q/k norms (Qwen3), head size 16, C kernels off: no program; those models keep the forward."""
    qwen3 = make_tiny_model(tmp_path, "qwen3", name="qwen3", head_dim=32, intermediate_size=96)
    small_heads = make_tiny_model(tmp_path, name="d16")  # hidden 64 / 4 heads
    for model, cpu_kernels in ((qwen3, True), (small_heads, True)):
        engine = LLMEngine(EngineConfig(model=str(model), cpu_kernels=cpu_kernels, **BASE))
        assert engine.runner.backend.program is None
    llama = make_tiny_model(tmp_path, name="llama", **SHAPE)
    engine = LLMEngine(EngineConfig(model=str(llama), cpu_kernels=False, **BASE))
    assert engine.runner.backend.program is None
    assert cpu_decode_program.build(engine.runner.model.model, 1, cpu_kernels=False) is None
    if not cpu_library.has(*PROGRAM_KERNELS):  # no C kernels on this machine: no program even where cpu_kernels is on
        assert LLMEngine(EngineConfig(model=str(llama), **BASE)).runner.backend.program is None
