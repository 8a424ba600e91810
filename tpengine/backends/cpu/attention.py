"""The CPU attention backend (``cpu``; ``torch`` is its old name): paged attention through the paged C
kernel where the model's layers take it, else torch ops and the C decode kernel over a gathered
context, with the oracle's layout and contract (:mod:`tpengine.backends.reference`).

Three paths, chosen once per step by :meth:`CPUAttentionBackend.prepare` (``m.path``):

* ``paged`` (:data:`PAGED`): a decode step, or a prefill step whose every token is a decode row (a
  speculative verification), once :meth:`CPUAttentionBackend.bind_model` bound the paged C call of
  every layer (:func:`tpengine.backends.cpu.cpu_paged.bind`): RoPE, the KV store and attention over
  the cache through the block tables in one C call per layer;
* ``gathered`` (:data:`GATHERED`): any other decode step (C kernels off, a head size the paged
  kernel does not take): RoPE and the store (one ``index_copy_`` per cache, or in bfloat16 one C row
  copy for both, :func:`tpengine.backends.cpu.cpu_fused.copy_rows`), then the query heads grouped by
  KV head, the context gathered once per step into ``[B, Hkv, L, D]`` (or kept across steps by the
  layer's :class:`tpengine.backends.cpu.kv_mirror.KVMirror`) and attended in one batched call: the C
  decode kernel (:mod:`tpengine.backends.cpu.cpu_decode`), SDPA for a few sequences, or
  half-precision bmm with a float32 softmax; float32 SDPA over whole blocks;
* ``prefill`` (:data:`PREFILL`): RoPE and the store, then a batch of same-length prompts without a
  cached prefix as one batched call (in half precision as HF's eager attention computes it --
  half-precision matmuls, float32 softmax through
  :func:`tpengine.backends.cpu.cpu_fused.causal_softmax_` -- where the machine's half GEMM is fast,
  else SDPA); other batches SDPA per sequence (over a cached prefix as two flash calls merged by
  their log-sum-exp); the leading sequences of a few tokens over a cached prefix (decodes beside a
  prefill chunk, speculative verification) run each token as a row of the ``gathered`` decode.

A layer's sliding window and logit soft cap (``layer.sliding_window``, ``layer.logit_soft_cap``; the
semantics: :mod:`tpengine.backends.reference`) apply on every path: the paged C kernel takes both (bound
per layer by :meth:`CPUAttentionBackend.bind_model`; it reads only the blocks inside a sliding layer's
window); the torch paths mask the keys outside the window (per step and window value, made once by the
first layer that needs it) and, where there is a cap, which SDPA does not take, compute the scores
explicitly (:func:`tpengine.backends.cpu.prefill.masked_attention`, :func:`half_decode`); a prefill over a
cached prefix reads only the prefix blocks inside the window; the C decode kernel's scores are capped and
masked in torch before its softmax. Layers with neither run exactly the code they ran without them.

Per-step values (host copies of lengths and slot bounds, gather indices, key masks, the mirror's
continuity decision, the paged index) live on the step's :class:`CPUAttentionMetadata`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tpengine.backends import kv_quant
from tpengine.backends.base import AttentionBackend
from tpengine.backends.checks import (
    check_cache,
    check_decode,
    check_heads,
    check_slots,
    check_store,
    prefill_lengths,
    window_start,
)
from tpengine.backends.cpu import cpu_decode, cpu_fused, cpu_paged, cpu_program
from tpengine.backends.cpu import kv_mirror as mirrors
from tpengine.backends.cpu import prefill as cpu_prefill
from tpengine.context import StepIndex
from tpengine.utils import cdiv

__all__ = ["CPUAttentionBackend", "CPUAttentionMetadata"]


# half-precision decode where the C kernel does not apply (C kernels off, or a CPU without
# AVX512-BF16): SDPA or HF's eager arithmetic, and the key masks both take
#: SDPA for a half-precision decode of up to this many ``B * Hkv`` rows, else the bmm path. Not
#: measured per machine: the two paths round differently, and the C kernel (the bmm path's
#: arithmetic) must give the tokens this path gives.
SDPA_ROWS = 8
#: A prefill step's sequences of at most this many new tokens over a cached prefix run each token as
#: a decode row (the batched decode path) instead of a flash call per sequence. Not a timing: the
#: rows of a sequence gather its context once each, so the bound keeps that copy within one
#: block's worth of queries, which covers a speculative step's k + 1 positions.
DECODE_ROWS_QUERY = 16


def half_decode(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, valid: torch.Tensor, bias: torch.Tensor,
                scale: float, sdpa: bool, soft_cap: float | None = None) -> torch.Tensor:
    """Half-precision decode attention without the C kernel (and float32 decode with a logit soft cap):
    ``qg [B, Hkv, G, D]``, ``kg``/``vg`` ``[B, Hkv, L, D]`` contiguous, ``valid``/``bias`` from
    :func:`key_mask` -> ``[B, Hkv, G, D]``. ``sdpa``: one ``scaled_dot_product_attention`` call (never
    with ``soft_cap``, which SDPA does not take); else as HF's eager attention computes it (bmm in the
    input dtype, float32 scores -- capped to ``tanh(s / soft_cap) * soft_cap`` when given -- and softmax),
    the arithmetic of the C kernel (:mod:`tpengine.backends.cpu.cpu_decode`)."""
    if sdpa and soft_cap is None:
        return F.scaled_dot_product_attention(qg, kg, vg, attn_mask=valid, scale=scale)
    nb, hkv, g, d = qg.shape
    s = torch.bmm(qg.reshape(nb * hkv, g, d), kg.view(nb * hkv, -1, d).transpose(1, 2))
    s = s.float().mul_(scale)
    if soft_cap is not None:
        s = s.div_(soft_cap).tanh_().mul_(soft_cap)
    s = s.view(nb, hkv, g, -1).add_(bias)
    p = torch.softmax(s, dim=-1).to(qg.dtype).view(nb * hkv, g, -1)
    return torch.bmm(p, vg.view(nb * hkv, -1, d)).view(nb, hkv, g, d)


def key_mask(context_lens: torch.Tensor, n: int, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid, bias)``, ``[B, 1, 1, n]``: ``valid`` (bool) iff key position ``j`` is visible to
    sequence ``b``'s query (at position ``context_lens[b] - 1``), i.e. ``j < context_lens[b]`` and, with
    a sliding ``window``, ``j >= context_lens[b] - window`` (a batch-padding row, length 0, sees
    position 0 so its softmax stays finite; its output is zeroed after); ``bias`` the same as a
    float32 additive mask (0 or -inf)."""
    pos = torch.arange(n, device=context_lens.device)[None, :]
    valid = pos < context_lens[:, None]
    if window is not None:
        valid &= pos >= context_lens[:, None] - window
    valid[:, 0] |= context_lens == 0
    valid = valid[:, None, None, :]
    return valid, torch.zeros(valid.shape, device=valid.device).masked_fill_(~valid, float("-inf"))


