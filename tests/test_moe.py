"""Mixture-of-experts models (issue 56): tiny random Mixtral and Qwen3-MoE (8 experts, top 2, 3 layers; Qwen3-MoE's
layer 1 dense through ``mlp_only_layers``) token for token equal to HF ``generate`` in float32, under tensor
parallelism at tp 1 (``LLM``), 2, 3 and 4 (Mixtral) and expert parallelism at 2 and 3 ranks (8 experts:
4+4, 3+3+2) (Qwen2-MoE, its shared expert behind a sigmoid gate: TP and EP at 2 ranks),
with chunked prefill, a prefix-cache hit, n-gram speculation and per-expert int8 weights; the batch job at
EP 3; the grouped expert step against a per-token loop; the plan's expert layout; the refusals.

One launch per rank count runs every engine job (tests/workers/engine_generate.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model, tiny_config
from hf_reference import greedy
from launch import cli, run_engine_jobs

from tpengine.errors import UserError

MODELS = {"mixtral": "mixtral", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
#: rank count -> the models and layouts run there (Qwen2-MoE's shared expert: TP and EP at 2 ranks; tp 4: Mixtral)
LAYOUTS = {2: {"mixtral": ("tp", "ep"), "qwen3moe": ("tp", "ep"), "qwen2moe": ("tp", "ep")},
           3: {"mixtral": ("tp", "ep"), "qwen3moe": ("tp", "ep")}, 4: {"mixtral": ("tp",)}}
NEW = 10
GREEDY = {"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": 64}


def prompts() -> list[list[int]]:
    """Four random prompts, a fifth sharing the 37-token one's first 32 (a prefix-cache hit), a sixth that
    repeats itself (the n-gram proposer drafts)."""
    g = torch.Generator().manual_seed(5)
    out = [torch.randint(3, 1001, (n,), generator=g).tolist() for n in (5, 37, 1, 12)]
    return out + [out[1][:32] + torch.randint(3, 1001, (6,), generator=g).tolist(), [7, 8, 9, 10] * 6]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Mixtral as HF writes it (``block_sparse_moe.experts.E.w1/w3/w2``); Qwen3-MoE with its experts stored
    fused as transformers 5 holds them (``mlp.experts.gate_up_proj [E, 2 I, H]``, ``down_proj [E, H, I]``),
    which HF loads as they are."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe")
    # (hidden 64, intermediate 96 for Qwen3-MoE's dense layer; each expert 32 wide: int8's rows of 16)
    out = {name: make_tiny_model(root, arch, name=name, seed=4, num_hidden_layers=3, intermediate_size=96
                                 if arch != "mixtral" else 32) for name, arch in MODELS.items()}
    state = AutoModelForCausalLM.from_pretrained(out["qwen3moe"]).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file({k: v.contiguous() for k, v in state.items()}, out["qwen3moe"] / "model.safetensors",
              metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def hf(models):
    return {name: greedy(d, prompts(), NEW, stop_at_eos=False, attn="eager", batched=False)
            for name, d in models.items()}


def cfg(d, **kw) -> dict:
    return {"model": str(d), "dtype": "float32", "max_model_len": 256, "kv_cache_gb": 0.05, "cpu_linear": "plain",
            **kw}


def reqs(ids=None) -> list[list]:
    ps = prompts()
    return [[f"p{i}", ps[i], GREEDY] for i in (ids if ids is not None else range(len(ps)))]


def jobs_for(models, ranks: int) -> list[dict]:
    jobs = []
    for name, layouts in LAYOUTS[ranks].items():
        d = models[name]
        for layout in layouts:
            # chunks of 16 tokens, the shared prompt after the one it shares with (a prefix-cache hit)
            jobs.append({"key": f"{name}/{layout}", "config": cfg(d, max_num_batched_tokens=16,
                                                                 enable_expert_parallel=layout == "ep"),
                         "waves": [reqs([0, 1, 2, 3, 5]), reqs([4])]})
        if ranks == 2 and name != "qwen2moe":
            jobs.append({"key": f"{name}/spec", "config": cfg(d, speculative_config=SPEC, num_kv_blocks=6),
                         "requests": reqs()})
            for ep in (False, True):
                jobs.append({"key": f"{name}/int8-{ep}", "config": cfg(d, quantization="int8",
                                                                        enable_expert_parallel=ep),
                             "requests": reqs(range(4))})
    if ranks == 2:  # int4 (group 32): each 32-wide expert whole under EP (TP would cut its groups: refused)
        jobs.append({"key": "mixtral/int4-ep", "config": cfg(models["mixtral"], quantization="int4",
                                                             enable_expert_parallel=True), "requests": reqs(range(4))})
    return jobs


@pytest.fixture(scope="module")
def results(models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe-runs")
    return {n: run_engine_jobs(tmp, n, jobs_for(models, n)) for n in (2, 3, 4)}


def tokens(result: dict) -> list[list[int]]:
    got = {o["request_id"]: o["token_ids"] for o in result["outputs"]}
    return [got[f"p{i}"] for i in range(len(got))]


@pytest.mark.parametrize("name", list(MODELS))
def test_tp_and_ep_equal_hf(hf, results, name):
    """TP at 2, 3, 4 and EP at 2 and 3 ranks: HF's tokens, with chunked prefill and a prefix-cache hit."""
    for ranks in LAYOUTS:
        for layout in LAYOUTS[ranks].get(name, ()):
            job = results[ranks][f"{name}/{layout}"]
            assert tokens(job) == hf[name], (ranks, layout)
            assert job["stats"]["cached_prompt_tokens"] >= 32, job["stats"]


