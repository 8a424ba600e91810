"""Vocabulary-parallel embedding and LM head (Megatron-LM, Shoeybi et al. 2019).

The vocabulary is padded to a multiple of tp (:class:`tpengine.model.plan.ShardPlan`); rank r holds
rows ``[vocab_start, vocab_end)`` of the padded table, padding rows are zero. Under
``--quantization`` either layer holds ``quant`` (a :class:`~tpengine.model.quant.weights.QuantizedWeight`
of those rows) instead of ``weight``: the lookup dequantizes only the rows it reads, the LM head
multiplies through the quantized kernel; a tied pair shares one ``quant``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpengine.backends import torch_ops
from tpengine.backends.torch_ops import TorchOps
from tpengine.comm import all_reduce, gather_to_driver
from tpengine.distributed import get_tp
from tpengine.model.layers.linear import _Packable
from tpengine.structured.bitmask import apply_bitmask


class VocabParallelEmbedding(nn.Module):
    """Masked lookup in this rank's vocabulary rows, summed over ranks.

    ``weight [vocab_end - vocab_start, hidden]`` (or ``quant``, the same rows quantized); ids
    ``[...]`` int64 -> ``[..., hidden]``. Ids outside this rank's range contribute zero; padded
    ids embed to zero everywhere. ``lookup`` (bound by the platform where a tied LM head holds the
    table in its platform's own layout, ``weight`` then None: one copy, the head's): local ids ``[...]``
    -> their rows ``[..., hidden]``, the same values as the plain table's.
    """

    def __init__(self, vocab_start: int, vocab_end: int, vocab_size: int, hidden: int,
                 dtype=None, device="meta"):
        super().__init__()
        self.vocab_start, self.vocab_end, self.vocab_size = vocab_start, vocab_end, vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_end - vocab_start, hidden, dtype=dtype, device=device),
                                   requires_grad=False)
        self.quant: nn.Module | None = None
        self.lookup = None

    def _lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.rows(local_ids)
        return F.embedding(local_ids, self.weight) if self.lookup is None else self.lookup(local_ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp().size == 1:
            return self._lookup(ids)
        mask = (ids >= self.vocab_start) & (ids < self.vocab_end)
        out = self._lookup((ids - self.vocab_start) * mask)
        out = out * mask.unsqueeze(-1).to(out.dtype)
        return all_reduce(out)


class ParallelLMHead(_Packable):
    """This rank's vocabulary logits, gathered to rank 0 and cut to the real vocabulary.

    ``weight [vocab_local, hidden]`` (the embedding shard's own Parameter when embeddings are
    tied), or ``quant`` (quantized, the embedding's own ``quant`` when tied). Input
    ``[..., hidden]`` -> on rank 0 ``[..., vocab_size]`` (padding columns dropped, so padded ids
    can never be sampled); None on other ranks. The greedy pick's maxima, bound by the platform
    (:meth:`tpengine.backends.platform.Platform.bind_model`; unbound: torch's ``max``):
    ``row_max`` (``[B, V]`` logits -> each row's ``(value, first index)``), ``row_argmax`` (optional: its
    indices alone, which one rank's greedy pick takes), ``col_max`` (``row_max``
    over the rows of ``[V, B]``) and ``greedy_mm`` (a batch takes the transposed logits, :meth:`greedy`).
    ``ops``: the model's element-wise ops (default :class:`~tpengine.backends.torch_ops.TorchOps`).
    ``divisor`` (Granite's ``logits_scaling``): the logits are divided by it; ``soft_cap`` (Gemma 2's
    ``final_logit_softcapping``): then become ``tanh(logits / c) * c``. Both are element-wise, so each rank
    applies them to its own shard, before the gather or the greedy maximum (HF's arithmetic, in the
    logits' dtype).
    """

    def __init__(self, vocab_start: int, vocab_end: int, vocab_size: int, hidden: int, dtype=None, device="meta",
                 ops: TorchOps | None = None, divisor: float | None = None, soft_cap: float | None = None):
        super().__init__()
        self.ops = ops or TorchOps()
        self.divisor, self.soft_cap = divisor, soft_cap
        self.transforms = divisor is not None or soft_cap is not None
        self.vocab_start, self.vocab_end, self.vocab_size = vocab_start, vocab_end, vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_end - vocab_start, hidden, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = None  # a vocabulary-parallel head has none
        self.row_max = torch_ops.row_max
        self.row_argmax = None  # or the indices of row_max alone (x -> [B] int64), where the platform binds one
        self.col_max = torch_ops.col_max
        self.greedy_mm = False

    @property
    def shard_width(self) -> int:
        """This rank's real vocabulary columns (its shard without the padding)."""
        return min(self.vocab_end, self.vocab_size) - self.vocab_start

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's ``[B, vocab_local]`` logits. A tied head keeps one copy of its rows: the
        embedding's plain ones, or its platform's layout of them that the embedding then reads
        (``VocabParallelEmbedding.lookup``)."""
        logits = self._rows(hidden)
        return self._transform(logits) if self.transforms else logits

    def _transform(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's element-wise logit transforms (``divisor``, then ``soft_cap``), as HF's
        causal-LM heads apply them, in place on this step's fresh logits (each op rounds to their dtype
        as HF's out-of-place ones do)."""
        if self.divisor is not None:
            logits = logits.div_(self.divisor)
        if self.soft_cap is not None:
            logits = self.ops.soft_cap_(logits, self.soft_cap)
        return logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = gather_to_driver(self._logits(hidden), dim=-1)
        return None if logits is None else logits[..., : self.vocab_size]

    def greedy(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """Greedy sampling without gathering the logits: every rank takes the maximum of its
        vocabulary shard (padding excluded), rank 0 keeps the best shard's. ``hidden [B, hidden]``
        -> on rank 0 int64 token ids ``[B]``, the first index among equal maxima exactly like
        ``torch.argmax`` over the whole vocabulary; None on other ranks. With ``greedy_mm`` (bound by
        the platform where it measured it faster: on the CPU a plain half-precision head,
        :func:`tpengine.backends.cpu.greedy.choose_greedy_path`) a batch of rows computes the transposed
        logits ``weight @ hidden.T`` -- the weight, row-major, is then the GEMM's left operand and is not
        rearranged per call -- and takes each column's maximum (``col_max``); the logits' rounding may differ from
        ``F.linear``'s in the last bit. ``mask``: a structured output's token bitmask (int32
        ``[B, ceil(vocab_size / 32)]``, the same on every rank): each rank sets its shard's banned
        tokens to -inf before its maximum."""
        width = self.vocab_size - self.vocab_start
        if mask is not None:
            logits = apply_bitmask(self._logits(hidden)[..., :width].float(), mask, self.vocab_start)
            value, index = self.row_max(logits)
        elif self.greedy_mm and hidden.dim() == 2 and hidden.shape[0] > 1:  # bound where measured faster
            logits_t = torch.mm(self.weight, hidden.t())[:width]
            value, index = self.col_max(self._transform(logits_t) if self.transforms else logits_t)
        elif self.row_argmax is not None and get_tp().size == 1:  # one rank: the indices alone
            return self.row_argmax(self._logits(hidden)[..., :width])
        else:
            value, index = self.row_max(self._logits(hidden)[..., :width])
        if get_tp().size == 1:
            return index
        mine = torch.stack([value.double(), (index + self.vocab_start).double()], dim=-1)  # exact
        every = gather_to_driver(mine, dim=-1)  # [B, 2 * tp]: (value, id) per rank in rank order
        if every is None:
            return None
        best = every[:, 0::2].argmax(dim=-1, keepdim=True)  # first maximum: the lowest rank on ties
        return every[:, 1::2].gather(1, best).squeeze(1).long()