@dataclass
class CPUAttentionMetadata(StepIndex):
    """One step's attention metadata on the CPU backend (tensors as given to ``prepare``).

    ``path``: the step's path (:data:`PAGED`, :data:`GATHERED` or :data:`PREFILL`, chosen by
    ``prepare``); ``slot_min``/``slot_max``: bounds of ``slot_mapping`` (host ints; 0/-1 for no
    tokens); prefill: ``cu_q`` (host offsets), ``seqlens_q``/``seqlens_k`` (host lengths); decode:
    ``min_ctx``/``max_ctx`` (host ints); ``PAGED``: ``paged_index`` (checked once for the step) and
    ``rope`` (the step's RoPE tables as the paged calls take them, made by the first layer);
    ``GATHERED``: ``mirror`` (the step as the KV mirrors see it; None with mirrors off).
    ``decodes``: in a prefill step not on the ``PAGED`` path, the decode metadata of its leading
    ``decode_seqs`` sequences of at most :data:`DECODE_ROWS_QUERY` new tokens over a cached prefix (a
    mixed step's decodes, the verification of speculative tokens): one decode row per token, of its
    sequence's block table and a context up to and including it, run through the ``GATHERED`` decode
    (None when there are fewer than two rows). ``derived``: values every layer shares that depend on
    the cache geometry (gather indices, key masks), computed by the first layer that needs them.
    """

    slot_min: int = 0
    slot_max: int = -1
    cu_q: list[int] | None = None
    seqlens_q: list[int] | None = None
    seqlens_k: list[int] | None = None
    min_ctx: int = 0
    max_ctx: int = 0
    mirror: mirrors.MirrorStep | None = None
    path: str = ""
    paged_index: cpu_paged.PagedIndex | None = None
    rope: cpu_paged.Rope | None = None
    decodes: CPUAttentionMetadata | None = None
    decode_seqs: int = 0
    derived: dict = field(default_factory=dict)

    def get(self, key: tuple, compute):
        """``derived[key]``, computing it with ``compute()`` on first use in this step."""
        if key not in self.derived:
            self.derived[key] = compute()
        return self.derived[key]


#: The paths of one step, chosen once per step by :meth:`CPUAttentionBackend.prepare` (``m.path``):
#: ``PAGED``: every layer runs RoPE, the KV store and attention over the paged cache in one C call
#: (:func:`tpengine.backends.cpu.cpu_paged.bind`; a decode step, or a prefill step whose every token
#: is a decode row); ``GATHERED``: a decode step that stores, then gathers each sequence's context
#: (or keeps it in the layer's KV mirror) and attends in one batched call (:meth:`decode_attention`);
#: ``PREFILL``: a prefill step (:meth:`prefill_attention`).
PAGED, GATHERED, PREFILL = "paged", "gathered", "prefill"


#: Up to this many values, a step's index bounds are read as a Python list (one host copy, no torch op):
#: a decode step of a few sequences, whose Python runs cold after the decode program (docs/notes/kernels.md)
BOUNDS_LIST = 64


