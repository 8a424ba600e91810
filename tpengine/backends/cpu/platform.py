"""The CPU platform (:class:`tpengine.backends.platform.Platform`): the process set-up
(:mod:`tpengine.backends.cpu.process`), the fused ops with their C kernels
(:class:`~tpengine.backends.cpu.cpu_fused.FusedOps`), oneDNN's packed layout, and every measured
choice of the CPU (:mod:`tpengine.backends.cpu.measured`), kept in one
:class:`~tpengine.backends.cpu.profile.CPUProfile` and bound into the layers and the attention backend."""

from __future__ import annotations

import dataclasses
import math

import torch

from tpengine.backends.cpu import (
    cpu_blocked,
    cpu_gemm,
    cpu_gemv,
    cpu_program,
    cpu_qgemv,
    cpu_widen,
    greedy,
    linear_layout,
    measured,
    process,
    qgemv_choice,
)
from tpengine.backends.cpu.cpu_fused import FusedOps
from tpengine.backends.cpu.memory import collapse_huge_pages, lazy_zeros
from tpengine.backends.cpu.profile import CPUProfile
from tpengine.backends.platform import Platform

_HALF = (torch.bfloat16, torch.float16)


def _linears(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of ``module`` with a linear implementation to bind (``impl`` and ``pack``)."""
    return [m for m in module.modules() if hasattr(m, "impl") and hasattr(m, "pack")]


def _quantized(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The quantized weights of ``module`` (:class:`~tpengine.model.quant.weights.QuantizedWeight`)."""
    return [m for m in module.modules() if hasattr(m, "set_kernels")]


class CPUPlatform(Platform):
    """The CPU: C kernels where they are built, oneDNN's layout where measured faster, shared memory."""

    name = "cpu"
    quantized_weights = True

    def setup_process(self, config, tp, plan) -> None:
        """:func:`tpengine.backends.cpu.process.setup_process`."""
        process.setup_process(config, tp, plan)

    def release_free_memory(self) -> None:
        """:func:`tpengine.backends.cpu.process.release_free_memory` (glibc's ``malloc_trim``)."""
        process.release_free_memory()

    def weights_to_huge_pages(self, module: torch.nn.Module) -> tuple[int, int]:
        """A long job's (not :func:`tpengine.backends.cpu.measured.short_job`, whose few steps would not
        repay it) weights, bound in their final layouts, moved into transparent huge pages
        (:func:`_weights_to_huge_pages`), for at most the seconds this process may spend at load for
        speed: :func:`tpengine.backends.cpu.measured.measure_budget_s` where the user set one
        (``$TPENGINE_MEASURE_BUDGET_S``; the tests' 0: none) or the job stated its work; a server or
        ``LLM()``: no limit. Returns ``(collapsed, regions)``: ``(0, 0)`` for a short job."""
        if measured.short_job():
            return 0, 0
        return _weights_to_huge_pages(module, measured.measure_budget_s(unstated=math.inf))

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The KV cache on an anonymous mapping (:func:`tpengine.backends.cpu.memory.lazy_zeros`): pages
        are zeroed by the kernel as blocks are first written, not all up front.

        Raises:
            MemoryError: the mapping cannot be made.
        """
        return lazy_zeros(shape, dtype)

    def fused_ops(self, cpu_kernels: bool) -> FusedOps:
        """:class:`~tpengine.backends.cpu.cpu_fused.FusedOps`: the C kernels where they take the tensors."""
        return FusedOps(cpu_kernels)

    def maps_weights(self) -> bool:
        """A short job's (:func:`tpengine.backends.cpu.measured.short_job`: a one-token batch job, whose weights
        also stay plain): its few forwards do not feel the file's 8-byte alignment, and its load skips
        reading (and faulting in fresh memory for) the weights it maps; a longer job reads them into
        aligned memory of its own."""
        return measured.short_job()

    def prepack(self, weight: torch.Tensor, layout: str = "packed") -> torch.Tensor | None:
        """oneDNN's layout or tpengine's blocked one, :func:`tpengine.backends.cpu.linear_layout.prepack`."""
        return linear_layout.prepack(weight, layout)

    def choose_layouts(self, shapes, dtype, setting, cpu_kernels, groups=None, model=None, tp_size=1, head=None):
        """:func:`tpengine.backends.cpu.linear_layout.choose_layouts` (measured, cached or forced), for the
        whole model where its form takes a decode program (:func:`tpengine.backends.cpu.cpu_program.product_shapes`);
        a tied ``head``'s shape measured first (its timings serve :meth:`bind_model`'s head choice)."""
        program = cpu_program.product_shapes(model, tp_size, dtype) if model is not None else set()
        return linear_layout.choose_layouts(shapes, dtype, setting, cpu_kernels, groups, program, head)

    def bind_model(self, module: torch.nn.Module, layouts: dict, *, tie: bool, dtype: torch.dtype,
                   cpu_kernels: bool, cpu_linear: str, rank: int, pack: bool = True, tp_size: int = 1) -> CPUProfile:
        """Measure what the CPU chooses for the loaded ``module`` (each step through
        :mod:`tpengine.backends.cpu.measured`), then bind it: the plain weights' kernels per row bucket
        (``layouts``), a tied head's paths (``pack``: the layouts were chosen), the half GEMM dtype, the
        quantized kernels, every linear's ``impl``, and the LM head's greedy pick. Returns the profile."""
        head = module.get_output_embeddings()
        plain_head = head is not None and getattr(head, "weight", None) is not None
        _set_kernels(module, layouts, head if tie else None)
        head_layout = None
        if pack and tie and plain_head and head.quant is None:  # one copy of the tied rows: plain or blocked
            head_layout = linear_layout.choose_head(head.weight, cpu_linear, cpu_kernels)
            head.kernels = head_layout.kernels
            if head_layout.layout == "blocked":
                _block_tied_head(head, module.get_input_embeddings())
        gemm = {dtype: cpu_widen.gemm_choice(dtype)} if dtype in _HALF else {}  # measured here, not in a step
        quant = _bind_quantized(module, cpu_kernels, rank, gemm.get(dtype), dtype, tp_size)
        for m in _linears(module):  # every linear, now that its weight and choices are final
            m.bind(linear_layout.bind_layer(m, head=m is head))
        row_max = greedy_choice = None
        if head is not None and hasattr(head, "greedy_mm"):
            row_max, greedy_choice = greedy.bind_head(head, dtype, cpu_kernels)
        return CPUProfile(layouts, head_layout, quant, row_max, greedy_choice, gemm)

    def bind_attention(self, backend, stack: torch.nn.Module, profile: CPUProfile) -> CPUProfile:
        """Once the KV cache is bound, before ``backend.bind_model`` (its decode program takes them): the
        paged decode kernel's AMX path for a bfloat16 cache on a CPU
        with AMX (:func:`tpengine.backends.cpu.cpu_paged.choose_amx`, timed on this rank's head layout),
        and the profile's choices set on the CPU attention ``backend`` (the half GEMM dtype, the AMX
        path). Returns the profile with the paged choice."""
        from tpengine.backends.cpu import cpu_paged
        from tpengine.backends.cpu.attention import CPUAttentionBackend

        if not isinstance(backend, CPUAttentionBackend):
            return profile
        attn = stack.layers[0].self_attn
        choice = None
        if (backend.cpu_kernels and attn.k_cache.dtype == torch.bfloat16
                and cpu_paged.available(torch.bfloat16, attn.head_dim, True)):
            choice = cpu_paged.choose_amx(attn.tp_q_to_kv, attn.num_key_value_heads, attn.head_dim,
                                          attn.k_cache.shape[1])
        profile = dataclasses.replace(profile, paged_choice=choice,
                                      amx_min_batch=cpu_paged.amx_min_batch(choice))
        backend.paged_choice, backend.paged_amx_min = choice, profile.amx_min_batch
        backend.gemm_dtypes = profile.gemm_dtypes()
        return profile


def _weights_to_huge_pages(module: torch.nn.Module, budget_s: float = math.inf) -> tuple[int, int]:
    """Every tensor ``module``'s layers hold (parameters, buffers, and the blocked or quantized weights
    and scales they keep as attributes) moved into transparent huge pages where the kernel can
    (:func:`tpengine.backends.cpu.memory.collapse_huge_pages`: addresses and bytes kept, so kernels and
    programs already bound to them stay valid). Call it after loading's trim
    (:func:`tpengine.backends.cpu.process.release_free_memory`): a trim of a free hole inside a huge
    page splits it. ``budget_s``: :func:`tpengine.backends.cpu.memory.collapse_huge_pages`'s. Returns
    ``(collapsed, regions)``."""
    tensors = []
    for m in module.modules():
        tensors += [v for v in vars(m).values() if isinstance(v, torch.Tensor)]
        tensors += [t for t in m._parameters.values() if t is not None]
        tensors += [t for t in m._buffers.values() if t is not None]
    return collapse_huge_pages(tensors, budget_s=budget_s)


def _block_tied_head(head, emb) -> None:
    """Hold a tied LM head's and embedding's rows in the blocked layout only
    (:func:`tpengine.backends.cpu.cpu_blocked.pack`): the head multiplies through it, the embedding's
    ``lookup`` gathers its rows from it (:func:`tpengine.backends.cpu.cpu_blocked.rows`); both plain
    ``weight`` fields become None, so the plain table is freed."""
    blocked = cpu_blocked.pack(head.weight)
    head.packed_bytes = head.weight.numel() * head.weight.element_size()
    head.packed, head.weight, head.impl = blocked, None, None
    emb.weight, emb.lookup = None, (lambda ids: cpu_blocked.rows(blocked, ids))


def _set_kernels(module: torch.nn.Module, layouts: dict, tied_head) -> None:
    """Each plain weight's path per row bucket from its shape's measured layout (``layouts``), where
    every kernel named takes the weight; a tied head (``tied_head``) is chosen on its own."""
    for m in _linears(module):
        if m.weight is None or m is tied_head:
            continue
        choice = layouts.get(tuple(m.weight.shape))
        if choice is None:
            continue
        takes = {"plain": True, "gemv": cpu_gemv.available(m.weight), "gemm": cpu_gemm.available(m.weight),
                 "widen": cpu_widen.available(m.weight)}
        if choice.kernels and all(takes[k] for k in choice.kernels):
            m.kernels = choice.kernels


def _bind_quantized(module: torch.nn.Module, cpu_kernels: bool, rank: int, gemm, dtype,
                    tp_size: int = 1) -> dict[str, dict]:
    """Give every quantized weight the C kernels (:mod:`tpengine.backends.cpu.cpu_qgemv`) and, with
    ``cpu_kernels``, measure them against torch's per weight shape (:func:`qgemv_choice.choose`: each
    rank its own shapes, no collective; the timings are cached per rank, so every later load makes the
    same choice); ``gemm``: the half GEMM choice their dequantize-then-GEMM path follows. {} without
    ``cpu_kernels`` or quantized weights."""
    groups: dict[str, list] = {}
    program, in_program = set(), _program_quantized(module, dtype, tp_size)
    for m in _quantized(module):
        m.set_kernels(cpu_qgemv)
        if cpu_kernels and m.kernels_take:
            kind = type(m).__name__.removesuffix("Weight").lower()
            group = f"g{m.group_size}" if m.group_size else "per channel"
            key = f"{kind} {group} {m.in_features}->{m.out_features}"
            groups.setdefault(key, []).append(m)
            if id(m) in in_program:
                program.add(key)
    deq = cpu_widen.gemm_dtype(dtype, gemm) if gemm is not None else None
    return qgemv_choice.choose(groups, rank, deq, program) if groups else {}


def _program_quantized(module: torch.nn.Module, dtype: torch.dtype, tp_size: int) -> set[int]:
    """The ids of the quantized weights a decode program of ``module`` would multiply by (its layers' q/k/v, o,
    gate/up and down; :func:`tpengine.backends.cpu.cpu_program.product_shapes`' products) at ``tp_size``;
    empty where the model's form takes no program (:func:`~tpengine.backends.cpu.cpu_program.form_why_not`)."""
    stack = getattr(module, "model", None)
    if stack is None or cpu_program.form_why_not(stack, tp_size, dtype) is not None:
        return set()
    return {id(lin.quant) for layer in stack.layers[:stack.config.num_hidden_layers]
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if getattr(lin, "quant", None) is not None}


PLATFORM = CPUPlatform
