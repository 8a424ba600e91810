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

from tpengine.backends.cpu import cpu_library
from tpengine.backends.cpu.cpu_fused import FusedOps
from tpengine.backends.cpu.cpu_ops import ops
from tpengine.backends.cpu.linear_layout import kernel_at
from tpengine.backends.cpu.measured import Choice, fastest, pick
from tpengine.comm import all_reduce, gather_to_driver
from tpengine.distributed import get_tp
from tpengine.model.layers.linear import _Packable
from tpengine.structured.bitmask import apply_bitmask


class VocabParallelEmbedding(nn.Module):
    """Masked lookup in this rank's vocabulary rows, summed over ranks.

    ``weight [vocab_end - vocab_start, hidden]`` (or ``quant``, the same rows quantized); ids
    ``[...]`` int64 -> ``[..., hidden]``. Ids outside this rank's range contribute zero; padded
    ids embed to zero everywhere.
    """

    def __init__(self, vocab_start: int, vocab_end: int, vocab_size: int, hidden: int,
                 dtype=None, device="meta"):
        super().__init__()
        self.vocab_start, self.vocab_end, self.vocab_size = vocab_start, vocab_end, vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_end - vocab_start, hidden, dtype=dtype, device=device),
                                   requires_grad=False)
        self.quant: nn.Module | None = None

    def _lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(local_ids, self.weight) if self.quant is None else self.quant.rows(local_ids)

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
    can never be sampled); None on other ranks. ``row_max_block`` and ``row_max_kernel``: the greedy
    pick's torch block and whether it takes the C row argmax instead (:func:`row_max`; both set by the
    loader from :func:`choose_row_max_block` on CPU; ``row_max_kernel`` None, before that: where the
    ops use the C kernels); ``ops``: the model's :class:`~tpengine.backends.cpu.cpu_fused.FusedOps`
    (default: the C kernels where they take the tensors).
    """

    def __init__(self, vocab_start: int, vocab_end: int, vocab_size: int, hidden: int, dtype=None, device="meta",
                 ops: FusedOps | None = None):
        super().__init__()
        self.ops = ops or FusedOps(True)
        self.vocab_start, self.vocab_end, self.vocab_size = vocab_start, vocab_end, vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_end - vocab_start, hidden, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = None  # a vocabulary-parallel head has none
        self.row_max_block = ROW_MAX_BLOCK
        self.row_max_kernel: bool | None = None
        self.greedy_mm = False

    @property
    def row_max_c(self) -> bool:
        """Whether the greedy pick over rows takes the C argmax (:attr:`row_max_kernel`, else the ops')."""
        return self.ops.cpu_kernels if self.row_max_kernel is None else self.row_max_kernel

    @property
    def shard_width(self) -> int:
        """This rank's real vocabulary columns (its shard without the padding)."""
        return min(self.vocab_end, self.vocab_size) - self.vocab_start

    def bind(self):
        """The head's implementation (:meth:`~tpengine.model.layers.linear._Packable.bind`: a quantized
        head's kernel, a packed weight, or a tied head's paths per row bucket, measured by the loader's
        ``choose_head``). A plain half-precision CPU head whose one-row path is ``F.linear`` reads
        one row with ``torch.mv`` instead, which streams a plain row-major weight faster."""
        impl = super().bind()
        w = self.weight
        if (self.quant is None and self.packed is None and w is not None and w.device.type == "cpu"
                and w.dtype in (torch.bfloat16, torch.float16) and kernel_at(self.kernels, 1) == "plain"):
            self.impl = lambda x: torch.mv(w, x[0]).unsqueeze(0) if x.shape[0] == 1 else impl(x)  # noqa: E731
        return self.impl

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's ``[B, vocab_local]`` logits. A tied head keeps the embedding's plain rows
        (never a packed copy beside them)."""
        return self._rows(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = gather_to_driver(self._logits(hidden), dim=-1)
        return None if logits is None else logits[..., : self.vocab_size]

    def greedy(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """Greedy sampling without gathering the logits: every rank takes the maximum of its
        vocabulary shard (padding excluded), rank 0 keeps the best shard's. ``hidden [B, hidden]``
        -> on rank 0 int64 token ids ``[B]``, the first index among equal maxima exactly like
        ``torch.argmax`` over the whole vocabulary; None on other ranks. With ``greedy_mm`` (set by
        the loader where :func:`choose_greedy_path` measured it faster: a plain half-precision
        CPU head) a batch of rows computes the transposed logits ``weight @ hidden.T`` -- the
        weight, row-major, is then the GEMM's left operand and is not rearranged per call -- and
        takes each column's maximum (:func:`col_max`); the logits' rounding may differ from
        ``F.linear``'s in the last bit. ``mask``: a structured output's token bitmask (int32
        ``[B, ceil(vocab_size / 32)]``, the same on every rank): each rank sets its shard's banned
        tokens to -inf before its maximum."""
        width = self.vocab_size - self.vocab_start
        if mask is not None:
            logits = apply_bitmask(self._logits(hidden)[..., :width].float(), mask, self.vocab_start)
            value, index = row_max(logits, self.row_max_block, self.row_max_c)
        elif self.greedy_mm and hidden.dim() == 2 and hidden.shape[0] > 1:  # measured faster here (greedy_path)
            value, index = col_max(torch.mm(self.weight, hidden.t())[:width], self.row_max_block, self.ops.cpu_kernels)
        else:
            value, index = row_max(self._logits(hidden)[..., :width], self.row_max_block, self.row_max_c)
        if get_tp().size == 1:
            return index
        mine = torch.stack([value.double(), (index + self.vocab_start).double()], dim=-1)  # exact
        every = gather_to_driver(mine, dim=-1)  # [B, 2 * tp]: (value, id) per rank in rank order
        if every is None:
            return None
        best = every[:, 0::2].argmax(dim=-1, keepdim=True)  # first maximum: the lowest rank on ties
        return every[:, 1::2].gather(1, best).squeeze(1).long()


#: The block :func:`row_max` uses where none was measured (off the CPU, or before
#: :func:`choose_row_max_block`).
ROW_MAX_BLOCK = 512
#: The blocks :func:`choose_row_max_block` times (0: torch's ``max``).
ROW_MAX_CANDIDATES = (0, 256, 512, 1024, 2048, 4096)
#: Rows the choice is timed at: one decoding sequence, a full decode batch.
ROW_MAX_ROWS = (1, 64)
#: :func:`choose_row_max_block`'s name for the C row argmax (tpengine/backends/cpu/csrc/cpu_argmax.c).
ROW_MAX_KERNEL = "C"


def _argmax_kernel_takes(x: torch.Tensor, cpu_kernels: bool) -> bool:
    """Whether the C argmax kernel (tpengine/backends/cpu/csrc/cpu_argmax.c) takes ``x``: 2-D float32 or
    bfloat16 on CPU with contiguous rows, the kernels on and built (every build has them)."""
    name = "bf16" if x.dtype == torch.bfloat16 else "f32"
    return (cpu_kernels and x.dim() == 2 and x.numel() > 0 and x.dtype in (torch.float32, torch.bfloat16)
            and x.device.type == "cpu" and x.stride(1) == 1
            and cpu_library.usable(x, float32=True, kernels=(f"tpe_row_argmax_{name}", f"tpe_col_argmax_{name}")))


def row_max(x: torch.Tensor, block: int = ROW_MAX_BLOCK,
            cpu_kernels: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.max(dim=-1)`` of a ``[B, V]`` tensor -- the maximum and the *first* index holding it,
    NaN counting as the largest -- in two passes that vectorise: the maximum of every
    ``block``-column block (``amax``), the first block holding the row's maximum, then the first
    maximum inside that block (on CPU ``max(dim=-1)`` tracks an index per element and is several
    times slower; figures in docs/notes/kernels.md). Uses ``max`` itself for ``block`` 0, off the
    CPU, for a non-contiguous x, or for V not a multiple of ``block`` (or equal to it); the block
    is measured per machine (:func:`choose_row_max_block`). With ``cpu_kernels`` (and a float32 or
    bfloat16 ``x`` with contiguous rows) one pass of the C kernel ``tpengine.row_argmax`` instead,
    ``block`` unused. Returns ``(values [B] in x.dtype, indices [B] int64)``, the same either way."""
    b, v = x.shape
    if _argmax_kernel_takes(x, cpu_kernels):
        index = torch.empty(b, dtype=torch.int64)
        ops.row_argmax(x, index)
        return x[torch.arange(b), index], index
    if not block or v % block or v == block or not x.is_contiguous() or x.device.type != "cpu":
        return x.max(dim=-1)
    blocks = x.view(b, v // block, block)
    block_max = blocks.amax(dim=-1)  # [B, V / block]
    rows = torch.arange(b, device=x.device)
    first = block_max.float().argmax(dim=-1)  # first block holding the maximum (float: exact, faster)
    inside = blocks[rows, first].float().argmax(dim=-1)  # first maximum inside it
    return block_max[rows, first], first * block + inside


def col_max(x: torch.Tensor, block: int = ROW_MAX_BLOCK,
            cpu_kernels: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_max` of ``x.T`` for a ``[V, B]`` tensor: per column the maximum and the *first*
    row index holding it (NaN the largest), by the same two passes over ``block``-row blocks
    (``amax`` over each block's rows, the first block holding the column's maximum, the first
    maximum inside it); ``x.max(dim=0)`` for ``block`` 0, off the CPU, a non-contiguous x, or V
    not a multiple of ``block`` (or equal to it); with ``cpu_kernels``, the C kernel ``tpengine.col_argmax``
    (one pass over the rows, as :func:`row_max`). Returns ``(values [B] in x.dtype, indices [B]
    int64)``, the same either way."""
    v, b = x.shape
    if _argmax_kernel_takes(x, cpu_kernels):
        index = torch.empty(b, dtype=torch.int64)
        ops.col_argmax(x, index)
        return x[index, torch.arange(b)], index
    if not block or v % block or v == block or not x.is_contiguous() or x.device.type != "cpu":
        return x.max(dim=0)
    blocks = x.view(v // block, block, b)
    block_max = blocks.amax(dim=1)  # [V / block, B]
    cols = torch.arange(b, device=x.device)
    first = block_max.float().argmax(dim=0)  # first block holding each column's maximum
    inside = blocks[first, :, cols].float().argmax(dim=1)  # [B, block] -> first maximum inside it
    return block_max[first, cols], first * block + inside


def choose_greedy_path(head: "ParallelLMHead", rows: tuple[int, ...] = (8, 64)) -> Choice:
    """Whether a plain half-precision CPU ``head`` picks greedy tokens faster through the
    transposed logits (``"mm"``: ``weight @ hidden.T`` and :func:`col_max`) than through its bound
    linear path (:meth:`ParallelLMHead.bind`: the paths ``choose_head`` measured) and :func:`row_max`
    (``"linear"``), timed on its own weight at ``rows`` rows with
    its ``row_max_block`` (:func:`tpengine.backends.cpu.measured.fastest`: once per machine, cached).
    ``Choice.name`` is "mm" or "linear"."""
    g = torch.Generator().manual_seed(0)
    w, width, block = head.weight, head.shard_width, head.row_max_block
    xs = [torch.randn(r, w.shape[1], generator=g).to(w.dtype) for r in rows]
    cpu_kernels, rows_c = head.ops.cpu_kernels, head.row_max_c
    linear = head.bind()
    candidates = {"linear": [lambda x=x: row_max(linear(x)[:, :width], block, rows_c) for x in xs],
                  "mm": [lambda x=x: col_max(torch.mm(w, x.t())[:width], block, cpu_kernels) for x in xs]}
    return fastest(f"greedy head {w.shape[0]}x{w.shape[1]} {str(w.dtype).removeprefix('torch.')} block {block} "
                   f"linear {'/'.join(head.kernels) or 'plain'} "
                   f"rows {'/'.join(map(str, rows))}", candidates)


def choose_row_max_block(width: int, dtype: torch.dtype, cpu_kernels: bool = False) -> tuple[Choice, int]:
    """The fastest :func:`row_max` on this machine for ``[rows, width]`` logits in ``dtype`` at each
    of :data:`ROW_MAX_ROWS` rows, among torch's blocked passes with the :data:`ROW_MAX_CANDIDATES`
    that divide ``width`` and, with ``cpu_kernels`` where the build has it, the C row argmax
    (:data:`ROW_MAX_KERNEL`) (:func:`tpengine.backends.cpu.measured.fastest`: timed once per machine
    and cached). Every candidate gives the same values and indices. Returns the choice (``name``: a
    block as a string, or :data:`ROW_MAX_KERNEL`) and the fastest torch block (the col max's, and the
    row max's where the C kernel does not take a tensor)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(r, width, generator=g).to(dtype) for r in ROW_MAX_ROWS]
    blocks = [c for c in ROW_MAX_CANDIDATES if c == 0 or (width % c == 0 and width != c)]
    candidates = {str(c): [lambda x=x, c=c: row_max(x, c) for x in xs] for c in blocks}
    if cpu_kernels and _argmax_kernel_takes(xs[0], True):
        candidates[ROW_MAX_KERNEL] = [lambda x=x: row_max(x, 0, True) for x in xs]
    choice = fastest(f"row_max {width} {str(dtype).removeprefix('torch.')} rows {'/'.join(map(str, ROW_MAX_ROWS))}",
                     candidates)
    return choice, int(pick({k: v for k, v in choice.times_us.items() if k != ROW_MAX_KERNEL}))