def _bounds(t: torch.Tensor) -> tuple[int, int]:
    """``(min, max)`` of a non-empty integer host tensor ``t`` as Python ints."""
    if t.numel() <= BOUNDS_LIST:
        values = t.tolist()
        return min(values), max(values)
    return tuple(int(x) for x in torch.aminmax(t))


class TableRows:
    """Position ``p``'s cos and sin rows inside a per-position RoPE table ``table [2, L, D]`` (contiguous), as
    the decode program takes a step's RoPE (a :class:`~tpengine.backends.cpu.cpu_paged.Rope`'s ``cos_p`` and
    ``sin_p``): pointers into the table, no tensor made (a batch-1 step's Python runs cold after the program,
    where each torch call costs several times its warm figure: docs/notes/kernels.md). ``0 <= p < L``."""

    __slots__ = ("table", "cos_p", "sin_p")

    def __init__(self, table: torch.Tensor, p: int):
        row = table.shape[2] * table.element_size()
        self.table = table  # (kept alive with the pointers)
        self.cos_p = table.data_ptr() + p * row
        self.sin_p = self.cos_p + table.shape[1] * row


def _program_rope(stack, h: torch.Tensor, positions: torch.Tensor, ctx, dtype: torch.dtype):
    """A one-row program step's RoPE: ``TableRows`` of its position in the stack's per-position table
    (``stack.rope_table``, of ``h``'s dtype ``dtype``), or without one (or a position past it, which then
    raises as the layers' path does) the step's tables as the layers take them (:func:`_step_rope`)."""
    table = stack.rope_table(h)
    if table is not None and table.is_contiguous():
        (p,) = positions.tolist()
        if 0 <= p < table.shape[1]:
            return TableRows(table, p)
    return _step_rope(ctx.attn, stack.step_rope(h, positions, ctx), dtype)