@pytest.mark.parametrize("name", ["mixtral", "qwen3moe"])
def test_speculation_and_int8_experts(hf, results, name):
    """n-gram speculation with preemption at tp 2 keeps HF's tokens; int8 experts (quantized per expert) give
    the same tokens under TP and EP (per-channel scales: a row's whole max either way)."""
    job = results[2][f"{name}/spec"]
    assert tokens(job) == hf[name] and job["stats"]["num_preemptions"] > 0, job["stats"]
    tp, ep = tokens(results[2][f"{name}/int8-False"]), tokens(results[2][f"{name}/int8-True"])
    assert tp == ep and all(len(t) == NEW for t in tp)


def test_llm_tp1_and_batch_job_ep3(models, hf, results, tmp_path):
    """``LLM`` in this process at tp 1 (both families; Mixtral's int4 experts give EP 2's int4 tokens), and
    the batch job (``tpengine.run``) with ``--enable-expert-parallel`` at 3 ranks (8 experts: 3, 3, 2) on
    Mixtral."""
    from tpengine import LLM, SamplingParams

    greedy_params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    for name, quant, want in (("mixtral", None, hf["mixtral"]), ("qwen3moe", None, hf["qwen3moe"]),
                              ("mixtral", "int4", tokens(results[2]["mixtral/int4-ep"]))):
        with LLM(str(models[name]), dtype="float32", max_model_len=256, kv_cache_gb=0.05, quantization=quant,
                 cpu_linear="plain") as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts()[:len(want)]], greedy_params)
            assert [list(o.outputs[0].token_ids) for o in outs] == want, (name, quant)
    src, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt_token_ids": p, **GREEDY}) + "\n"
                           for i, p in enumerate(prompts())))
    cli(["--prompts", str(src), "--model", str(models["mixtral"]), "--out", str(out), "--dtype", "float32",
         "--max-model-len", "256", "--enable-expert-parallel"], tp=3)
    got = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert [got[f"p{i}"] for i in range(len(prompts()))] == hf["mixtral"]


