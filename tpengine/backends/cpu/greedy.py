"""The LM head's greedy pick on the CPU: each row's (or, for transposed logits, each column's)
maximum and the first index holding it, by blocked torch passes or the C argmax
(``csrc/cpu_argmax.c``), and the two measured choices behind it (:func:`choose_row_max_block`, the
torch block or the C kernel; :func:`choose_greedy_path`, a half-precision head's logits as
``F.linear`` or transposed), both through :mod:`tpengine.backends.cpu.measured`. The CPU platform
binds the chosen callables on the head (:class:`tpengine.model.layers.embedding.ParallelLMHead`'s
``row_max`` / ``col_max`` / ``greedy_mm``); the head itself chooses nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tpengine.backends.cpu import cpu_library
from tpengine.backends.cpu.cpu_ops import ops
from tpengine.backends.cpu.measured import Choice, fastest, pick

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


def bound_row_argmax(dtype: torch.dtype, block: int = ROW_MAX_BLOCK) -> Callable[[torch.Tensor], torch.Tensor]:
    """The C row argmax for ``[B, V]`` logits of ``dtype`` with its checks and look-ups done once: the
    head's ``row_argmax`` (``x -> indices [B]`` int64, :func:`row_max`'s indices, no values), bound where
    the C kernel was chosen. A batch-1 greedy step calls it right after the decode program and the head
    have streamed the step's weights through the caches, where each Python and dispatcher layer costs
    several times its warm figure (docs/notes/kernels.md, "The batch-1 step outside the products"), so it
    calls the C function through ctypes directly. An ``x`` the kernel does not take (another dtype, not
    2-D, strided rows, not on the CPU, empty) goes to :func:`row_max` (``block``)."""
    fn = getattr(cpu_library.load(), "tpe_row_argmax_bf16" if dtype == torch.bfloat16 else "tpe_row_argmax_f32")

    def row_argmax(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != dtype or x.dim() != 2 or x.stride(1) != 1 or not x.is_cpu or not x.numel():
            return row_max(x, block, True)[1]
        index = torch.empty(x.shape[0], dtype=torch.int64)
        fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), index.data_ptr(), torch.get_num_threads())
        return index
    return row_argmax


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


def choose_greedy_path(head, block: int = ROW_MAX_BLOCK, rows_c: bool = False, cpu_kernels: bool = False,
                       rows: tuple[int, ...] = (8, 64)) -> Choice:
    """Whether a plain half-precision CPU ``head`` (a
    :class:`~tpengine.model.layers.embedding.ParallelLMHead`) picks greedy tokens faster through the
    transposed logits (``"mm"``: ``weight @ hidden.T`` and :func:`col_max`) than through its linear
    path (``head.impl``, bound by the platform, else ``F.linear``) and :func:`row_max` (``"linear"``),
    timed on its own weight at ``rows`` rows with the torch ``block`` and, for the row max, the C
    argmax where ``rows_c``, for the col max where ``cpu_kernels``
    (:func:`tpengine.backends.cpu.measured.fastest`: once per machine, cached).
    ``Choice.name`` is "mm" or "linear"."""
    g = torch.Generator().manual_seed(0)
    w, width = head.weight, head.shard_width
    xs = [torch.randn(r, w.shape[1], generator=g).to(w.dtype) for r in rows]
    linear = head.impl or (lambda x: torch.nn.functional.linear(x, w))
    candidates = {"linear": [lambda x=x: row_max(linear(x)[:, :width], block, rows_c) for x in xs],
                  "mm": [lambda x=x: col_max(torch.mm(w, x.t())[:width], block, cpu_kernels) for x in xs]}
    return fastest(f"greedy head {w.shape[0]}x{w.shape[1]} {str(w.dtype).removeprefix('torch.')} block {block} "
                   f"linear {'/'.join(head.kernels) or 'plain'} "
                   f"rows {'/'.join(map(str, rows))}", candidates, default="linear")


def bind_head(head, dtype: torch.dtype, cpu_kernels: bool) -> tuple[Choice | None, Choice | None]:
    """Measure and bind a CPU LM head's greedy pick (``head``: a
    :class:`~tpengine.model.layers.embedding.ParallelLMHead` whose linear is already bound): its
    ``row_max`` (:func:`row_max` with the block or the C argmax :func:`choose_row_max_block` chose),
    ``row_argmax`` (where the C argmax was chosen, :func:`bound_row_argmax`; else None),
    ``col_max`` (:func:`col_max` with that block, the C kernel with ``cpu_kernels``) and, for a plain
    half-precision head with ``cpu_kernels``, ``greedy_mm`` (:func:`choose_greedy_path`; a float32
    head keeps ``F.linear``: HF's arithmetic). Returns ``(row max choice, greedy path choice or None)``."""
    choice, block = choose_row_max_block(head.shard_width, dtype, cpu_kernels)
    rows_c = choice.name == ROW_MAX_KERNEL
    head.row_max = lambda x: row_max(x, block, rows_c)
    head.row_argmax = bound_row_argmax(dtype, block) if rows_c and dtype in (torch.float32, torch.bfloat16) else None
    head.col_max = lambda x: col_max(x, block, cpu_kernels)
    greedy = None
    if (cpu_kernels and head.quant is None and head.packed is None and head.weight is not None
            and dtype in (torch.bfloat16, torch.float16)):
        greedy = choose_greedy_path(head, block, rows_c, cpu_kernels)
        head.greedy_mm = greedy.name == "mm"
    return choice, greedy


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
    block = str(ROW_MAX_BLOCK) if str(ROW_MAX_BLOCK) in candidates else "0"  # a busy machine's torch block
    choice = fastest(f"row_max {width} {str(dtype).removeprefix('torch.')} rows {'/'.join(map(str, ROW_MAX_ROWS))}",
                     candidates, default=ROW_MAX_KERNEL if ROW_MAX_KERNEL in candidates else block)
    if not choice.times_us:
        return choice, int(block)
    return choice, int(pick({k: v for k, v in choice.times_us.items() if k != ROW_MAX_KERNEL}))