def _step_rope(attn, rope: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> cpu_paged.Rope:
    """The step's RoPE tables for the paged calls, made once a step (kept on the step's metadata ``attn``)
    and shared by every layer and by the decode program."""
    r = attn.rope
    if r is None or r.key is not rope:
        r = attn.rope = cpu_paged.Rope(rope, dtype)
    return r


class CPUAttentionBackend(AttentionBackend):
    """The CPU attention backend: paged attention through the paged C kernel where the model takes
    it, else torch ops (and the C decode kernel) over a gathered context; any device runs the
    torch paths (they are the oracle's arithmetic, :mod:`tpengine.backends.reference`).

    Args:
        cpu_kernels: use the C kernels where they apply (``EngineConfig.cpu_kernels``).
        kv_mirror: keep each layer's gathered decode context across steps (``EngineConfig.kv_mirror``;
            used by the ``GATHERED`` path only: C kernels off, or a head size the paged kernel does
            not take).
        paged: with ``cpu_kernels``, let decode steps take the paged C kernel; it is taken once
            :meth:`bind_model` has bound it for every layer (the model's dtype and head size, and
            this build, have the kernel). The engine's backend has it on
            (:func:`tpengine.backends.get_backend`).

    ``prepare`` syncs with the host (slot bounds; prefill lengths; decode lengths and the mirror's
    continuity check), once per step, so the backend is not CUDA-graph safe.
    """

    name = "cpu"
    graph_safe = False

    def __init__(self, *, cpu_kernels: bool = True, kv_mirror: bool = True, paged: bool = False):
        self.cpu_kernels, self.kv_mirror, self.paged = cpu_kernels, kv_mirror, paged
        self.sdpa_rows = SDPA_ROWS  # half-precision decode without the C kernel: SDPA up to B * Hkv rows
        self.continuity = mirrors.Continuity()  # the previous decode step, for the mirrors
        self.mirrors: dict[int, mirrors.KVMirror | None] = {}  # layer index -> its KV mirror (bind_layer)
        self.paged_calls: dict[int, object] = {}  # layer index -> its bound paged C call (bind_model)
        self.program = None  # the stack's decode program (bind_model), with a greedy step's head (bind_head)
        self.lm_head = None  # the LM head a greedy program step takes (bind_head)
        # set by the CPU platform from its profile (CPUPlatform.bind_attention), never measured in a step:
        self.paged_choice = None  # the paged kernel's measured AVX-512 / AMX path (its Choice)
        self.paged_amx_min = 0  # its amx_min_batch (cpu_paged.decode): the AMX path from this many sequences
        self.gemm_dtypes: dict = {}  # dtype -> the dtype its products run in here (the half GEMM choice)

    def __repr__(self) -> str:
        return f"CPUAttentionBackend(cpu_kernels={self.cpu_kernels}, kv_mirror={self.kv_mirror}, paged={self.paged})"

    def prepare(self, is_prefill, slot_mapping, block_tables, cu_seqlens_q=None, cu_seqlens_k=None,
                context_lens=None) -> CPUAttentionMetadata:
        """See :meth:`AttentionBackend.prepare`; the one place the step's path (``m.path``) is chosen.
        Raises ValueError for malformed prefill offsets."""
        m = CPUAttentionMetadata(is_prefill, slot_mapping, block_tables, cu_seqlens_q, cu_seqlens_k, context_lens)
        if slot_mapping.numel():
            m.slot_min, m.slot_max = _bounds(slot_mapping)
        paged = bool(self.paged_calls) and slot_mapping.device.type == "cpu"  # bound for every layer (bind_model)
        if is_prefill:
            m.path = PREFILL
            self._prepare_prefill(m, paged)
        else:
            if context_lens.numel():
                m.min_ctx, m.max_ctx = _bounds(context_lens)
            if paged:  # the paged C kernel reads the cache itself: no mirror kept
                m.path = PAGED
                self.continuity.prefill()
                m.paged_index = cpu_paged.paged_index(slot_mapping, block_tables, context_lens)  # once for all layers
            else:
                m.path = GATHERED
                if self.kv_mirror:
                    m.mirror = self.continuity.decode(block_tables, context_lens)
        return m

    def _prepare_prefill(self, m: CPUAttentionMetadata, paged: bool) -> None:
        """A prefill step's lengths, and its leading sequences of a few new tokens over a cached prefix
        (a mixed step's decodes, a verification of speculative tokens): each token one decode row,
        batched as in a decode step (``m.decodes``), or, when every token is one and ``paged``, the
        ``PAGED`` path (RoPE and the store of all rows first, then attention, as in a decode step)."""
        slot_mapping, block_tables = m.slot_mapping, m.block_tables
        self.continuity.prefill()
        m.cu_q, _, m.seqlens_q, m.seqlens_k = prefill_lengths(m.cu_seqlens_q, m.cu_seqlens_k, slot_mapping.shape[0])
        nd = next((b for b, (lq, lk) in enumerate(zip(m.seqlens_q, m.seqlens_k))
                   if not 0 < lq <= DECODE_ROWS_QUERY or lk - lq < 1), len(m.seqlens_q))
        rows, every = m.cu_q[nd], nd == len(m.seqlens_q)
        if not rows or block_tables is None or not (rows >= 2 or every):
            return
        lens = [lk - lq + j + 1 for lq, lk in zip(m.seqlens_q[:nd], m.seqlens_k[:nd]) for j in range(lq)]
        dev = slot_mapping.device
        seq_of_row = torch.repeat_interleave(torch.arange(nd, device=dev), torch.tensor(m.seqlens_q[:nd], device=dev))
        tables = block_tables[:nd] if rows == nd else block_tables.index_select(0, seq_of_row)
        lens_t = torch.tensor(lens, device=dev)
        if every and paged:
            m.path = PAGED
            m.paged_index = cpu_paged.paged_index(slot_mapping, tables, lens_t)
        elif rows >= 2:
            m.decodes = CPUAttentionMetadata(False, slot_mapping[:rows], tables, None, None, lens_t,
                                             min_ctx=min(lens), max_ctx=max(lens), path=GATHERED)
            m.decode_seqs = nd

    def bind_layer(self, module: torch.nn.Module) -> None:
        """Keep a :class:`~tpengine.backends.cpu.kv_mirror.KVMirror` for layer ``module.layer_idx``
        (none with mirrors off)."""
        self.mirrors[module.layer_idx] = mirrors.KVMirror() if self.kv_mirror else None

    def layer_state(self, layer: torch.nn.Module) -> mirrors.KVMirror | None:
        """The KV mirror of ``layer`` (:meth:`bind_layer`), or None."""
        return self.mirrors.get(layer.layer_idx)

    def bind_model(self, stack: torch.nn.Module, tp_size: int) -> None:
        """:meth:`AttentionBackend.bind_model`, and with the C kernels: each layer's norms and activation
        bound to their kernels (:func:`tpengine.backends.cpu.layer_calls.bind_stack`: the model's one
        forward runs them without per-call checks) and each layer's paged decode call where every layer
        takes the kernel (:func:`tpengine.backends.cpu.cpu_paged.bind`, with the profile's
        ``paged_amx_min``; else decode steps take the ``GATHERED`` path). The measured choices (the
        paged kernel's AMX path, the half GEMM dtype) are the CPU platform's, set from its profile
        (:meth:`tpengine.backends.cpu.platform.CPUPlatform.bind_attention`)."""
        from tpengine.backends.cpu import layer_calls

        super().bind_model(stack, tp_size)
        layer_calls.bind_stack(stack, self.cpu_kernels)
        attns = [layer.self_attn for layer in stack.layers[: stack.config.num_hidden_layers]]
        self.paged_calls, self.program = {}, None
        stack.bound_decode = None
        # the activations' dtype: the cache's, or with an int8 cache the q/k/v projection's output
        scales = {a.layer_idx: getattr(a, "kv_scales", None) for a in attns}
        act = {a.layer_idx: a.k_cache.dtype if scales[a.layer_idx] is None else a.kv_scales_dtype for a in attns}
        if not (self.paged and self.cpu_kernels and attns and attns[0].k_cache.device.type == "cpu"
                and all(cpu_paged.available(act[a.layer_idx], a.head_dim, True, scales[a.layer_idx] is not None)
                        for a in attns)):
            return
        # each layer's window and cap bound with its scale (0: none; the kernel reads only a window's blocks)
        self.paged_calls = {a.layer_idx: cpu_paged.bind(a.k_cache, a.v_cache, a.tp_q_to_kv, a.scaling,
                                                        self.paged_amx_min, a.sliding_window or 0,
                                                        a.logit_soft_cap or 0.0, scales[a.layer_idx],
                                                        act[a.layer_idx])
                            for a in attns}
        # the whole one-token step as one C call, where the stack's form and every kernel allow (cpu_program)
        self.program = cpu_program.bind(stack, self.paged_calls, tp_size, act[attns[0].layer_idx])
        if self.program is not None:
            if self.lm_head is not None and tp_size == 1:  # bound again (a new program): its greedy step too
                self.program.bind_greedy(self.lm_head)
            stack.bound_decode = self._program_step(self.program, stack, act[attns[0].layer_idx])

    def bind_head(self, head, tp_size: int) -> str | None:
        """:meth:`AttentionBackend.bind_head`: the decode program's greedy step takes ``head``'s product and
        the argmax (:meth:`tpengine.backends.cpu.cpu_program.Program.bind_greedy`) at one rank, where the
        stack has a program and the head a C call at one row; returns why not (the head keeps its own
        greedy path), or None."""
        self.lm_head = head
        if self.program is None or tp_size != 1:
            return "no decode program at one rank"
        return self.program.bind_greedy(head)

    @staticmethod
    def _program_step(program, stack, dtype: torch.dtype):
        """The ``stack``'s ``bound_decode(h, positions, ctx)``: ``program`` for a step of one token on the
        ``PAGED`` path (``h [1, hidden]`` of ``dtype``; its RoPE rows from :func:`_program_rope`), else None
        (the forward's own path). Where the model runner asks for greedy ids (``ctx.greedy``) and the program
        took the head (``n_greedy``), the step also picks the token in the same C call and leaves its id
        ``[1]`` in ``ctx.ids``."""
        def step(h: torch.Tensor, positions: torch.Tensor, ctx):
            attn = ctx.attn
            if h.shape[0] != 1 or attn.path != PAGED or h.dtype != dtype:
                return None
            rope = _program_rope(stack, h, positions, ctx, dtype)
            if ctx.greedy and program.n_greedy:
                ctx.ids = program.greedy(h.contiguous(), rope, attn.paged_index)
                return program.out  # (the final norm's row; the runner takes ctx.ids instead of the head)
            return program(h.contiguous(), rope, attn.paged_index)
        return step

    def describe(self) -> str | None:
        """The paged decode kernel's measured path (:meth:`bind_model`), or None."""
        return None if self.paged_choice is None else "paged decode attention " + self.paged_choice.describe()

    def cache_changed(self) -> None:
        """Block copies rewrote the cache: the mirrors start again at the next decode step."""
        self.continuity.prefill()

    def forward(self, qkv, rope, layer, ctx) -> torch.Tensor:
        """:meth:`AttentionBackend.forward` on the step's path (:meth:`prepare`): ``PAGED`` runs the
        layer's bound paged C call (RoPE, the KV store and attention in one call), the others the
        torch paths."""
        attn = ctx.attn
        if attn.path == PAGED:
            return self.paged_calls[layer.layer_idx](qkv, _step_rope(attn, rope, qkv.dtype), attn.paged_index)
        return super().forward(qkv, rope, layer, ctx)

    def store_kvcache(self, key, value, k_cache, v_cache, attn: CPUAttentionMetadata, kv_scales=None) -> None:
        """:func:`tpengine.backends.reference.store_kvcache` at ``attn.slot_mapping`` (an int8 cache with
        ``kv_scales``: quantized, :func:`tpengine.backends.kv_quant.store`). Raises ValueError on shape
        mismatch; IndexError for a slot out of range (from the bounds ``prepare`` read)."""
        slot_mapping = attn.slot_mapping
        num_blocks, bs, hkv, d = check_store(key, value, k_cache, v_cache, slot_mapping)
        if key.shape[0] == 0:
            return
        check_slots(slot_mapping, attn.slot_min, attn.slot_max, num_blocks * bs)
        if kv_scales is not None:
            keep = slot_mapping >= 0
            kv_quant.store(key[keep], value[keep], k_cache, v_cache, kv_scales, slot_mapping[keep])
            return
        if attn.slot_min >= 0 and k_cache.is_contiguous() and v_cache.is_contiguous():
            cpu_fused.copy_rows((key, value), (k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)), slot_mapping,
                                cpu_kernels=self.cpu_kernels)
            return
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        blk, off = slots // bs, slots % bs
        k_cache[blk, off] = key[keep].to(k_cache.dtype)
        v_cache[blk, off] = value[keep].to(v_cache.dtype)

    def prefill_attention(self, q, k, v, k_cache, v_cache, q_to_kv, scale, attn: CPUAttentionMetadata,
                          sliding_window: int | None = None, soft_cap: float | None = None, kv_scales=None):
        """:func:`tpengine.backends.reference.prefill_attention` with the step's lengths from ``attn``; a
        layer with a ``sliding_window`` or ``soft_cap`` runs :func:`tpengine.backends.cpu.prefill.masked_attention`
        (over the prefix blocks inside the window only) where the others run SDPA's causal and prefix calls.
        An int8 cache's prefix is read dequantized to ``q``'s dtype (:func:`tpengine.backends.kv_quant.gather`)."""
        _, _, hkv, d = check_cache(k_cache, v_cache)
        check_heads(q, q_to_kv, hkv, d)
        if k.shape != v.shape or k.shape[0] != q.shape[0] or tuple(k.shape[1:]) != (hkv, d):
            raise ValueError(f"k/v must be [{q.shape[0]}, {hkv}, {d}]; got {tuple(k.shape)}, {tuple(v.shape)}")
        cu_q, lqs, lks, block_tables = attn.cu_q, attn.seqlens_q, attn.seqlens_k, attn.block_tables
        gqa = _is_gqa(q_to_kv, hkv)
        masked = sliding_window is not None or soft_cap is not None

        def heads(x):  # [..., Hkv, D] -> the KV head of every query head (unless SDPA's GQA does it)
            return x if gqa else x.index_select(-2, q_to_kv)

        def cached(which: int, row: torch.Tensor, n: int, start: int = 0) -> torch.Tensor:  # a prefix, q's dtype
            c = (k_cache, v_cache)[which]
            if kv_scales is None:
                return cpu_prefill.gather_cache(c, row, n, start).to(q.dtype)
            return kv_quant.gather(c, kv_scales[which], row, n, start, q.dtype)

        if lqs and lqs == lks and min(lqs) == max(lqs) > 0:
            # no cached prefix and equal lengths (a batch of same-length prompts): one batched call
            b, n = len(lqs), lqs[0]
            qh, kh, vh = (x.unflatten(0, (b, n)).transpose(1, 2) for x in (q, heads(k), heads(v)))
            if masked:
                o = cpu_prefill.masked_attention(qh, kh, vh, scale, 0, sliding_window, soft_cap)
                return o.transpose(1, 2).reshape(q.shape).contiguous()
            # half-precision matmuls beat SDPA's flash kernel here only where this machine has a fast
            # half-precision GEMM (the profile's half GEMM choice, measured at bind; not on AVX2-only CPUs)
            if (q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype and q.device.type == "cpu"
                    and self.gemm_dtypes.get(q.dtype, q.dtype) == q.dtype):
                o = cpu_prefill.causal_matmul_attention(qh, kh, vh, scale, self.cpu_kernels)
            else:
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
            return o.transpose(1, 2).reshape(q.shape).contiguous()
        out = q.new_empty(q.shape)  # contiguous, whatever q's strides
        nd = 0
        if attn.decodes is not None:  # the leading few-token sequences: one batched decode call
            nd, rows = attn.decode_seqs, attn.decodes.context_lens.shape[0]
            out[:rows] = self.decode_attention(q[:rows], k_cache, v_cache, q_to_kv, scale, attn.decodes, None,
                                               sliding_window, soft_cap, kv_scales=kv_scales)
        for b, (lq, lk) in enumerate(zip(lqs, lks)):
            if lq == 0 or b < nd:
                continue
            s, e, p = cu_q[b], cu_q[b + 1], lk - lq
            # 4-D [1, H, L, D]: CPU SDPA's flash kernel (a 3-D call falls back to the math path)
            qh = q[s:e].transpose(0, 1)[None]  # [1, Hq, Lq, D]
            kh, vh = (heads(x[s:e]).transpose(0, 1)[None] for x in (k, v))  # [1, Hq or Hkv, Lq, D]
            if masked:  # the prefix from the first position the first query sees: the blocks before it unread
                lo = window_start(p, sliding_window)
                if p > lo and block_tables is None:
                    raise ValueError(f"sequence {b} has a cached prefix ({p} tokens) but block_tables is None")
                if p > lo:
                    kh, vh = (torch.cat([heads(cached(i, block_tables[b], p, lo)).transpose(0, 1)[None], x], 2)
                              for i, x in ((0, kh), (1, vh)))
                o = cpu_prefill.masked_attention(qh, kh, vh, scale, p - lo, sliding_window, soft_cap)
            elif p == 0:
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                if block_tables is None:
                    raise ValueError(f"sequence {b} has a cached prefix ({p} tokens) but block_tables is None")
                kp, vp = (heads(cached(i, block_tables[b], p)).transpose(0, 1)[None]
                          for i in (0, 1))  # [1, Hq or Hkv, p, D]
                o = cpu_prefill.prefix_attention(qh, kp, vp, kh, vh, scale, gqa)
            out[s:e] = o[0].transpose(0, 1)
        return out

    def decode_attention(self, q, k_cache, v_cache, q_to_kv, scale, attn: CPUAttentionMetadata,
                         mirror: mirrors.KVMirror | None = None, sliding_window: int | None = None,
                         soft_cap: float | None = None, kv_scales=None) -> torch.Tensor:
        """:func:`tpengine.backends.reference.decode_attention` with the step's lengths from ``attn``.

        Groups the query heads by their KV head (``[B, Hkv, G, D]``, so each KV head is gathered and
        read once whatever ``q_to_kv`` is), gathers every sequence's first ``max_ctx`` cached tokens
        into ``[B, Hkv, max_ctx, D]`` (half types: padded to the mirror's capacity, and kept across
        steps in ``mirror`` when mirrors are on and fit, :func:`tpengine.backends.cpu.kv_mirror.usable`)
        and attends in one batched call: the C kernel (bfloat16, ``cpu_kernels``), SDPA for a few
        sequences, or half-precision matmuls with a float32 softmax (which CPU SDPA is several times
        slower than for one query token per sequence); float32 runs SDPA over whole blocks, masking
        positions ``>= context_lens[b]`` only when the lengths differ. A layer with a ``sliding_window``
        masks the keys before it too (one mask per step and window value, :func:`key_mask`), and one with
        a ``soft_cap`` caps the scores: the C kernel's in torch before its softmax, else the bmm
        arithmetic (:func:`half_decode`; float32 too, where SDPA takes no cap). An int8 cache (``kv_scales``)
        takes the float32 branch's whole-block gather, dequantized to ``q``'s dtype, and keeps no mirror
        (a mirror of dequantized rows would take more memory than the int8 cache itself; the paged C
        kernel reads int8 where the C kernels run). Raises ValueError on shape mismatch or when ``max_ctx``
        exceeds the block table's capacity."""
        block_tables, context_lens = attn.block_tables, attn.context_lens
        _, bs, hkv, d = check_decode(q, k_cache, v_cache, q_to_kv, block_tables, context_lens)
        nb = q.shape[0]
        if nb == 0:
            return q.new_empty(q.shape)
        half = (q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype and k_cache.is_contiguous()
                and v_cache.is_contiguous() and kv_scales is None)
        m = attn.get(("decode", bs, hkv, half), lambda: _decode_indices(attn, bs, hkv, half))
        if attn.max_ctx == 0:
            return q.new_zeros(q.shape)
        g, q_slots, out_slots = _groups(tuple(q_to_kv.tolist()), hkv, q.device)
        qg = (q if q_slots is None else q.index_select(1, q_slots)).reshape(nb, hkv, g, d)
        if half:
            if mirror is not None and attn.mirror is not None and mirrors.usable(nb, attn.max_ctx, k_cache):
                # [B, Hkv, capacity >= max_ctx, D], kept across the decode steps of one batch
                kg, vg = mirror.decode_kv(k_cache, v_cache, m.index, block_tables, context_lens, attn.max_ctx,
                                          attn.mirror, self.cpu_kernels)
            else:  # the same shapes, gathered for this step only
                kg, vg = mirrors.gather(k_cache, v_cache, m.index, nb, attn.max_ctx)
            if sliding_window is not None or soft_cap is not None:
                n = kg.shape[2]
                valid, bias = attn.get(("key-mask", n, sliding_window),
                                       lambda: key_mask(context_lens, n, sliding_window))
                if cpu_decode.available(q, g, d, self.cpu_kernels):
                    out = cpu_decode.decode_attention(qg, kg, vg, context_lens, scale, soft_cap=soft_cap, bias=bias)
                else:
                    out = half_decode(qg, kg, vg, valid, bias, scale, nb * hkv <= self.sdpa_rows, soft_cap)
            elif cpu_decode.available(q, g, d, self.cpu_kernels):  # the bmm branch's arithmetic in a C kernel
                out = cpu_decode.decode_attention(qg, kg, vg, context_lens, scale)
            else:
                # the same key as a windowless layer's above: one mask per step and window value
                valid, bias = attn.get(("key-mask", kg.shape[2], None), lambda: key_mask(context_lens, kg.shape[2]))
                out = half_decode(qg, kg, vg, valid, bias, scale, nb * hkv <= self.sdpa_rows)
        else:  # whole blocks, read as a strided [B, Hkv, L, D]

            def gather(cache):
                scale = None if kv_scales is None else kv_scales[0 if cache is k_cache else 1]
                return _gather_blocks(cache, scale, m.index, nb, attn.max_ctx, q.dtype)

            if sliding_window is not None or soft_cap is not None:
                valid, bias = attn.get(("key-mask", attn.max_ctx, sliding_window),
                                       lambda: key_mask(context_lens, attn.max_ctx, sliding_window))
                kg, vg = gather(k_cache), gather(v_cache)
                if soft_cap is None:
                    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=valid, scale=scale)
                else:
                    out = half_decode(qg, kg.contiguous(), vg.contiguous(), valid, bias, scale, False, soft_cap)
            else:
                out = F.scaled_dot_product_attention(qg, gather(k_cache), gather(v_cache), attn_mask=m.valid,
                                                     scale=scale)
        out = out.reshape(nb, hkv * g, d)
        if out_slots is not None:
            out = out.index_select(1, out_slots)
        if attn.min_ctx == 0:
            out = out.masked_fill_((context_lens == 0)[:, None, None], 0.0)
        return out.contiguous()