def test_grouped_experts_equal_per_token_loop():
    """The grouped step (tokens sorted by expert, each expert's GEMMs once) equals a loop over tokens and
    their k experts, for a layer holding every expert and for two EP ranks' halves summed; a batch-1 step
    runs only its k experts."""
    from tpengine.model.layers.moe import MoEBlock

    torch.manual_seed(0)
    hidden, inter, n, k, rows = 16, 8, 6, 2, 11

    def block(experts: tuple[int, int], whole: bool) -> MoEBlock:
        b = MoEBlock(hidden, n, k, experts, inter, whole, True, False, torch.nn.SiLU(), torch.float64)
        return b.to_empty(device="cpu")

    full = block((0, n), False)
    for p in full.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(rows, hidden, dtype=torch.float64)
    weights, experts = full.route(x)
    want = torch.zeros_like(x)
    for t in range(rows):
        for j in range(k):
            e = full.experts[str(int(experts[t, j]))]
            gu = x[t] @ e.gate_up_proj.weight.T
            want[t] += weights[t, j] * ((torch.nn.functional.silu(gu[:inter]) * gu[inter:]) @ e.down_proj.weight.T)
    assert torch.allclose(full(x), want, atol=1e-10)
    halves = [block((0, 3), True), block((3, 6), True)]
    for half in halves:
        half.load_state_dict({k2: v for k2, v in full.state_dict().items() if k2 in half.state_dict()})
    assert torch.allclose(sum(h(x, reduce=False) for h in halves), want, atol=1e-10)
    calls = []
    for i, e in enumerate(full.local):
        e.register_forward_hook(lambda m, a, o, i=i: calls.append(i))
    one = full(x[:1])  # (the batch-1 path: no sort)
    assert sorted(calls) == sorted(experts[0].tolist()) and torch.allclose(one, want[:1], atol=1e-10)
    assert torch.allclose(sum(h(x[:1], reduce=False) for h in halves), want[:1], atol=1e-10)


def test_plan_expert_layout_and_refusals():
    """The plan: TP splits each expert's intermediate, EP gives whole experts (8 on 3 ranks: 3, 3, 2) and
    survives its manifest round trip; the refusals name the numbers before any weight is read."""
    from tpengine.model.families import check_config
    from tpengine.model.plan import EXPERT_COLUMN, EXPERT_ROW, SHARED_ROW, ShardPlan
    from tpengine.model.surgery import holds, kind_of

    mix = tiny_config("mixtral")
    ep = ShardPlan.build(mix, 3, expert_parallel=True)
    assert [rp.experts for rp in ep.ranks] == [(0, 3), (3, 6), (6, 8)]
    assert all(rp.expert_intermediate == (0, 32) for rp in ep.ranks)
    assert ShardPlan.from_dict(json.loads(json.dumps(ep.to_dict()))) == ep
    tp = ShardPlan.build(mix, 3)
    assert [rp.expert_intermediate for rp in tp.ranks] == [(0, 11), (11, 22), (22, 32)]
    assert all(rp.experts == (0, 8) for rp in tp.ranks) and not tp.expert_parallel
    name = "model.layers.0.mlp.experts.4.{}.weight"
    assert kind_of(name.format("gate_proj"), 2) == EXPERT_COLUMN and kind_of(name.format("down_proj"), 2) == EXPERT_ROW
    assert kind_of("model.layers.0.mlp.gate.weight", 2) == "replicated"
    q2 = ShardPlan.build(tiny_config("qwen2_moe"), 3, expert_parallel=True)  # the shared expert: split as a dense MLP
    assert [rp.shared_expert_intermediate for rp in q2.ranks] == [(0, 16), (16, 32), (32, 48)]
    assert kind_of("model.layers.0.mlp.shared_expert.down_proj.weight", 2) == SHARED_ROW
    assert kind_of("model.layers.0.mlp.shared_expert_gate.weight", 2) == "replicated"
    assert [holds(ep, name.format("up_proj"), r) for r in range(3)] == [False, True, False]
    assert tp.slice_spec(EXPERT_ROW, False, 2) == (1, 22, 32) and ep.slice_spec(EXPERT_ROW, False, 2) == (1, 0, 32)
    from tpengine.model.quant.weights import QuantScheme, check_quantization

    check_quantization(mix, 2, QuantScheme.of("int4"), expert_parallel=True)
    with pytest.raises(UserError, match=r"the row-parallel layer mlp\.experts\.\*\.down_proj splits its input at "
                                        r"column 16, not on a group boundary \(a multiple of 32\); valid tp sizes: 1$"):
        check_quantization(mix, 2, QuantScheme.of("int4"))
    # a stored (--keep-quant / split --quantize) folder is checked against the launch's layout the same way
    from pathlib import Path

    from tpengine.distributed import TPInfo
    from tpengine.model.quant.checkpoint import QuantEntry
    from tpengine.model.quant.load import check_stored_quantization

    table = {name.format("down_proj"): QuantEntry("int4", 32)}
    tp2 = TPInfo(rank=0, size=2, local_rank=0, device=torch.device("cpu"))
    check_stored_quantization(Path("q"), table, None, [], mix, tp2, expert_parallel=True)
    with pytest.raises(UserError, match=r"^the quantized folder 'q' .* cannot run at tp=2: .* splits its input at "
                                        r"column 16"):
        check_stored_quantization(Path("q"), table, None, [], mix, tp2)
    from tpengine.model.estimate import activation_bytes

    assert ep.top_k == 2 and activation_bytes(ep, 0, 4, 16, 1) > activation_bytes(tp, 0, 4, 16, 1)  # whole experts
    big = tiny_config("mixtral", num_attention_heads=16, num_key_value_heads=16, intermediate_size=12)
    assert ShardPlan.valid_tp_sizes(big, expert_parallel=False) == list(range(1, 13))
    assert ShardPlan.valid_tp_sizes(big, expert_parallel=True) == list(range(1, 9))
    assert ShardPlan.valid_tp_sizes(big) == list(range(1, 13))  # (either layout)
    dense = ShardPlan.build(tiny_config("llama"), 2, expert_parallel=True)
    assert dense.num_experts == 0 and not dense.expert_parallel
    with pytest.raises(UserError) as e:
        ShardPlan.build(tiny_config("mixtral", num_attention_heads=16, num_key_value_heads=16), 9,
                        expert_parallel=True)
    assert str(e.value) == (
        "model_type 'mixtral': enable_expert_parallel puts whole experts on each of the 9 ranks, but the model has "
        "8 experts per layer; use at most 8 ranks, or tensor parallelism for the experts (without "
        "--enable-expert-parallel)")
    with pytest.raises(UserError, match=r"intermediate size 2 cannot be split over 4 ranks; use at most 2 ranks, "
                                        r"or --enable-expert-parallel"):
        ShardPlan.build(tiny_config("qwen3_moe", moe_intermediate_size=2), 4)
    for bad, message in ((dict(num_experts_per_tok=9), "num_experts_per_tok=9 must be an integer between 1 and "
                                                       "num_local_experts=8"),
                         (dict(scoring_func="sigmoid"), "scoring_func='sigmoid' (the router's scoring) is not "
                                                        "supported; tpengine's router computes 'softmax' over the "
                                                        "experts, then the top k")):
        with pytest.raises(UserError) as e:
            check_config(tiny_config("mixtral", **bad))
        assert str(e.value) == f"model_type 'mixtral': {message}"


