"""The decoder layers tpengine runs for the Llama-style families (Llama, Mistral, Qwen2, Qwen3),
built in their final tensor-parallel form by :func:`tpengine.model.surgery.build_model` and filled by
the loader straight from ShardPlan slices.

* q/k/v run as one column-parallel GEMM and gate/up as another
  (:class:`tpengine.model.layers.linear.MergedColumnParallelLinear`: each part's rows are that
  checkpoint tensor's ShardPlan slice, so the partition math stays in the plan);
* RoPE runs once over the query and key heads together (they are adjacent in the fused output),
  with HF's formula ``x * cos + rotate_half(x) * sin``;
* attention takes the step's packed ``[T, H, D]`` tokens straight from the GEMM output, with no
  transposes, and the step's attention backend runs RoPE, the KV store and paged attention over the
  KV cache in one call (:meth:`tpengine.backends.base.AttentionBackend.forward`).

HF's RMSNorm (eight tensor ops) becomes :class:`RMSNorm` (``F.rms_norm``: one op in float32, four
in half precision), and HF's decoder stack becomes :class:`DecoderStack`. The
forwards mirror the HF ones they replace (same operations in the same order on each element), so
results match HF's bit for bit in float32.
"""

from __future__ import annotations

import functools
from itertools import islice

import torch
from torch import nn
from torch.nn import functional as F