def _gather_blocks(cache: torch.Tensor, scale: torch.Tensor | None, index: torch.Tensor, nb: int, max_ctx: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """The first ``max_ctx`` cached tokens of ``nb`` sequences, read as whole blocks (``index``: each
    sequence's block ids, ``[nb * blocks]``) -> a strided ``[nb, Hkv, max_ctx, D]`` in ``dtype``; an int8
    ``cache`` with its ``scale`` dequantized (:func:`tpengine.backends.kv_quant.dequantize`)."""
    _, bs, hkv, d = cache.shape
    n_blk = index.numel() // nb
    if scale is not None:
        kv = kv_quant.dequantize(cache.index_select(0, index), scale.index_select(0, index), dtype)
        return kv.view(nb, n_blk * bs, hkv, d)[:, :max_ctx].transpose(1, 2)
    kv = F.embedding(index, cache.reshape(cache.shape[0], -1)).view(nb, n_blk * bs, hkv, d)
    return kv[:, :max_ctx].transpose(1, 2).to(dtype)


@functools.lru_cache(maxsize=256)
def _groups(q_to_kv: tuple[int, ...], hkv: int, device: torch.device):
    """Query heads grouped by the KV head they read, for attention that reads each KV head once.

    Returns ``(G, gather, scatter)``: every KV head gets ``G`` query slots (the largest group;
    smaller groups are padded with a repeat of one of their heads). ``gather [Hkv*G]`` is the query
    head in each slot and ``scatter [Hq]`` the slot of each query head; both are None when
    ``q_to_kv`` is already ``h // G`` (standard GQA), where ``[Hq, D]`` views as ``[Hkv, G, D]``.
    """
    groups = [[h for h, j in enumerate(q_to_kv) if j == kv] for kv in range(hkv)]
    g = max(len(x) for x in groups)
    if list(q_to_kv) == [h // g for h in range(len(q_to_kv))] and g * hkv == len(q_to_kv):
        return g, None, None
    gather, scatter = [], [0] * len(q_to_kv)
    for kv, heads in enumerate(groups):
        for i, h in enumerate(heads):
            scatter[h] = kv * g + i
        gather += heads + [heads[-1] if heads else 0] * (g - len(heads))
    return g, torch.tensor(gather, device=device), torch.tensor(scatter, device=device)


def _is_gqa(q_to_kv: torch.Tensor, hkv: int) -> bool:
    """True if local query head ``h`` reads KV head ``h // (Hq // Hkv)`` (SDPA's ``enable_gqa``)."""
    return _groups(tuple(q_to_kv.tolist()), hkv, q_to_kv.device)[1] is None


@dataclass(frozen=True)
class _DecodeIndices:
    """What every layer of one decode step shares: the gather index (float32: the first
    ``ceil(max_ctx / bs)`` block ids of each row, for whole-block copies; half types: the
    ``[B, Hkv, max_ctx]`` rows of the ``[slots * Hkv, D]`` cache view, for a contiguous copy) and,
    for float32, the key mask ``valid`` (None when every sequence has ``max_ctx`` tokens; the half
    path masks its own padded key length, see :func:`key_mask`)."""

    index: torch.Tensor | None
    valid: torch.Tensor | None


def _decode_indices(attn: CPUAttentionMetadata, bs: int, hkv: int, half: bool) -> _DecodeIndices:
    """Raises ValueError when ``max_ctx`` exceeds the block table's capacity."""
    block_tables, context_lens, max_ctx = attn.block_tables, attn.context_lens, attn.max_ctx
    if max_ctx > block_tables.shape[1] * bs:
        raise ValueError(
            f"context length {max_ctx} exceeds block table capacity {block_tables.shape[1]}x{bs}"
        )
    if max_ctx == 0:
        return _DecodeIndices(None, None)
    dev = block_tables.device
    valid = key_mask(context_lens, max_ctx)[0] if attn.min_ctx != max_ctx and not half else None
    if half:
        pos = torch.arange(max_ctx, device=dev)
        slots = block_tables[:, pos // bs].clamp_min(0) * bs + pos % bs  # [B, L]; -1 padding masked
        index = (slots[:, None, :] * hkv + torch.arange(hkv, device=dev)[None, :, None]).flatten()
    else:
        index = block_tables[:, : cdiv(max_ctx, bs)].clamp_min(0).flatten()  # -1 padding: block 0, masked
    return _DecodeIndices(index, valid)
