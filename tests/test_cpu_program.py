"""The CPU decode program (tpengine/backends/cpu/cpu_program.py): a one-token step of the decoder stack as
one C call of the layers' own bound kernels. It must give what the stack's forward gives through those
kernels -- the same tokens and logprobs, bit for bit -- for every kind of product it encodes (the GEMV
kernel in float32 and bfloat16, the blocked layout in both, int8 and int4 weights, an int8 KV cache), take
exactly the one-token decode steps, and be refused where the stack's form or a kernel does not allow it."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_model

from tpengine.backends.cpu import (
    cpu_blocked,
    cpu_fused,
    cpu_library,
    cpu_program,
    cpu_qgemv,
    layer_calls,
    linear_layout,
    shm,
)
from tpengine.config import EngineConfig
from tpengine.engine.llm_engine import LLMEngine
from tpengine.sampling_params import SamplingParams

KERNELS = ("tpe_program_run", "tpe_paged_decode_f32", "tpe_paged_decode_bf16", "tpe_gemv_f32", "tpe_gemv_bf16",
           *layer_calls.KERNELS)
needs_kernels = pytest.mark.skipif(cpu_library.missing(*KERNELS) is not None, reason=str(cpu_library.missing(*KERNELS)))
SHAPE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96}
BASE = {"max_model_len": 128, "kv_cache_gb": 0.05, "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("program"), seed=6, **SHAPE)


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple]:
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs = engine.generate([(str(i), p, sp) for i, p in enumerate(prompts)])
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob,
             [sorted((k, v.logprob) for k, v in pos.items()) for pos in o.outputs[0].logprobs]) for o in outs]


def linears(stack):
    for layer in stack.layers:
        yield from (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


def pin_kernels(engine: LLMEngine) -> None:
    """Every product's one-row path on a C kernel, whatever this machine measured: a plain weight on the
    GEMV kernel up to 8 rows, a quantized one on its GEMV kernel (with int8 activations where that is a
    candidate: bfloat16 int4 and int8); then the backend binds again."""
    stack = engine.runner.model.model
    for m in linears(stack):
        if m.quant is not None:
            m.quant.gemv_rows, m.quant.q8_rows = 8, 8 if cpu_qgemv.q8_takes(m.quant) else 0
        elif m.packed is None:
            m.kernels = ("gemv", "gemv", "plain")
        m.bind(linear_layout.bind_layer(m))
    engine.runner.backend.bind_model(stack, 1)


CASES = [("float32", None, "plain", None), ("bfloat16", None, "plain", None), ("bfloat16", "int8", "auto", None),
         ("float32", "int4", "auto", None), ("bfloat16", "int4", "auto", None), ("bfloat16", None, "plain", "int8"),
         ("bfloat16", None, "blocked", None), ("float32", None, "blocked", None)]


@needs_kernels
@pytest.mark.parametrize("dtype, quantization, cpu_linear, kv", CASES)
def test_program_equals_the_forward(llama, dtype, quantization, cpu_linear, kv):
    if cpu_linear == "blocked" and not cpu_blocked.available(torch.zeros(16, 2, dtype=getattr(torch, dtype))):
        pytest.skip(f"no blocked layout in this build ({cpu_library.isa()})")
    engine = LLMEngine(EngineConfig(model=str(llama), dtype=dtype, quantization=quantization, cpu_linear=cpu_linear,
                                    kv_cache_dtype=kv or "auto", **BASE))
    pin_kernels(engine)
    backend, stack = engine.runner.backend, engine.runner.model.model
    assert backend.program is not None, cpu_program.why_not(stack, backend.paged_calls, 1)
    # 4 ops a layer besides its products: 2 norms, the attention, the activation; and the final norm
    assert backend.program.n_ops == 2 * (4 + 4) + 1
    kinds = {backend.program.describe(i) for i in range(backend.program.n_ops)}
    want = {"q4" if quantization == "int4" else "q8" if quantization == "int8" else "lin"}
    assert kinds == {"norm", "act", "paged_i8" if kv else "paged"} | want
    if quantization and dtype == "bfloat16" and cpu_library.has(*cpu_qgemv.INT4_Q8_KERNELS, *cpu_qgemv.INT8_Q8_KERNELS):
        # the int8-activation kernels bound (int4 x int8, int8 x int8), called through the same signatures
        fn = ctypes.cast(getattr(cpu_library.load(), f"tpe_qgemv_{quantization}_q8"), ctypes.c_void_p).value
        assert {int(r[2]) for r in backend.program.ops if cpu_program.SIGNATURES[next(iter(want))] == r[0]} == {fn}
    if quantization:  # the quantized choice's program products (qgemv_choice.choose's ``program``): the layers'
        from tpengine.backends.cpu import platform as cpu_platform
        assert cpu_platform._program_quantized(engine.runner.model, getattr(torch, dtype), 1) == {
            id(m.quant) for m in linears(stack)}
    if cpu_linear == "blocked":  # every product the blocked layout's own GEMM, of the weights' dtype
        name = f"tpe_blocked_gemm_{'bf16' if dtype == 'bfloat16' else 'f32'}"
        fn = ctypes.cast(getattr(cpu_library.load(), name), ctypes.c_void_p).value
        assert {int(r[2]) for r in backend.program.ops if r[0] == cpu_program.SIGNATURES["lin"]} == {fn}
    program, steps = stack.bound_decode, []

    def counted(h, positions, ctx):
        out = program(h, positions, ctx)
        steps.append((h.shape[0], out is not None))
        return out
    stack.bound_decode = counted
    g = torch.Generator().manual_seed(2)
    batches = [[torch.randint(3, 1001, (n,), generator=g).tolist() for n in lens] for lens in ([9], [4, 21])]
    with_program = [run(engine, b) for b in batches]
    # the prefills and the 2-row decodes keep the forward's loop; the 9 one-row decodes take the program
    assert steps == [(9, False)] + [(1, True)] * 9 + [(25, False)] + [(2, False)] * 9
    stack.bound_decode = None  # the forward's own loop over the same bound kernels
    assert [run(engine, b) for b in batches] == with_program


GREEDY_CASES = [("float32", None, "plain"), ("bfloat16", None, "plain"), ("bfloat16", "int8", "auto"),
                ("bfloat16", "int4", "auto"), ("bfloat16", None, "blocked")]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("program_tied"), seed=7, tie_word_embeddings=True, **SHAPE)


@needs_kernels
@pytest.mark.parametrize("dtype, quantization, cpu_linear", GREEDY_CASES)
def test_the_programs_greedy_ids_equal_the_heads(tied, dtype, quantization, cpu_linear):
    """A greedy one-row step at one rank: the program ends with the tied head's product and the C argmax
    (one C call gives the id); the ids equal the head's own greedy path after the program, step for step."""
    if cpu_linear == "blocked" and not cpu_blocked.available(torch.zeros(16, 2, dtype=getattr(torch, dtype))):
        pytest.skip(f"no blocked layout in this build ({cpu_library.isa()})")
    engine = LLMEngine(EngineConfig(model=str(tied), dtype=dtype, quantization=quantization, cpu_linear=cpu_linear,
                                    **BASE))
    head = engine.runner.model.lm_head
    if head.quant is not None:  # the head's one-row path on its C kernel too (pin_kernels binds the program again)
        head.quant.gemv_rows, head.quant.q8_rows = 8, 8 if cpu_qgemv.q8_takes(head.quant) else 0
    elif head.packed is None:
        head.kernels = ("gemv", "gemv", "plain")
    head.bind(linear_layout.bind_layer(head, head=True))
    pin_kernels(engine)
    program = engine.runner.backend.program
    assert program.n_greedy == program.n_ops + 2, program.bind_greedy(head)
    assert [program.describe(i) for i in range(program.n_ops, program.n_greedy)] == [
        "q4" if quantization == "int4" else "q8" if quantization == "int8" else "lin", "argmax"]
    calls, greedy = [], program.greedy
    program.greedy = lambda *a: calls.append(1) or greedy(*a)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1001, (n,), generator=g).tolist() for n in (9, 5)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def ids():
        return [o.outputs[0].token_ids for o in (engine.generate([(str(i), p, sp)])[0] for i, p in enumerate(prompts))]
    with_head = ids()
    assert len(calls) == 2 * 11  # every one-row decode step of both requests
    program.n_greedy = 0  # the program, then the head's own product and greedy pick from Python
    assert ids() == with_head and len(calls) == 2 * 11


