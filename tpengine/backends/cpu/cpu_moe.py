"""A mixture-of-experts block's one-token decode step in one C call (``cpu_blocked.c``'s grouped kernels).

:func:`tpengine.model.layers.moe.grouped_experts` runs a batch-1 step as ``top_k`` experts, each a
gate/up linear, an activation and a down linear, then a scale and an add: about six calls per expert,
each paying a thread start-up and a Python dispatch on a weight of a few hundred KiB, after a router of
six torch ops. Bound here, the step is one call (``tpe_moe_decode_bf16``): the router, one GEMV over every
routed expert's gate/up weight (``tpe_blocked_group_bf16``), the activation over the experts' rows at once,
and the experts' down projections summed with their routing weights (``tpe_blocked_moe_down_bf16``), in
the order and with the roundings of the generic path (each expert's product rounded to bfloat16, scaled,
rounded, added, rounded; experts in ascending index). The weights stay where the loader put them, in the blocked
layout (:mod:`tpengine.backends.cpu.cpu_blocked`): this binds only where the layout choice gave the
experts' shapes that layout, which it times there as this grouped call, per expert
(:func:`tpengine.backends.cpu.linear_layout.measure`).
"""

from __future__ import annotations

import ctypes

import torch

from tpengine.backends.cpu import cpu_blocked, cpu_gemv, cpu_library


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


#: an expert's activation (``Expert.activation``) -> the ``act`` argument of ``tpe_moe_decode_bf16``
ACTS = {"silu": (0, "tpe_silu_mul"), "gelu_tanh": (1, "tpe_gelu_tanh_mul")}


def bind(block, dtype: torch.dtype):
    """``run(x [1, hidden] contiguous) -> [1, hidden]`` for a :class:`tpengine.model.layers.moe.MoEBlock`
    whose experts this rank holds in bfloat16 in the blocked layout (both linears of every expert), whose
    activation has a kernel (:data:`ACTS`) and whose router's plain weight the GEMV kernel takes; else None.
    One C call (``tpe_moe_decode_bf16``) routes the token and runs its experts on this rank; the result is
    the block's routed sum before the shared expert and the all-reduce, what
    :meth:`~tpengine.model.layers.moe.MoEBlock.route` and :func:`~tpengine.model.layers.moe.grouped_experts`
    give for one token (a routing weight may differ in its last float32 bit: the exp and sums are C's)."""
    experts, router = block.local, block.gate.weight
    if (dtype != torch.bfloat16 or not experts or experts[0].activation not in ACTS
            or not cpu_library.has(*cpu_blocked.KERNELS, "tpe_moe_decode_bf16", ACTS[experts[0].activation][1])
            or router.dtype != dtype or not cpu_gemv.available(router) or block.num_experts > 256 or block.top_k > 64):
        return None
    if not all(lin.quant is None and cpu_blocked.is_blocked(lin.packed)
               for e in experts for lin in (e.gate_up_proj, e.down_proj)):
        return None
    fn = cpu_library.load().tpe_moe_decode_bf16
    gu = (ctypes.c_int64 * len(experts))(*(e.gate_up_proj.packed.data_ptr() for e in experts))
    dw = (ctypes.c_int64 * len(experts))(*(e.down_proj.packed.data_ptr() for e in experts))
    two_inter, hidden = cpu_blocked.shape(experts[0].gate_up_proj.packed)
    args = (router.data_ptr(), block.num_experts, block.top_k, int(block.renormalize), int(block.weights_in_dtype),
            block.first, len(experts), gu, dw, two_inter // 2, ACTS[experts[0].activation][0])

    def run(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        fn(x.data_ptr(), hidden, *args, out.data_ptr(), torch.get_num_threads())
        return out
    run.keep = (gu, dw, router)  # (the addresses stay valid while the block lives)
    return run