from tpengine.backends.torch_ops import TorchOps
from tpengine.comm import all_reduce
from tpengine.context import Context
from tpengine.model.layers import rope_table
from tpengine.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class FusedAttention(nn.Module):
    """One decoder layer's tensor-parallel attention (Llama, Mistral, Qwen2, Qwen3): a
    column-parallel q/k/v GEMM (:class:`MergedColumnParallelLinear`, parts ``q_proj``,
    ``k_proj``, ``v_proj``), optional per-head ``q_norm``/``k_norm`` (Qwen3), RoPE, paged
    attention over this rank's heads, and the row-parallel ``o_proj``.

    Args:
        hidden: model width; rp: this rank's :class:`~tpengine.model.plan.RankPlan`; head_dim;
        qkv_bias / o_bias: whether those projections have biases; scaling: softmax scale;
        layer_idx: the layer's index (its KV cache); qk_norm_eps: eps of q_norm/k_norm, or None
        when the model has none; dtype; device: where the small ``tp_q_to_kv`` map lives
        (parameters start on meta, the loader fills them); qk_norms: the (q_norm, k_norm) pair or None;
        projection_sizes: ``(Hq D, Hkv D)`` of the whole model when those norms span the whole
        projection (OLMo 2), None when they act per head; kv_share: under tp > 1, each local KV head's
        share ``1 / holders`` in a whole-projection norm's sum; sliding_window: ``w`` for a layer whose
        query at position ``i`` sees only the keys at positions ``j`` with ``i - w < j <= i`` (HF's
        ``sliding_window``), None for full causal attention; logit_soft_cap: ``c`` for a layer whose
        scaled scores become ``tanh(s / c) * c`` before the mask and softmax (Gemma 2's
        ``attn_logit_softcapping``), None for none. The attention backend reads both from the layer at
        each call.

    ``forward(hidden_states [T, hidden], position_embeddings=(cos, sin) [T, D], ctx)`` ->
    ``[T, hidden]``.
    """

    def __init__(self, hidden: int, rp, head_dim: int, qkv_bias: bool, o_bias: bool, scaling: float,
                 layer_idx: int, qk_norms: tuple[RMSNorm, RMSNorm] | None, dtype: torch.dtype, device: torch.device,
                 ops: TorchOps | None = None, sliding_window: int | None = None,
                 logit_soft_cap: float | None = None, projection_sizes: tuple[int, int] | None = None,
                 kv_share: tuple[float, ...] | None = None):
        super().__init__()
        self.sliding_window, self.logit_soft_cap = sliding_window, logit_soft_cap
        self.ops = ops = ops or TorchOps()
        hq, hkv = rp.num_q_heads, rp.num_kv_heads
        self.qkv_proj = MergedColumnParallelLinear(hidden, [hq * head_dim, hkv * head_dim, hkv * head_dim],
                                                   ["q_proj", "k_proj", "v_proj"], qkv_bias, dtype)
        self.o_proj = RowParallelLinear(hq * head_dim, hidden, o_bias, dtype)
        self.q_norm, self.k_norm = qk_norms or (None, None)
        # q/k norms over the whole projection (OLMo 2): their mean of squares spans the ranks' heads
        self.projection_norms = projection_sizes is not None
        self.kv_share = None
        if self.projection_norms and kv_share is not None:  # each local KV head's weight in the k sum
            self.kv_share = torch.tensor(kv_share, dtype=torch.float32, device=device).repeat_interleave(head_dim)
            self.projection_sizes = torch.tensor(projection_sizes, dtype=torch.float32, device=device)
        self.layer_idx, self.head_dim, self.scaling = layer_idx, head_dim, scaling
        self.num_heads, self.num_key_value_heads = hq, hkv
        self.tp_q_to_kv = torch.tensor(rp.q_to_kv, dtype=torch.int64, device=device)
        # the projections' forwards as plain attributes: a submodule read goes through nn.Module.__getattr__
        self.qkv_forward, self.o_forward = self.qkv_proj.forward, self.o_proj.forward
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D] views, set by the model runner
        self.v_cache: torch.Tensor | None = None
        # an int8 cache's (k_scale, v_scale), [num_blocks, block_size, Hkv] float32 each (backends/kv_quant.py)
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kv_scales_dtype: torch.dtype | None = None  # with kv_scales: the dtype of the keys and values quantized

    #: ``qkv -> qkv`` with the per-head query/key norms applied, bound by the backend (in place, one kernel
    #: call each: :func:`tpengine.backends.cpu.layer_calls.bind_qk_norm`), or None: :meth:`_qk_norm`
    bound_qk_norm = None

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                ctx: Context, reduce: bool = True) -> torch.Tensor:
        """``reduce`` False: ``o_proj``'s partial sum, not all-reduced (:meth:`RowParallelLinear.forward`)."""
        # (sub-layers' forward called directly and the q/k/v rows handed on as they are: at batch 1
        # the Python between the kernels is as costly as the kernels, docs/notes/kernels.md; no hooks)
        qkv = self.qkv_forward(hidden_states)  # [T, (Hq + 2 Hkv) D]
        if self.q_norm is not None:
            qkv = (self.bound_qk_norm or self._qk_norm)(qkv)
        out = ctx.backend.forward(qkv, position_embeddings, self, ctx)  # RoPE, KV store, paged attention
        return self.o_forward(out, reduce)

    def _qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv [T, (Hq + 2 Hkv) D]`` with its query and key parts normalized: per head (Qwen3, Gemma 3),
        or over the whole projection (OLMo 2). Under tp > 1 a whole-projection norm's mean of squares
        is the all-reduced sum of every rank's heads (each KV head counted once: a head held by several
        ranks weighs ``1 / holders`` on each) over ``projection_sizes``."""
        hq, hkv, d = self.num_heads, self.num_key_value_heads, self.head_dim
        if not self.projection_norms:
            t = qkv.view(qkv.shape[0], hq + 2 * hkv, d)
            q, k = self.q_norm(t[:, :hq]), self.k_norm(t[:, hq:hq + hkv])
            return torch.cat((q, k, t[:, hq + hkv:]), dim=1).flatten(1)
        q, k, v = qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d], qkv[:, (hq + hkv) * d:]
        if self.kv_share is None:  # tp = 1: HF's own arithmetic
            return torch.cat((self.q_norm(q), self.k_norm(k), v), dim=1)
        qf, kf = q.float(), k.float()
        sums = torch.stack((qf.pow(2).sum(-1), kf.pow(2).mul(self.kv_share).sum(-1)), dim=-1)
        sums = all_reduce(sums)  # [T, 2]: the whole projections' sums of squares
        var = sums / self.projection_sizes
        out = []
        for x, norm, j in ((qf, self.q_norm, 0), (kf, self.k_norm, 1)):
            y = x * torch.rsqrt(var[:, j:j + 1] + norm.eps)
            out.append((norm.weight * y).to(qkv.dtype))
        return torch.cat((*out, v), dim=1)


def activation_kind(act_fn: nn.Module) -> str | None:
    """The name of an HF activation module that the fused ops compute as one op: ``"silu"`` (SiLU),
    ``"gelu_tanh"`` (torch's tanh-approximate GELU: ``nn.GELU(approximate="tanh")``, HF's
    ``gelu_pytorch_tanh``, Gemma's GeGLU), else None (the module itself runs)."""
    if isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation":
        return "silu"
    if isinstance(act_fn, nn.GELU):
        return "gelu_tanh" if act_fn.approximate == "tanh" else None
    fn = getattr(act_fn, "act", None)  # transformers' GELUTanh: a partial of F.gelu (its python form: None)
    if (type(act_fn).__name__ == "GELUTanh" and isinstance(fn, functools.partial) and fn.func is F.gelu
            and fn.keywords == {"approximate": "tanh"} and not fn.args):
        return "gelu_tanh"
    return None


class FusedMLP(nn.Module):
    """One decoder layer's tensor-parallel gated MLP ``down(act(gate(x)) * up(x))``: a
    column-parallel gate/up GEMM (parts ``gate_proj``, ``up_proj``, ``intermediate`` local
    columns each) and the row-parallel ``down_proj``. ``act_fn`` is the HF model's activation.
    ``[..., hidden]`` -> ``[..., hidden]``."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, down_bias: bool, act_fn: nn.Module,
                 dtype: torch.dtype, ops: TorchOps | None = None):
        super().__init__()
        self.ops = ops or TorchOps()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate],
                                                       ["gate_proj", "up_proj"], bias, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, down_bias, dtype)
        self.act_fn, self.intermediate = act_fn, intermediate
        self.activation = activation_kind(act_fn)
        # gate_up -> act(gate) * up as one fused op of ``ops`` (a C kernel on CPU), or None: torch's chain
        self.act_mul = {"silu": self.ops.silu_mul, "gelu_tanh": self.ops.gelu_tanh_mul}.get(self.activation)
        # (plain attributes, as FusedAttention's projections)
        self.gate_up_forward, self.down_forward = self.gate_up_proj.forward, self.down_proj.forward

    #: ``gate_up -> act(gate) * up`` bound by the backend for this layer (its checks done once:
    #: :func:`tpengine.backends.cpu.layer_calls.bind_stack`), or None: the generic op below
    bound_act = None

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce`` False: ``down_proj``'s partial sum, not all-reduced."""
        gate_up = self.gate_up_forward(x)  # (called directly, as in FusedAttention.forward)
        act = self.bound_act
        if act is not None:
            return self.down_forward(act(gate_up), reduce)
        if self.act_mul is not None:  # CPU: one C kernel
            return self.down_proj(self.act_mul(gate_up, self.intermediate), reduce)
        h = self.act_fn(gate_up[..., : self.intermediate])
        return self.down_proj(h.mul_(gate_up[..., self.intermediate :]), reduce)


class RMSNorm(nn.Module):
    """HF Llama-style RMSNorm, ``weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype)``, through
    ``F.rms_norm`` (bit-identical to HF's eight ops in float32 and bfloat16). ``weight [size]``
    starts on meta; ``[..., size]`` -> ``[..., size]``.

    ``float32_weight``: the weight is kept in float32 and multiplies before the one rounding to the
    input's dtype (Gemma's and OLMo 2's norms); ``offset``: added to the checkpoint's weight once it is
    loaded (:meth:`loaded`; Gemma's ``x * (1 + weight)``)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: TorchOps | None = None,
                 float32_weight: bool = False, offset: float = 0.0):
        super().__init__()
        self.ops = ops or TorchOps()
        wdtype = torch.float32 if float32_weight else dtype
        self.weight = nn.Parameter(torch.empty(size, dtype=wdtype, device="meta"), requires_grad=False)
        self.eps, self.shape, self.offset = eps, (size,), offset

    def loaded(self) -> None:
        """Called by the loader once the checkpoint's weight is in: add :attr:`offset` (exact as HF's
        ``1.0 + weight.float()``: the weight is float32 where an offset is used)."""
        if self.offset:
            self.weight.data.add_(self.offset)

    #: ``(h, x, reduce) -> (h + x, self(h + x))`` bound by the backend for this layer (its checks done
    #: once: :func:`tpengine.backends.cpu.layer_calls.bind_stack`), or None: :meth:`add_forward`'s ops
    bound = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_forward(x, None)[1]

    def add_forward(self, h: torch.Tensor, x: torch.Tensor | None,
                    reduce: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + x, self(h + x))`` (``h`` itself when ``x`` is None): the residual add before the
        norm, fused with it by a C kernel on CPU (tpengine.backends.cpu.cpu_fused). ``reduce``: ``x`` is a
        row-parallel layer's partial sum, all-reduced first (fused with the add and the norm where
        the shared-memory comm can: :meth:`tpengine.backends.torch_ops.TorchOps.all_reduce_add_rms_norm`)."""
        bound = self.bound
        if bound is not None:
            return bound(h, x, reduce)
        if reduce and x is not None:
            return self.ops.all_reduce_add_rms_norm(x, h, self.weight, self.eps)
        return self.ops.add_rms_norm(h, x, self.weight, self.eps)


