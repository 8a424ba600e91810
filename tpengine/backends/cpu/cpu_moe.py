"""A mixture-of-experts block's one-token decode step in three C calls (``cpu_blocked.c``'s grouped kernels).

:func:`tpengine.model.layers.moe.grouped_experts` runs a batch-1 step as ``top_k`` experts, each a
gate/up linear, an activation and a down linear, then a scale and an add: about six calls per expert,
each paying a thread start-up and a Python dispatch on a weight of a few hundred KiB. Bound here, the
step is one GEMV over every routed expert's gate/up weight (``tpe_blocked_group_bf16``), the activation
over the experts' rows at once (the layer's bound kernel), and one call that runs the experts' down
projections and sums them with their routing weights (``tpe_blocked_moe_down_bf16``), in the order and
with the roundings of the generic path (each expert's product rounded to bfloat16, scaled, rounded,
added, rounded; experts in ascending index). The weights stay where the loader put them, in the blocked
layout (:mod:`tpengine.backends.cpu.cpu_blocked`): this binds only where the layout choice gave the
experts' shapes that layout, which it times there as this grouped call, per expert
(:func:`tpengine.backends.cpu.linear_layout.measure`).
"""

from __future__ import annotations

import ctypes

import torch

from tpengine.backends.cpu import cpu_blocked, cpu_library


def group_gemv(x: torch.Tensor, blocked: list[torch.Tensor]) -> torch.Tensor:
    """``[x @ w.T for w in weights]`` stacked: ``x [1, k]`` bfloat16 against ``g`` blocked weights of one
    shape (:func:`tpengine.backends.cpu.cpu_blocked.pack`) in one call -> ``[g, n]`` (float32 sums, rounded
    once).

    Raises:
        ValueError: weights not blocked or of different shapes, or ``x`` not one contiguous bfloat16 row of their
            width.
    """
    b0 = blocked[0]
    if (not all(cpu_blocked.is_blocked(b) and b.shape == b0.shape for b in blocked) or x.dtype != torch.bfloat16
            or x.shape != (1, cpu_blocked.shape(b0)[1]) or not x.is_contiguous()):
        raise ValueError(f"group_gemv: x bfloat16 [1, k] against blocked weights of one shape; got x {x.dtype} "
                         f"{tuple(x.shape)}, weights {[(b.dtype, tuple(b.shape)) for b in blocked]}")
    n, k = cpu_blocked.shape(b0)
    y = torch.empty(len(blocked), n, dtype=x.dtype)
    ptrs = (ctypes.c_int64 * len(blocked))(*(b.data_ptr() for b in blocked))
    cpu_library.load().tpe_blocked_group_bf16(x.data_ptr(), 0, k, ptrs, len(blocked), n, y.data_ptr(),
                                              torch.get_num_threads())
    return y


def bind(block, dtype: torch.dtype):
    """``run(x [1, hidden], weights [1, top_k], experts [1, top_k]) -> [1, hidden]`` for a
    :class:`tpengine.model.layers.moe.MoEBlock` whose experts this rank holds in bfloat16 in the blocked
    layout (both linears of every expert) with an activation kernel (``bound_act``); else None. The result
    is the block's routed sum before the shared expert and the all-reduce, what
    :func:`~tpengine.model.layers.moe.grouped_experts` returns for one token."""
    experts = block.local
    if dtype != torch.bfloat16 or not experts or not cpu_library.has(*cpu_blocked.KERNELS):
        return None
    if any(e.bound_act is None or not all(lin.quant is None and cpu_blocked.is_blocked(lin.packed)
                                          for lin in (e.gate_up_proj, e.down_proj)) for e in experts):
        return None
    lib = cpu_library.load()
    gate_up, down = lib.tpe_blocked_group_bf16, lib.tpe_blocked_moe_down_bf16
    gu = [e.gate_up_proj.packed.data_ptr() for e in experts]
    dw = [e.down_proj.packed.data_ptr() for e in experts]
    act, first, count = experts[0].bound_act, block.first, len(experts)
    two_inter, hidden = cpu_blocked.shape(experts[0].gate_up_proj.packed)
    inter = two_inter // 2

    def run(x: torch.Tensor, weights: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        ids, ws = routed[0].tolist(), weights[0].float().tolist()  # the layer's one host read
        pairs = sorted((e - first, w) for e, w in zip(ids, ws) if first <= e < first + count)
        out = torch.zeros_like(x)
        g = len(pairs)
        if not g:
            return out
        nthreads = torch.get_num_threads()
        y = torch.empty(g, two_inter, dtype=dtype)
        gate_up(x.data_ptr(), 0, hidden, (ctypes.c_int64 * g)(*(gu[i] for i, _ in pairs)), g, two_inter,
                y.data_ptr(), nthreads)
        h = act(y)
        down(h.data_ptr(), inter, (ctypes.c_int64 * g)(*(dw[i] for i, _ in pairs)), g, hidden,
             (ctypes.c_float * g)(*(w for _, w in pairs)), out.data_ptr(), nthreads)
        return out
    return run