def test_what_the_program_refuses(tmp_path):
    """Biases (Qwen2's q/k/v), post-norms (Gemma 2), C kernels off, a weight whose one-row path is
    ``F.linear`` (forced plain layout, no kernels measured): no program, and the reason."""
    qwen2 = make_tiny_model(tmp_path, "qwen2", name="q2", **SHAPE)
    engine = LLMEngine(EngineConfig(model=str(qwen2), **BASE))
    pin_kernels(engine)
    r = engine.runner
    if cpu_library.missing(*KERNELS) is None:
        assert r.backend.program is None
        assert cpu_program.why_not(r.model.model, r.backend.paged_calls, 1) == \
            "a product without a C call at one row (or with a bias)"
        assert cpu_program.why_not(r.model.model, r.backend.paged_calls, 2) == \
            "tp > 1 without the row-parallel sums in the norms over shared memory"
    gemma2 = make_tiny_model(tmp_path, "gemma2", name="g2", **SHAPE)
    r = LLMEngine(EngineConfig(model=str(gemma2), **BASE)).runner
    assert r.backend.program is None and r.model.model.bound_decode is None
    if cpu_library.missing(*KERNELS) is None:
        assert cpu_program.why_not(r.model.model, r.backend.paged_calls, 1) == "post-norms or a missing pre-norm"
    llama = make_tiny_model(tmp_path, name="l", **SHAPE)
    off = LLMEngine(EngineConfig(model=str(llama), cpu_kernels=False, **BASE)).runner
    assert off.backend.program is None and off.model.model.bound_decode is None
    plain = LLMEngine(EngineConfig(model=str(llama), cpu_linear="plain", **BASE)).runner
    assert plain.backend.program is None
    if cpu_library.missing(*KERNELS) is None:
        assert cpu_program.why_not(plain.model.model, plain.backend.paged_calls, 1) == \
            "a product without a C call at one row (or with a bias)"
        # the shapes whose layouts are chosen for the program (linear_layout.choose_layouts): the llama's
        # q/k/v, o, gate/up and down; none for a form it refuses whatever the kernels
        assert cpu_program.product_shapes(plain.model, 1, torch.float32) == {(256, 128), (128, 128), (192, 128),
                                                                             (128, 96)}
        assert cpu_program.product_shapes(r.model, 1, torch.float32) == set()
        assert cpu_program.form_why_not(r.model.model, 1) == "post-norms or a missing pre-norm"
        assert cpu_program.product_shapes(engine.runner.model, 1, torch.float32) == set()


