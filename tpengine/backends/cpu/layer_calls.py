"""The decoder layers' element-wise C kernels bound once per layer, so that the model's one forward
(:class:`tpengine.model.layers.fused.DecoderStack`) runs lean on CPU.

At batch 1 a decode step of a small model spends about as long in Python between the kernels as in
them (docs/notes/kernels.md): each fused op's C-or-torch decision, its argument checks and a torch-op
dispatch per call. :func:`bind_stack` does those checks once, when the CPU backend binds the model
(:meth:`tpengine.backends.cpu.attention.CPUAttentionBackend.bind_model`), and sets on each layer a
callable that calls the C function straight through ctypes:

* ``RMSNorm.bound(h, x, reduce) -> (h + x, rms_norm(h + x))``: the ``tpe_add_rms_norm`` kernel
  :func:`tpengine.backends.cpu.cpu_fused.add_rms_norm` runs (the same call, the same bits);
* ``FusedAttention.bound_qk_norm(qkv) -> qkv``: per-head query/key norms in place (``tpe_head_rms_norm``);
* ``FusedMLP.bound_act(gate_up) -> act(gate) * up`` (each expert's of a MoE block): the kernel of the MLP's activation
  (:func:`~tpengine.backends.cpu.cpu_fused.silu_mul`'s, :func:`~tpengine.backends.cpu.cpu_fused.gelu_tanh_mul`'s).

Each bound callable checks only what may vary per call (rank 2, contiguous rows) and otherwise
hands the call to the layer's generic op. A layer the kernels do not take keeps ``None`` (its
forward runs the generic ops). The paged attention call is bound the same way
(:func:`tpengine.backends.cpu.cpu_paged.bind`), by the backend itself.
"""

from __future__ import annotations

import torch

from tpengine.backends.cpu import cpu_library, cpu_moe

#: the C functions bound here
KERNELS = ("tpe_add_rms_norm", "tpe_add_rms_norm_f32", "tpe_add_rms_norm_w32", "tpe_silu_mul", "tpe_silu_mul_f32",
           "tpe_gelu_tanh_mul", "tpe_gelu_tanh_mul_f32")
#: an MLP's activation (``FusedMLP.activation``) -> its bfloat16 and float32 C kernels and the ops method
#: inputs of another layout take
ACT_KERNELS = {"silu": ("tpe_silu_mul", "tpe_silu_mul_f32", "silu_mul"),
               "gelu_tanh": ("tpe_gelu_tanh_mul", "tpe_gelu_tanh_mul_f32", "gelu_tanh_mul")}
DTYPES = (torch.float32, torch.bfloat16)


def bind_norm(norm, act_dtype: torch.dtype | None = None) -> object | None:
    """``run(h [rows, n], x [rows, n] | None, reduce) -> (h + x, norm(h + x))`` for an RMSNorm layer
    (``weight [n]`` float32 or bfloat16 on CPU, ``n % 16 == 0``) whose activations are ``act_dtype``
    (default: the weight's; a float32 weight beside bfloat16 activations is Gemma's / OLMo 2's form,
    ``tpe_add_rms_norm_w32``), else None. ``reduce``: ``x`` is a row-parallel partial sum, all-reduced
    first (the layer's ``ops.all_reduce_add_rms_norm``). Inputs of another layout or dtype take the
    layer's generic op (``ops.add_rms_norm``)."""
    w = norm.weight
    n, dtype = w.shape[0], act_dtype or w.dtype
    mixed = dtype == torch.bfloat16 and w.dtype == torch.float32
    if not (w.device.type == "cpu" and dtype in DTYPES and (w.dtype == dtype or mixed) and w.dim() == 1
            and n % 16 == 0 and w.is_contiguous() and cpu_library.has(*KERNELS)):
        return None
    lib = cpu_library.load()
    name = "tpe_add_rms_norm_w32" if mixed else "tpe_add_rms_norm" if dtype == torch.bfloat16 else \
        "tpe_add_rms_norm_f32"
    fn, eps, ops, wp = getattr(lib, name), float(norm.eps), norm.ops, w.data_ptr()

    def run(h: torch.Tensor, x: torch.Tensor | None, reduce: bool = False):
        if x is not None and reduce:
            return ops.all_reduce_add_rms_norm(x, h, w, eps)
        if (h.dtype != dtype or h.dim() != 2 or h.shape[1] != n or not h.is_contiguous()
                or (x is not None and (x.dtype != dtype or x.shape != h.shape or not x.is_contiguous()))):
            return ops.add_rms_norm(h, x, w, eps)
        y = torch.empty_like(h)
        if x is None:
            fn(h.data_ptr(), None, wp, None, y.data_ptr(), h.shape[0], n, eps, torch.get_num_threads())
            return h, y
        h2 = torch.empty_like(h)
        fn(h.data_ptr(), x.data_ptr(), wp, h2.data_ptr(), y.data_ptr(), h.shape[0], n, eps, torch.get_num_threads())
        return h2, y
    run.c_spec = ("norm", name, wp, n, eps)  # its call in a decode program (cpu_program)
    return run