def test_ep_refusal_in_the_job_is_one_line(tmp_path):
    """EP over more ranks than experts in the batch job (a model of 2 experts at 3 ranks): each rank's
    ``UserError`` line, exit 2, before any weight is read."""
    d = make_tiny_model(tmp_path, "mixtral", num_local_experts=2, num_experts_per_tok=1)
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 2}) + "\n")
    r = cli(["--prompts", str(src), "--model", str(d), "--out", str(tmp_path / "o.jsonl"),
             "--enable-expert-parallel"], tp=3, check=False)
    lines = [ln for ln in r.stderr.splitlines() if "failed: UserError" in ln]
    # (the first rank to exit ends the others, which may not have printed theirs yet)
    assert lines and "exited with 2" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[0].endswith(": model_type 'mixtral': enable_expert_parallel puts whole experts on each of the 3 "
                             "ranks, but the model has 2 experts per layer; use at most 2 ranks, or tensor "
                             "parallelism for the experts (without --enable-expert-parallel)")


def test_cuda_runs_moe_without_graphs(monkeypatch):
    """A model with MoE blocks (their grouping reads counts on the host) gets no CUDA graph runner; a dense
    one gets one (the runner stubbed: no GPU here)."""
    from types import SimpleNamespace

    import tpengine.backends.cuda.graphs as graphs
    from tpengine.backends.cuda.platform import CUDAPlatform
    from tpengine.model.layers.moe import MoEBlock

    class Runner:
        def __init__(self, model, *args):
            self.model = model

        def capture(self):
            pass

    monkeypatch.setattr(graphs, "CUDAGraphRunner", Runner)
    config = SimpleNamespace(enforce_eager=False, max_num_seqs=4, max_model_len=64, block_size=16)
    backend, cpu = SimpleNamespace(graph_safe=True), torch.device("cpu")
    moe = torch.nn.Sequential(MoEBlock(16, 4, 2, (0, 4), 8, False, True, False, torch.nn.SiLU(), torch.float32))
    dense = torch.nn.Sequential(torch.nn.Identity())
    assert CUDAPlatform().step_runner(moe, backend, config, 16, torch.float32, cpu) is None
    assert CUDAPlatform().step_runner(dense, backend, config, 16, torch.float32, cpu).model is dense