def add_only(h: torch.Tensor, x: torch.Tensor | None, reduce: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The place of a missing pre-norm (OLMo 2): ``(h + x, h + x)`` (``h`` itself when ``x`` is None).
    ``reduce`` is never set here (a stack with a missing norm does not all-reduce in its norms)."""
    if x is not None:
        h = h + x
    return h, h


class Scaled:
    """A sub-block's output scaled before the residual add, ``x * scale`` (Granite's
    ``residual_multiplier``), after its post-norm when it has one: ``[..., n]`` -> ``[..., n]``."""

    def __init__(self, scale: float, post=None):
        self.scale, self.post = scale, post

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.post is not None:
            x = self.post(x)
        return x * self.scale


class DecoderStack(nn.Module):
    """tpengine's decoder stack, in place of HF's (``LlamaModel`` and the other families' twins,
    :mod:`tpengine.model.families`; built by :func:`tpengine.model.surgery.build_model` from HF's own
    layers, so checkpoint names stay ``model.layers.<i>...``): the embedding, the decoder layers, the
    final norm and HF's rotary embedding (which honours the config's RoPE scaling; one table per layer
    type where the model has several, as Gemma 3).

    The forward is HF's computation over one engine step's tokens, without HF's mask building, cache
    and per-layer wrappers: the embedding (times ``embed_scale`` where the family scales it), RoPE tables,
    then per layer ``h = h + post_attn(attn(pre_attn(h)))`` and ``h = h + post_mlp(mlp(pre_mlp(h)))``,
    where a missing pre-norm passes ``h`` through and a missing post-norm passes the output through (the
    roles and their norms: :data:`tpengine.model.families.ROLES`; ``post_*`` also carries Granite's
    residual scale), and the final norm. Each residual add runs inside the next pre-norm's
    :meth:`RMSNorm.add_forward` (the same ops in the same order, or one C kernel on CPU). With
    ``reduce_in_norm`` (tp > 1, every layer of the Llama form, no row-parallel bias) the blocks return
    their row-parallel partial sums and that norm all-reduces them too (one C call over the
    shared-memory comm on CPU).

    ``roles``: per layer, the modules of its four :data:`~tpengine.model.families.ROLES` (None: no norm),
    ``residual_scale``: Granite's multiplier or None, ``rope_types``: per layer, the rotary table's layer
    type (None: the one table).

    Shapes: ``input_ids``, ``positions [N]`` int64 (the step's sequences packed back to back,
    described by ``ctx``) -> ``[N, hidden]``.

    A pipeline stage's stack (:func:`tpengine.model.surgery.build_model` with ``stage``) holds its own
    layers only (``layer_offset``: the first one's index in the model): a stage after the first has no
    embedding and takes ``intermediate``, the previous stage's ``(h, delta)`` (the residual stream and the
    last block's output, not yet added: under ``reduce_in_norm`` this rank's partial sum, which this
    stage's first norm all-reduces with its TP peers'), and a stage before the last has no final norm and
    returns its own ``(h, delta)`` (each ``[N, hidden]``) for the next stage.
    """

    #: a pipeline stage's first layer's index in the model, and whether the stage is the first
    layer_offset: int = 0
    first_stage: bool = True

    def __init__(self, config, embed_tokens: nn.Module, layers: nn.ModuleList, norm: RMSNorm,
                 rotary_emb: nn.Module, reduce_in_norm: bool, roles: list[tuple] | None = None,
                 embed_scale: float | None = None, residual_scale: float | None = None,
                 rope_types: list[str | None] | None = None):
        super().__init__()
        self.config, self.embed_tokens, self.layers, self.norm = config, embed_tokens, layers, norm
        self.rotary_emb, self.reduce_in_norm = rotary_emb, reduce_in_norm
        n = config.num_hidden_layers
        self.roles = roles or [(layer.input_layernorm, None, layer.post_attention_layernorm, None)
                               for layer in islice(layers, n)]
        self.embed_scale, self.residual_scale = embed_scale, residual_scale
        self.rope_types = rope_types or [None] * n

    def layer_calls(self) -> list[tuple]:
        """Each decoder layer's calls, ``(pre_attn, attn, post_attn, pre_mlp, mlp, post_mlp, rope_type)``,
        looked up once: ``pre_*`` a norm's :meth:`RMSNorm.add_forward` (or :func:`add_only`), ``post_*``
        a callable on the sub-block's output or None, ``attn``/``mlp`` the blocks' forwards. A
        submodule's attribute goes through ``nn.Module.__getattr__`` at every access, which at batch 1
        costs as much as a small kernel (docs/notes/cpu-paths.md). The bound methods read the layers'
        bound kernels at each call, so a later :meth:`tpengine.backends.platform.Platform.bind_model`
        needs no reset."""
        calls = self.__dict__.get("_layer_calls")
        if calls is None:
            calls = []
            for layer, (pre_a, post_a, pre_m, post_m), rope in zip(self.layers, self.roles, self.rope_types):
                posts = [None if p is None else p.forward for p in (post_a, post_m)]
                if self.residual_scale is not None:
                    posts = [Scaled(self.residual_scale, p) for p in posts]
                calls.append((add_only if pre_a is None else pre_a.add_forward, layer.self_attn.forward, posts[0],
                              add_only if pre_m is None else pre_m.add_forward, layer.mlp.forward, posts[1], rope))
            self.__dict__["_layer_calls"] = calls
        return calls

    def _rope(self, h: torch.Tensor, positions: torch.Tensor, ctx: Context,
              kind: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's ``(cos, sin)`` ``[N, D]`` for layers of rotary type ``kind`` (None: the one table).

        LongRoPE (Phi-3's ``rope_type: longrope``): HF's rotary embedding switches a forward to the long
        factors when its largest position reaches ``original_max_position_embeddings``; a step packs
        several sequences, so each token takes the table its own sequence would get from HF alone: the
        long one iff the sequence's length after this step exceeds that bound (a long prompt is then
        rotated with the long factors throughout, as HF does; a chunked prefill decides per chunk).
        Both tables come from HF's own module (positions clamped below the bound for the short one, one
        position past it appended for the long one: each table entry depends only on its position)."""
        extra = () if kind is None else (kind,)
        bound = self.longrope_bound
        if bound is None:
            table = self._rope_table(h, kind) if self.rope_table_len is not None else None
            if table is not None:  # one op: the module's rows for these positions, computed once
                return tuple(table.index_select(1, positions))
            return tuple(t[0] for t in self.rotary_emb(h, positions[None], *extra))
        short = self.rotary_emb(h, positions.clamp(max=bound - 1)[None], *extra)
        past = torch.cat((positions, self.longrope_past))  # (a tensor made at build: no host copy per step)
        long = self.rotary_emb(h, past[None], *extra)
        if ctx.is_prefill:
            cu_q, cu_k = ctx.cu_seqlens_q, ctx.cu_seqlens_k
            lens = torch.repeat_interleave(cu_k[1:] - cu_k[:-1], cu_q[1:] - cu_q[:-1])
        else:
            lens = ctx.context_lens
        use = (lens > bound)[:, None]
        return tuple(torch.where(use, lt[0, :-1], st[0]) for st, lt in zip(short, long))

    def _rope_table(self, h: torch.Tensor, kind: str | None) -> torch.Tensor | None:
        """The rotary module's ``[2, rope_table_len, D]`` table for layer type ``kind`` in ``h``'s dtype and
        device, built on first use (:func:`tpengine.model.layers.rope_table.build`), or None where the
        module must run each step (a dynamic rope type; a table that would not equal the module's call)."""
        tables = self.__dict__.setdefault("_rope_tables", {})
        key = (kind, h.dtype, h.device)
        if key not in tables:
            tables[key] = rope_table.build(self.rotary_emb, self.rope_table_len, h, kind)
        return tables[key]

    def build_rope_tables(self, dtype: torch.dtype, device: torch.device) -> None:
        """Build every layer type's RoPE table for activations of ``dtype`` on ``device`` now (the model
        runner, before any step: a CUDA graph's capture must not build one), where ``rope_table_len`` is set
        and the model has no LongRoPE."""
        if self.rope_table_len is not None and self.longrope_bound is None:
            like = torch.empty(1, 1, dtype=dtype, device=device)
            for kind in set(self.rope_types):
                self._rope_table(like, kind)

    #: the positions a per-position RoPE table covers (the model runner sets it from ``max_model_len``:
    #: no step's position reaches it), or None: HF's rotary module each step (a stack built by hand)
    rope_table_len: int | None = None
    #: LongRoPE's ``original_max_position_embeddings`` (set by surgery), or None: one table per type;
    #: ``longrope_past``: that bound as a ``[1]`` int64 tensor on the model's device
    longrope_bound: int | None = None
    longrope_past: torch.Tensor | None = None
    #: ``(h, positions, ctx) -> output | None``: the whole step from the embedding's rows ``h`` at ``positions``
    #: on, bound by the attention backend where its device runs it as one call (the CPU's decode program,
    #: :mod:`tpengine.backends.cpu.cpu_program`: the layers' own bound kernels, called in this forward's
    #: order, for a step of one token; its RoPE rows read from :meth:`rope_table` where there is one, else
    #: :meth:`step_rope`'s); None from it, or unbound: the loop below
    bound_decode = None

    def rope_table(self, h: torch.Tensor) -> torch.Tensor | None:
        """The per-position RoPE table ``[2, rope_table_len, D]`` (cos, then sin; row ``p`` of each half is
        position ``p``'s, the values :meth:`step_rope` gives a step) in ``h``'s dtype and device, where every
        layer takes the one table (rope type None) and it is used (``rope_table_len`` set, no LongRoPE, a
        table equal to the module's); else None."""
        if self.rope_table_len is None or self.longrope_bound is not None or any(self.rope_types):
            return None
        return self._rope_table(h, None)

    def step_rope(self, h: torch.Tensor, positions: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's ``(cos, sin)`` ``[N, D]`` of the one table (rope type None), as every layer of such a
        stack takes them."""
        return self._rope(h, positions, ctx, None)

    def norms(self) -> list[RMSNorm]:
        """Every norm of the stack: the final one (a pipeline stage's before the last has none), then each
        layer's in role order (what a backend binds)."""
        return [n for n in (self.norm,) if n is not None] + [n for roles in self.roles for n in roles if n is not None]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        delta = None  # each block's output, added to the residual stream by the next norm (fused on CPU)
        if intermediate is None:
            h = self.embed_tokens(input_ids)
            if self.embed_scale is not None:
                h = h * self.embed_scale
        else:  # a later pipeline stage: the previous one's residual stream and last output
            h, delta = intermediate
        if self.bound_decode is not None and intermediate is None:
            out = self.bound_decode(h, positions, ctx)
            if out is not None:
                return out
        tables = {kind: self._rope(h, positions, ctx, kind) for kind in set(self.rope_types)}
        fuse = self.reduce_in_norm  # tp > 1: the blocks' all-reduces run in the next norm
        keep = not fuse
        for norm1, attn, post1, norm2, mlp, post2, rope in self.layer_calls():  # (called directly: no hooks)
            h, x = norm1(h, delta, fuse)
            delta = attn(x, tables[rope], ctx, keep)
            if post1 is not None:
                delta = post1(delta)
            h, x = norm2(h, delta, fuse)
            delta = mlp(x, keep)
            if post2 is not None:
                delta = post2(delta)
        if self.norm is None:  # a pipeline stage before the last: the next stage goes on from here
            return h, delta
        return self.norm.add_forward(h, delta, fuse)[1]