SLOT, N, EPS = 1 << 12, 64, 1e-5


def partial(rank: int, j: int) -> torch.Tensor:
    return torch.randn(1, N, generator=torch.Generator().manual_seed(10 * j + rank)).to(torch.bfloat16)


def shm_worker(rank: int, path: str, ready, out) -> None:
    """Rank ``rank`` of 2: a program of three all-reduce + add + RMSNorm ops chained as a stack's norms are
    (each one's residual output the next one's input), bfloat16. Rank 0 starts first: its first C wait
    runs out (1 ms) and hands the wait to Python; only then (``ready``) does rank 1 start."""
    shm.SPIN_NS = 1_000_000
    comm = shm.ShmComm(rank, 2, path, SLOT, timeout_s=30.0)
    prog, w = cpu_program.Program(N, torch.bfloat16), torch.linspace(0.5, 1.5, N).to(torch.bfloat16)
    prog.comm, res = comm, [prog.buffer(N), prog.buffer(N)]
    h, cur = cpu_program.Step(cpu_program.H_IN), None
    for j in range(3):
        t, y, h2 = prog.buffer(N), prog.buffer(N), res[j % 2]
        t.copy_(partial(rank, j))
        prog.shm_ops[len(prog.rows)] = (j, t, cur, w, EPS, h2, y)
        prog.add("shm_norm", "tpe_shm_all_reduce_add_rms_norm", [comm._base, comm.slot_bytes, 2, rank, j,
                                                                  t.data_ptr(), 1, N, 1, shm.SPIN_NS, h, w.data_ptr(),
                                                                  h2.data_ptr(), y.data_ptr(), EPS, 1])
        h, cur = h2.data_ptr(), h2
    prog.finish(y)
    codes, run_fn = [], prog.run_fn

    def traced(*a):
        codes.append(run_fn(*a))
        if rank == 0 and len(codes) == 1:
            ready.set()
        return codes[-1]
    prog.run_fn = traced
    if rank == 1:
        assert ready.wait(timeout=60)
    zero = torch.zeros(1, dtype=torch.int64)
    h_in = torch.linspace(-1, 1, N).to(torch.bfloat16).view(1, N)
    got = prog(h_in, SimpleNamespace(cos_p=0, sin_p=0), SimpleNamespace(slot_mapping=zero, context_lens=zero,
                                                                        block_tables=zero.view(1, 1)))
    want = h_in
    for j in range(3):
        want, y = cpu_fused.add_rms_norm(want, partial(0, j) + partial(1, j), w, EPS, True)
    out.put((rank, torch.equal(got, y), comm.gen, [(c >> 2, c & 3) if c >= 0 else c for c in codes]))


@pytest.mark.skipif(cpu_library.missing("tpe_program_run", "tpe_shm_all_reduce_add_rms_norm") is not None,
                    reason=str(cpu_library.missing("tpe_program_run", "tpe_shm_all_reduce_add_rms_norm")))
def test_a_late_peer_hands_the_wait_to_python_and_the_program_resumes(tmp_path):
    path = tmp_path / "shm"
    path.write_bytes(bytes(shm.HEADER + 2 * 2 * SLOT))
    ctx = mp.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=shm_worker, args=(r, str(path), ready, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [r[:3] for r in results] == [(0, True, 3), (1, True, 3)]
    # rank 0's first op published, then stopped waiting (2); it resumed from op 1 after Python's wait
    assert results[0][3][0] == (0, 2) and results[0][3][-1] == -1, results
