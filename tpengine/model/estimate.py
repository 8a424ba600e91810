"""Per-rank memory estimate of an engine process, before anything is loaded.

A rank holds its weights (its ShardPlan slices), its KV cache (the configured budget, whole
blocks) and the runtime: the interpreter with torch and transformers imported, plus the largest
step's activations. ``tpengine-shard info MODEL --tp N`` prints it; the run summary prints the
measured peak beside which it should be read.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpengine.backends import kv_quant
from tpengine.model.plan import ShardPlan
from tpengine.utils import GIB

# Resident memory of a CPU engine process apart from its weights, KV cache and activations: Python,
# torch, transformers, the tokenizer and the C kernels; set so that the estimate meets the peaks
# `make bench-scale` measured (README, "At scale"); activations are added by the formula below.
RUNTIME_BASE_BYTES = 560 << 20


@dataclass(frozen=True)
class RankMemory:
    """Estimated resident bytes of one rank: ``weights`` + ``kv_cache`` + ``runtime`` = ``total``;
    ``kv_per_token``: the KV-cache bytes one token takes on the rank (scales of an int8 cache included)."""

    rank: int
    weights: int
    kv_cache: int
    runtime: int
    kv_per_token: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.runtime


def kv_token_bytes(plan: ShardPlan, rank: int, num_layers: int, elem: int, kv_cache_dtype: str = "auto") -> int:
    """KV-cache bytes of one token on ``rank``: ``2 x num_layers x local KV heads x head_dim`` elements of
    ``elem`` bytes ("auto"), or of one byte plus a float32 scale per head row ("int8";
    :func:`tpengine.backends.kv_quant.bytes_per_token`)."""
    return kv_quant.bytes_per_token(num_layers, plan.ranks[rank].num_kv_heads, plan.head_dim, elem, kv_cache_dtype)


def kv_cache_bytes(plan: ShardPlan, rank: int, num_layers: int, elem: int, kv_cache_gb: float,
                   block_size: int, kv_cache_dtype: str = "auto") -> int:
    """The KV cache the engine allocates on ``rank`` for a ``kv_cache_gb`` GiB budget: whole blocks of
    ``block_size`` tokens of :func:`kv_token_bytes` each."""
    per_block = block_size * kv_token_bytes(plan, rank, num_layers, elem, kv_cache_dtype)
    return int(kv_cache_gb * GIB // per_block) * per_block


def activation_bytes(plan: ShardPlan, rank: int, elem: int, step_tokens: int, max_num_seqs: int) -> int:
    """The largest step's live activations on ``rank``: for ``step_tokens`` tokens the residual
    stream, the normed input and a block's output (3 x hidden), the q/k/v GEMM output, and the
    gate/up output with SiLU's product (3 x local intermediate; in a MoE layer the larger of that and
    ``top_k`` experts' rows of the local expert intermediate, the routed rows' copy and output, the
    float32 router scores and a shared expert's local intermediate); plus the LM head's float32
    logits of ``max_num_seqs`` rows of the local vocabulary."""
    rp, hd = plan.ranks[rank], plan.head_dim
    mlp = 3 * rp.intermediate_size
    if plan.num_experts:
        shared = rp.shared_expert_intermediate[1] - rp.shared_expert_intermediate[0]
        moe = (plan.top_k * (3 * rp.expert_intermediate_size + 2 * plan.hidden_size) + 4 * plan.num_experts // elem
               + 3 * shared)
        mlp = max(mlp, moe)
    per_token = 3 * plan.hidden_size + (rp.num_q_heads + 2 * rp.num_kv_heads) * hd + mlp
    return step_tokens * per_token * elem + max_num_seqs * rp.vocab_size * 4 * 2


def estimate(plan: ShardPlan, weight_bytes: list[int], num_layers: int, elem: int, kv_cache_gb: float,
             block_size: int, step_tokens: int, max_num_seqs: int, kv_cache_dtype: str = "auto") -> list[RankMemory]:
    """One :class:`RankMemory` per rank: ``weight_bytes[r]`` (from the plan's slices), the KV cache
    of :func:`kv_cache_bytes` (``kv_cache_dtype``: the engine's), and :data:`RUNTIME_BASE_BYTES` +
    :func:`activation_bytes`."""
    return [RankMemory(r, weight_bytes[r],
                       kv_cache_bytes(plan, r, num_layers, elem, kv_cache_gb, block_size, kv_cache_dtype),
                       RUNTIME_BASE_BYTES + activation_bytes(plan, r, elem, step_tokens, max_num_seqs),
                       kv_token_bytes(plan, r, num_layers, elem, kv_cache_dtype))
            for r in range(plan.tp_size)]