def bind_act(mlp, dtype: torch.dtype) -> object | None:
    """``run(gate_up [rows, 2 * inter]) -> act(gate) * up [rows, inter]`` for an MLP whose activation
    has a kernel (:data:`ACT_KERNELS`: SiLU, tanh-approximate GELU) of ``dtype`` (float32 or bfloat16)
    with ``inter % 16 == 0``, else None; other inputs take the layer's generic op (``ops.silu_mul`` /
    ``ops.gelu_tanh_mul``)."""
    names = ACT_KERNELS.get(getattr(mlp, "activation", None))
    inter = getattr(mlp, "intermediate", 0)
    if not (names and dtype in DTYPES and inter % 16 == 0 and inter > 0 and cpu_library.has(*KERNELS)):
        return None
    fn = getattr(cpu_library.load(), names[0] if dtype == torch.bfloat16 else names[1])
    generic = getattr(mlp.ops, names[2])

    def run(gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype != dtype or gate_up.dim() != 2 or gate_up.shape[1] != 2 * inter or not gate_up.is_contiguous():
            return generic(gate_up, inter)
        out = torch.empty(gate_up.shape[0], inter, dtype=dtype)
        fn(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter, torch.get_num_threads())
        return out
    run.c_spec = ("act", names[0] if dtype == torch.bfloat16 else names[1], inter)  # (cpu_program)
    return run


def bind_qk_norm(attn, dtype: torch.dtype) -> object | None:
    """``run(qkv [T, (Hq + 2 Hkv) D]) -> qkv`` with its query and key heads normalized in place by the
    attention layer's per-head ``q_norm`` / ``k_norm`` (Qwen3's, Gemma 3's: weights ``[D]`` of ``dtype``,
    ``D % 16 == 0``): the ``tpe_head_rms_norm`` kernel, the norm kernel's loop on those rows; else None
    (a whole-projection norm, OLMo 2's, or another layout: the layer's generic ``_qk_norm``). Inputs of
    another dtype or layout take the generic path."""
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    d, hq, hkv = attn.head_dim, attn.num_heads, attn.num_key_value_heads
    name = {torch.bfloat16: "tpe_head_rms_norm", torch.float32: "tpe_head_rms_norm_f32"}.get(dtype)
    if (qn is None or kn is None or attn.projection_norms or name is None or d % 16 or not cpu_library.has(name)
            or any(n.weight.dtype != dtype or n.weight.shape != (d,) or not n.weight.is_contiguous()
                   or n.weight.device.type != "cpu" for n in (qn, kn))):
        return None
    fn, heads = getattr(cpu_library.load(), name), hq + 2 * hkv
    qw, kw, qe, ke, generic = qn.weight.data_ptr(), kn.weight.data_ptr(), float(qn.eps), float(kn.eps), attn._qk_norm

    def run(qkv: torch.Tensor) -> torch.Tensor:
        if qkv.dtype != dtype or qkv.dim() != 2 or qkv.shape[1] != heads * d or not qkv.is_contiguous():
            return generic(qkv)
        t, nt = qkv.shape[0], torch.get_num_threads()
        fn(qkv.data_ptr(), t, heads, 0, hq, qw, d, qe, nt)
        fn(qkv.data_ptr(), t, heads, hq, hkv, kw, d, ke, nt)
        return qkv
    return run


def bind_stack(stack, cpu_kernels: bool) -> int:
    """Bind every layer's norms and activation of the decoder ``stack`` (its weights loaded) with
    ``cpu_kernels`` (``EngineConfig.cpu_kernels``; off, or a stack not on the CPU: every bound
    callable is reset to None, so the layers run their generic ops). Returns how many callables
    were bound."""
    layers = list(stack.layers[: stack.config.num_hidden_layers])
    norms = stack.norms()
    # (the CPU backend may run on CUDA; norms[0]: a pipeline stage before the last has no final norm)
    cpu_kernels = cpu_kernels and norms[0].weight.device.type == "cpu"
    count = 0
    # the activations' dtype (a Gemma's norm weights are float32 beside them): the embedding's, or the KV cache's
    # where the embedding is quantized
    kv = getattr(layers[0].self_attn, "k_cache", None) if layers else None
    emb = getattr(stack.embed_tokens, "weight", None)
    act = emb.dtype if emb is not None else kv.dtype if kv is not None and kv.is_floating_point() else None
    for norm in norms:
        norm.bound = bind_norm(norm, act) if cpu_kernels else None
        count += norm.bound is not None
    for layer in layers:
        if hasattr(layer.self_attn, "bound_qk_norm"):
            layer.self_attn.bound_qk_norm = bind_qk_norm(layer.self_attn, act or norms[0].weight.dtype) \
                if cpu_kernels else None
            count += layer.self_attn.bound_qk_norm is not None
    for layer in layers:  # a MoE block's experts (gated_mlps) each get their own
        for mlp in layer.mlp.gated_mlps() if hasattr(layer.mlp, "gated_mlps") else (layer.mlp,):
            mlp.bound_act = bind_act(mlp, act or norms[0].weight.dtype) if cpu_kernels else None
            count += mlp.bound_act is not None
        if hasattr(layer.mlp, "bound_decode"):  # and its one-token step, grouped where the layout chose it
            layer.mlp.bound_decode = cpu_moe.bind(layer.mlp, act or norms[0].weight.dtype) if cpu_kernels else None
            count += layer.mlp.bound_decode is not None
    return count
