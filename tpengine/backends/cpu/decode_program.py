"""The CPU decode step's forward as a flat list of bound kernel calls.

At batch 1 a decode step of a small model spends as long in Python between the kernels as in them:
every layer goes through eight module calls, their attribute lookups, the argument checks of each
C kernel and a torch-op dispatch per fused op (measured in docs/notes/kernels.md).
:class:`CPUDecodeProgram` runs the same kernels in the same order on the same tensors as the
layers' own forward (:class:`tpengine.model.layers.fused.DecoderStack`) does in a decode step with
the CPU C kernels on -- so the results are bit for bit the same -- but with every per-weight and per-layer
check done once when it is built, and each layer's calls held as eight closures:

    h, x = norm1(h, delta)          residual add + RMSNorm (C)
    a = attn(qkv(x), step)          q/k/v GEMM; RoPE + KV store + paged attention (one C call)
    delta = o(a)                    row-parallel o_proj (+ all-reduce at tp > 1)
    h, x = norm2(h, delta)
    delta = down(silu(gate_up(x)))  gate/up GEMM, SiLU * up (C), row-parallel down_proj

Each linear's closure is the path its layer would take (:func:`tpengine.model.layers.linear.linear`:
the GEMV or GEMM kernel at the rows it was measured faster at, oneDNN's packed weight, MKL, or the
quantized weight's kernel). The paged attention kernel still checks every index before it writes
(an out-of-range slot or block id raises the checked path's exact error). Built by
:func:`build` when the CPU attention backend binds the model, and run by the backend's
``stack_forward`` for decode steps; a model it does not cover (Qwen3's q/k norms, a dtype or head
size the C kernels do not take, C kernels off) gets None and keeps the stack's own forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tpengine.backends.cpu import cpu_library, cpu_paged
from tpengine.comm import all_reduce
from tpengine.context import Context

Fn = Callable[[torch.Tensor], torch.Tensor]

#: the C functions the program calls besides the linears' and the paged kernel's (checked per layer)
KERNELS = ("tpe_add_rms_norm", "tpe_add_rms_norm_f32", "tpe_silu_mul", "tpe_silu_mul_f32")


def _linear(m, row_parallel: bool, tp: int, reduce: bool = True) -> Fn:
    """``x [rows, in]`` contiguous -> ``[rows, out]`` through layer ``m``'s own bound implementation
    (``m.impl``, :func:`tpengine.backends.cpu.linear_layout.bind_linear`: the same callable its
    forward runs), then, as the layer's forward does, the all-reduce and bias of a row-parallel
    layer at tp > 1 (``reduce`` False: its partial sum, which the next norm all-reduces)."""
    f, bias = m.impl or m.bind(), m.bias
    if not row_parallel or not reduce:
        return f
    if tp > 1:
        inner = f
        f = lambda x: all_reduce(inner(x))  # noqa: E731
    if bias is not None:
        unbiased = f
        f = lambda x: unbiased(x) + bias  # noqa: E731
    return f


def _norm(norm, dtype: torch.dtype, reduce: bool = False):
    """``(h, x | None) -> (h + x, rms_norm(h + x))`` through the C kernel, as
    :func:`tpengine.backends.cpu.cpu_fused.add_rms_norm` calls it; ``reduce``: ``x`` is a row-parallel
    partial sum, all-reduced first
    (:meth:`tpengine.backends.cpu.cpu_fused.FusedOps.all_reduce_add_rms_norm`)."""
    lib = cpu_library.load()
    fn = lib.tpe_add_rms_norm if dtype == torch.bfloat16 else lib.tpe_add_rms_norm_f32
    w, n, eps, ops = norm.weight.contiguous(), norm.weight.shape[0], float(norm.eps), norm.ops
    wp = w.data_ptr()

    def run(h: torch.Tensor, x: torch.Tensor | None):
        if reduce and x is not None:
            return ops.all_reduce_add_rms_norm(x, h, w, eps)
        y = torch.empty_like(h)
        if x is None:
            fn(h.data_ptr(), None, wp, None, y.data_ptr(), h.shape[0], n, eps, torch.get_num_threads())
            return h, y
        h2 = torch.empty_like(h)
        fn(h.data_ptr(), x.data_ptr(), wp, h2.data_ptr(), y.data_ptr(), h.shape[0], n, eps, torch.get_num_threads())
        return h2, y
    return run, w


def _silu(mlp, dtype: torch.dtype) -> Fn:
    lib = cpu_library.load()
    fn = lib.tpe_silu_mul if dtype == torch.bfloat16 else lib.tpe_silu_mul_f32
    inter = mlp.intermediate

    def run(gate_up: torch.Tensor) -> torch.Tensor:
        out = torch.empty(gate_up.shape[0], inter, dtype=dtype)
        fn(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter, torch.get_num_threads())
        return out
    return run


def _attention(attn, dtype: torch.dtype, amx_min_batch: int = 0):
    """``(qkv [B, (Hq + 2 Hkv) D] contiguous, step) -> [B, Hq D]``: RoPE, KV store and paged
    attention in one C call (:func:`tpengine.backends.cpu.cpu_paged.decode`'s, with its layout checks
    done here once; ``amx_min_batch`` its argument)."""
    lib = cpu_library.load()
    fn = lib.tpe_paged_decode_f32 if dtype == torch.float32 else lib.tpe_paged_decode_bf16
    hq, hkv, d, scale = attn.num_heads, attn.num_key_value_heads, attn.head_dim, float(attn.scaling)
    k_cache, v_cache, q_to_kv = attn.k_cache, attn.v_cache, attn.tp_q_to_kv
    nb, bs = k_cache.shape[:2]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype == dtype
            and tuple(k_cache.shape) == tuple(v_cache.shape) == (nb, bs, hkv, d) and q_to_kv.is_contiguous()):
        raise ValueError("decode program: the KV cache must be contiguous [blocks, block_size, Hkv, D] in the "
                         "model dtype")
    width, es = (hq + 2 * hkv) * d, torch.empty(0, dtype=dtype).element_size()
    kp, vp, mp = k_cache.data_ptr(), v_cache.data_ptr(), q_to_kv.data_ptr()

    def run(qkv: torch.Tensor, step: _Step) -> torch.Tensor:
        if attn.k_cache is not k_cache:
            raise RuntimeError("decode program: the layer's KV cache was replaced after the program was built")
        qkv = qkv.contiguous()  # (a linear's output is; a padded quantized one is cut to width)
        b = qkv.shape[0]
        out = torch.empty(b, hq * d, dtype=dtype)
        p = qkv.data_ptr()
        bad = fn(p, width, p + hq * d * es, width, p + (hq + hkv) * d * es, width, step.cos, step.sin, step.slots,
                 step.tables, step.max_blocks, step.lens, kp, vp, nb, bs, mp, hq, hkv, d, scale, out.data_ptr(), b,
                 amx_min_batch, torch.get_num_threads())
        if bad >= 0:  # nothing was written: the checked path raises the exact error
            view = qkv.view(b, hq + 2 * hkv, d)
            cpu_paged.decode(view[:, :hq], view[:, hq:hq + hkv], view[:, hq + hkv:], step.cos_t, step.sin_t,
                             k_cache, v_cache, q_to_kv, scale, step.index)
            raise RuntimeError(f"paged decode: the C kernel refused argument {bad}")
        return out
    return run


class _Step:
    """The per-step pointers every layer's attention call reads (the step's index tensors and
    RoPE tables stay referenced here while the step runs)."""

    __slots__ = ("index", "cos_t", "sin_t", "cos", "sin", "slots", "tables", "max_blocks", "lens")

    def __init__(self, index: cpu_paged.PagedIndex, cos: torch.Tensor, sin: torch.Tensor):
        self.index, self.cos_t, self.sin_t = index, cos, sin
        self.cos, self.sin = cos.data_ptr(), sin.data_ptr()
        self.slots, self.tables, self.lens = (index.slot_mapping.data_ptr(), index.block_tables.data_ptr(),
                                              index.context_lens.data_ptr())
        self.max_blocks = index.block_tables.shape[1]


class CPUDecodeProgram:
    """The decoder stack's forward for CPU decode steps (module docstring). ``program(input_ids
    [B], positions [B], ctx) -> [B, hidden]``, equal bit for bit to the stack's own forward
    (:class:`tpengine.model.layers.fused.DecoderStack`); only for decode steps."""

    def __init__(self, stack, layers: list[tuple], final_norm, dtype: torch.dtype, keep: list):
        self.stack, self.layers, self.final_norm, self.dtype = stack, layers, final_norm, dtype
        self._keep = keep  # tensors whose pointers the closures hold (contiguous copies, if any)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> torch.Tensor:
        stack = self.stack
        h = stack.embed_tokens(input_ids)
        cos, sin = (t[0].contiguous() for t in stack.rotary_emb(h, positions[None]))  # [B, D] each
        step = _Step(ctx.attn.paged_index, cos, sin)
        delta = None
        for norm1, qkv, attn, o, norm2, gate_up, silu, down in self.layers:
            h, x = norm1(h, delta)
            delta = o(attn(qkv(x), step))
            h, x = norm2(h, delta)
            delta = down(silu(gate_up(x)))
        return self.final_norm(h, delta)[1]


def build(stack, tp: int, cpu_kernels: bool, amx_min_batch: int = 0) -> CPUDecodeProgram | None:
    """The decode program of a loaded CPU decoder ``stack`` (:class:`~tpengine.model.layers.fused.DecoderStack`,
    its KV caches bound; ``amx_min_batch``: :func:`tpengine.backends.cpu.cpu_paged.decode`'s), or None
    where it does not apply: C kernels off or unavailable, a dtype other than float32/bfloat16, a head
    size the paged kernel does not take, q/k norms (Qwen3), an activation other than SiLU, or widths not
    multiples of 16."""
    layers = list(stack.layers[: stack.config.num_hidden_layers])
    dtype = stack.norm.weight.dtype
    if (not cpu_kernels or stack.norm.weight.device.type != "cpu" or not cpu_library.has(*KERNELS)
            or dtype not in (torch.float32, torch.bfloat16) or not layers):
        return None
    keep, built = [], []
    fuse = stack.reduce_in_norm  # as the stack's forward: the all-reduces run in the norms
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not (attn.q_norm is None and mlp.silu and cpu_paged.available(dtype, attn.head_dim, True)
                and mlp.intermediate % 16 == 0 and attn.k_cache is not None
                and all(n.weight.dtype == dtype and n.weight.shape[0] % 16 == 0
                        for n in (layer.input_layernorm, layer.post_attention_layernorm))):
            return None
        (norm1, w1), (norm2, w2) = (_norm(layer.input_layernorm, dtype, fuse),
                                    _norm(layer.post_attention_layernorm, dtype, fuse))
        keep += [w1, w2]
        built.append((norm1, _linear(attn.qkv_proj, False, tp), _attention(attn, dtype, amx_min_batch),
                      _linear(attn.o_proj, True, tp, not fuse), norm2, _linear(mlp.gate_up_proj, False, tp),
                      _silu(mlp, dtype), _linear(mlp.down_proj, True, tp, not fuse)))
    final, wf = _norm(stack.norm, dtype, fuse)
    return CPUDecodeProgram(stack, built, final, dtype, keep + [wf])