def test_one_call_decode_step_equals_the_generic_path():
    """The CPU backend's one-token MoE step (:mod:`tpengine.backends.cpu.cpu_moe`: one C call routes the token and
    runs its experts in the blocked layout: a grouped gate/up GEMV, the activation, the down projections and
    the weighted sum) against the generic path on the same blocked weights: the same experts, outputs within one
    bfloat16 step (a routing weight may differ in its last float32 bit), bit-equal where the weights are rounded
    to bfloat16 (Mixtral's ``weights_in_dtype``), for SiLU and tanh GELU, a whole layer and an EP rank's half (a
    token whose experts are all on the other rank: zeros); experts in another layout: unbound. The combine alone
    (``tpe_blocked_moe_down_bf16``) is bit-equal to torch's ``out += (y * w).to(bfloat16)`` in expert order."""
    import ctypes

    from tpengine.backends.cpu import cpu_blocked, cpu_library, cpu_moe, layer_calls, linear_layout
    from tpengine.model.layers.moe import MoEBlock

    if not cpu_library.has(*cpu_blocked.KERNELS, "tpe_moe_decode_bf16", "tpe_silu_mul"):
        pytest.skip("this build has no blocked or MoE decode kernels")
    torch.manual_seed(1)
    dtype, hidden, inter, n, k = torch.bfloat16, 64, 32, 8, 3
    cases = [(False, (0, 8), torch.nn.SiLU()), (True, (0, 8), torch.nn.GELU(approximate="tanh")),
             (True, (4, 8), torch.nn.SiLU()), (False, (4, 8), torch.nn.SiLU())]
    for in_dtype, experts, act in cases:
        b = MoEBlock(hidden, n, k, experts, inter, True, True, in_dtype, act, dtype).to_empty(device="cpu")
        for p in b.parameters():
            torch.nn.init.normal_(p, std=0.2)
        for e in b.local:
            e.bound_act = layer_calls.bind_act(e, dtype)
        assert cpu_moe.bind(b, dtype) is None  # (plain experts: the per-expert path)
        for e in b.local:
            for lin in (e.gate_up_proj, e.down_proj):
                assert lin.pack(lambda w: linear_layout.prepack(w, "blocked"))
                lin.bind(linear_layout.bind_linear(None, None, lin.packed))
        one = cpu_moe.bind(b, dtype)
        for _ in range(8):
            x = torch.randn(1, hidden, dtype=dtype)
            b.bound_decode = None
            want, (w, routed) = b(x, reduce=False), b.route(x)
            b.bound_decode = one
            got = b(x, reduce=False)
            here = sorted(e - experts[0] for e in routed[0].tolist() if experts[0] <= e < experts[1])
            assert bool(got.abs().sum()) == bool(here)
            if in_dtype:
                assert torch.equal(got, want), (experts, (got.float() - want.float()).abs().max())
            else:
                assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
            if here:  # the combine on its own: bit-equal to torch's
                ys = [b.local[i](x) for i in here]
                ws = {e - experts[0]: v for e, v in zip(routed[0].tolist(), w[0].tolist())}
                h = torch.cat([b.local[i].bound_act(b.local[i].gate_up_proj(x)) for i in here])
                out = torch.empty_like(x)
                cpu_library.load().tpe_blocked_moe_down_bf16(
                    h.data_ptr(), inter, (ctypes.c_int64 * len(here))(
                        *(b.local[i].down_proj.packed.data_ptr() for i in here)), len(here), hidden,
                    (ctypes.c_float * len(here))(*(ws[i] for i in here)), out.data_ptr(), 2)
                ref = torch.zeros_like(x)
                for i, y in zip(here, ys):
                    ref += (y * w.new_tensor([ws[i]])).to(dtype)
                assert torch.equal(out, ref)
