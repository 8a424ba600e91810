"""The Triton attention backend (CUDA; CPU tensors only under ``TRITON_INTERPRET=1``): the kernels of
:mod:`tpengine.backends.cuda.triton_kernels` behind the :class:`tpengine.backends.base.AttentionBackend`
interface. Its decode steps never sync with the host, so they can be captured in CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpengine.backends.base import AttentionBackend
from tpengine.backends.checks import prefill_lengths
from tpengine.backends.cuda import triton_kernels as kernels
from tpengine.context import StepIndex

__all__ = ["TritonAttentionBackend", "TritonAttentionMetadata"]


@dataclass
class TritonAttentionMetadata(StepIndex):
    """One step's attention metadata: the index tensors (contiguous) and, for a prefill, the host
    copy of its lengths (:func:`tpengine.backends.checks.prefill_lengths`; None in decode, which
    reads everything on the device)."""

    lengths: tuple | None = None


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


class TritonAttentionBackend(AttentionBackend):
    """Triton paged attention. ``cpu_kernels``/``kv_mirror`` are CPU options and do not apply here."""

    name = "triton"
    graph_safe = True

    def __repr__(self) -> str:
        return "TritonAttentionBackend()"

    def prepare(self, is_prefill, slot_mapping, block_tables, cu_seqlens_q=None, cu_seqlens_k=None,
                context_lens=None) -> TritonAttentionMetadata:
        """See :meth:`AttentionBackend.prepare`; a prefill reads its lengths here (one host sync per
        step), a decode step does not sync (CUDA-graph safe). Raises ValueError for malformed offsets."""
        m = TritonAttentionMetadata(is_prefill, slot_mapping.contiguous(), _contiguous(block_tables),
                                    _contiguous(cu_seqlens_q), _contiguous(cu_seqlens_k), _contiguous(context_lens))
        if is_prefill:
            m.lengths = prefill_lengths(cu_seqlens_q, cu_seqlens_k, slot_mapping.shape[0])
        return m

    def store_kvcache(self, key, value, k_cache, v_cache, attn: TritonAttentionMetadata, kv_scales=None) -> None:
        """:func:`tpengine.backends.cuda.triton_kernels.store_kvcache` at ``attn.slot_mapping``."""
        kernels.store_kvcache(key, value, k_cache, v_cache, attn.slot_mapping, kv_scales)

    def prefill_attention(self, q, k, v, k_cache, v_cache, q_to_kv, scale, attn: TritonAttentionMetadata,
                          sliding_window=None, soft_cap=None, kv_scales=None):
        """:func:`tpengine.backends.cuda.triton_kernels.prefill_attention` with the step's lengths and the
        layer's window, cap and int8 cache scales."""
        return kernels.prefill_attention(q, k, v, k_cache, v_cache, attn.cu_seqlens_q, attn.cu_seqlens_k,
                                         attn.block_tables, q_to_kv, scale, lengths=attn.lengths,
                                         sliding_window=sliding_window, soft_cap=soft_cap, kv_scales=kv_scales)

    def decode_attention(self, q, k_cache, v_cache, q_to_kv, scale, attn: TritonAttentionMetadata, mirror=None,
                         sliding_window=None, soft_cap=None, kv_scales=None):
        """:func:`tpengine.backends.cuda.triton_kernels.decode_attention` with the layer's window, cap and int8
        cache scales (``mirror`` is unused)."""
        return kernels.decode_attention(q, k_cache, v_cache, attn.block_tables, attn.context_lens, q_to_kv, scale,
                                        sliding_window=sliding_window, soft_cap=soft_cap, kv_scales=kv_scales)
