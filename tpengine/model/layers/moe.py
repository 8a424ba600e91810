"""A mixture-of-experts MLP under tensor or expert parallelism (Mixtral, Qwen3-MoE).

One decoder layer's sparse MLP: a router (``gate``, replicated) picks ``top_k`` of ``num_experts``
experts per token (:class:`tpengine.model.families.MoE` for each family's arithmetic), and each
picked expert's gated MLP ``down(act(gate(x)) * up(x))``, times its routing weight, is summed per
token. What a rank holds is its :class:`tpengine.model.plan.RankPlan`'s: every expert's slice of the
intermediate (tensor parallelism) or its own whole experts (expert parallelism); either way it
computes a partial sum of the layer's output for every token, and one all-reduce per layer combines
them (the rank's part of the sum is the sum of its experts' parts).

The step is not a loop over tokens: the ``T x top_k`` (token, expert) pairs are sorted by expert
(stable: token order within an expert), and each expert the step routes to and this rank holds runs
its gate/up GEMM, activation and down GEMM once over its rows, scaled by the rows' routing weights and
added into the output (``index_put_`` with ``accumulate``: HF's ``index_add_`` sums); a batch-1
decode step touches only its ``top_k`` experts' weights. An expert's linears are the same layers the dense MLP uses
(:mod:`tpengine.model.layers.linear`), so the loader packs or quantizes each expert's weights and the
platform binds each its kernels (on the CPU the measured bfloat16, int8 and int4 ones), per expert.
The grouping reads the per-expert counts on the host once per layer (vLLM's and SGLang's CPU paths do
the same); a CUDA graph cannot capture that, so a model with these layers runs its decode steps eagerly
on CUDA (:attr:`MoEBlock.graph_safe`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpengine.backends.torch_ops import TorchOps
from tpengine.comm import all_reduce
from tpengine.model.layers.fused import activation_kind
from tpengine.model.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear


class Router(nn.Module):
    """The router's weight ``[num_experts, hidden]`` (HF's ``mlp.gate.weight``), held whole on every rank and
    never quantized (as vLLM's ``ReplicatedLinear`` gate): ``[T, hidden]`` -> logits ``[T, num_experts]``
    in the weight's dtype, as HF's ``F.linear``."""

    def __init__(self, num_experts: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Expert(nn.Module):
    """One routed expert on this rank: ``gate_up_proj`` (parts ``gate_proj``, ``up_proj``, ``intermediate``
    local rows each) and ``down_proj``: under tensor parallelism its slice of the expert's intermediate (a
    :class:`RowParallelLinear` whose partial sum the block reduces), under expert parallelism the whole
    expert (a :class:`ColumnParallelLinear` with every output row: nothing of it on another rank, so an
    int8 weight's per-channel scale is its own rows'). ``[rows, hidden]`` -> ``[rows, hidden]`` (a partial
    sum under tensor parallelism), never all-reduced here."""

    def __init__(self, hidden: int, intermediate: int, whole: bool, act_fn: nn.Module, dtype: torch.dtype,
                 ops: TorchOps):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate],
                                                       ["gate_proj", "up_proj"], False, dtype)
        self.down_proj = (ColumnParallelLinear(intermediate, hidden, False, dtype) if whole
                          else RowParallelLinear(intermediate, hidden, False, dtype))
        self.intermediate, self.act_fn, self.ops = intermediate, act_fn, ops
        self.activation = activation_kind(act_fn)  # (as FusedMLP's: what the backend binds a kernel for)
        self.act_mul = {"silu": ops.silu_mul, "gelu_tanh": ops.gelu_tanh_mul}.get(self.activation)

    #: ``gate_up -> act(gate) * up`` bound by the backend (:func:`tpengine.backends.cpu.layer_calls.bind_stack`),
    #: or None: the generic ops below
    bound_act = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.bound_act is not None:
            h = self.bound_act(gate_up)
        elif self.act_mul is not None:
            h = self.act_mul(gate_up, self.intermediate)
        else:
            h = self.act_fn(gate_up[..., : self.intermediate]).mul_(gate_up[..., self.intermediate:])
        if isinstance(self.down_proj, RowParallelLinear):
            return self.down_proj(h, False)
        return self.down_proj(h)


class MoEBlock(nn.Module):
    """A decoder layer's sparse MLP (see the module docstring). ``[T, hidden]`` -> ``[T, hidden]``.

    ``experts``: the global indices ``[start, end)`` this rank holds (``RankPlan.experts``), each with
    ``intermediate`` local columns (``RankPlan.expert_intermediate_size``); ``whole``: the experts are whole
    (expert parallelism); ``renormalize`` / ``weights_in_dtype``: the family's router
    (:class:`tpengine.model.families.MoE`); ``act_fn``: HF's activation. Module names follow the checkpoint:
    ``gate`` (the router), ``experts.<global index>.gate_up_proj`` / ``.down_proj``. ``shared``: Qwen2-MoE's
    shared expert, a :class:`~tpengine.model.layers.fused.FusedMLP` of this rank's slice of its intermediate
    (``RankPlan.shared_expert_intermediate``) run on every token, scaled by ``sigmoid(shared_expert_gate(x))``
    (a ``[1, hidden]`` weight held whole) and added to the routed experts' sum (HF's ``Qwen2MoeSparseMoeBlock``);
    its partial sum joins the same all-reduce.
    """

    #: its grouping reads the per-expert counts on the host: a CUDA graph cannot capture the block
    graph_safe = False
    #: ``run(x [1, hidden]) -> [1, hidden]``: one token's routing and routed sum bound by the backend
    #: (:func:`tpengine.backends.cpu.cpu_moe.bind`: one C call), or None: :meth:`route` and :func:`grouped_experts`
    bound_decode = None

    def __init__(self, hidden: int, num_experts: int, top_k: int, experts: tuple[int, int], intermediate: int,
                 whole: bool, renormalize: bool, weights_in_dtype: bool, act_fn: nn.Module, dtype: torch.dtype,
                 ops: TorchOps | None = None, shared: nn.Module | None = None):
        super().__init__()
        self.ops = ops or TorchOps()
        self.gate = Router(num_experts, hidden, dtype)
        self.shared_expert = shared
        self.shared_expert_gate = Router(1, hidden, dtype) if shared is not None else None
        self.experts = nn.ModuleDict({str(e): Expert(hidden, intermediate, whole, act_fn, dtype, self.ops)
                                      for e in range(*experts)})
        self.num_experts, self.top_k, self.first = num_experts, top_k, experts[0]
        self.renormalize, self.weights_in_dtype = renormalize, weights_in_dtype
        self.local = list(self.experts.values())  # (a list: ModuleDict lookups per step cost as much as a kernel)

    def gated_mlps(self) -> list[nn.Module]:
        """This rank's experts, in global order, then the shared expert if any (what a backend binds an
        activation into)."""
        return self.local + ([self.shared_expert] if self.shared_expert is not None else [])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, top_k], experts [T, top_k] int64)`` for ``x [T, hidden]``, as HF computes them:
        the logits in ``x``'s dtype, softmax in float32 over every expert, the top k, renormalized where the
        family does, cast to ``x``'s dtype where the family does (else float32)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.weights_in_dtype:
            weights = weights.to(x.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce`` False: this rank's partial sum, not all-reduced (the next norm reduces it)."""
        if self.bound_decode is not None and x.shape[0] == 1:
            out = self.bound_decode(x.contiguous())
        else:
            weights, experts = self.route(x)
            out = grouped_experts(x, weights, experts, self.local, self.first, self.num_experts)
        if self.shared_expert is not None:  # (HF: routed + sigmoid(gate(x)) * shared(x))
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, False)
        return all_reduce(out) if reduce else out


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, local: list, first: int,
                    num_experts: int) -> torch.Tensor:
    """``sum_j weights[t, j] * expert[experts[t, j]](x[t])`` over the routed experts this rank holds
    (``local[i]`` is global expert ``first + i``), as ``[T, hidden]`` in ``x``'s dtype: the pairs sorted
    by expert, each held expert's rows run through it once, scaled (in float32 when ``weights`` are, then
    rounded, as HF) and added into the output in expert order (HF's order).

    Shapes: ``x [T, hidden]``, ``weights [T, k]`` (float32 or ``x``'s dtype), ``experts [T, k]`` int64.
    """
    k = experts.shape[1]
    if x.shape[0] == 1:  # batch-1 decode: no sort, its k experts in ascending order (HF's order of the sums)
        out = torch.zeros_like(x)
        ids = experts[0].tolist()  # the one host read of the layer
        for j in sorted(range(k), key=ids.__getitem__):
            if first <= ids[j] < first + len(local):  # ([1]-shaped weight: float32 promotes, as HF's)
                out += (local[ids[j] - first](x) * weights[0, j:j + 1]).to(out.dtype)
        return out
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the one host read of the layer
    rows, scale = order // k, weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = sum(counts[:first])
    for i, expert in enumerate(local):
        n = counts[first + i]
        if n:
            idx = rows[start:start + n]
            y = expert(x[idx]) * scale[start:start + n, None]
            # (HF's index_add_: the same sums, one token per row here; torch's CPU index_add_ costs
            # milliseconds a call where index_put_ costs microseconds, docs/notes/moe.md)
            out.index_put_((idx,), y.to(out.dtype), accumulate=True)
            start += n
    return out
