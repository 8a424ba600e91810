"""The control plane: a StepPlan, packed into int64 tensors and broadcast from rank 0.

Rank 0 turns a scheduled batch into a :class:`StepPlan`; :func:`broadcast_plan` sends a fixed
header tensor, then one payload tensor, over the gloo control group. Every rank runs the same
step from it, so the prefill/decode decision and every token id come from rank 0 only (case
C13). Workers never see the tokenizer or the sampled tokens.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

import torch

from tpengine import forensics
from tpengine.distributed import broadcast_control, get_tp

MAGIC = 0x7E57E9
HEADER_LEN = 11  # magic, kind, N tokens, B seqs, M max blocks, step index, greedy (2: masked), P, C, S, draft
#: A payload of at most this many int64 travels after the header in one message of ``HEADER_LEN +
#: INLINE_PAYLOAD`` (one broadcast a step: a decode step of a few sequences; each gloo broadcast is a
#: round trip the other ranks wait for); a longer one follows in a second broadcast
INLINE_PAYLOAD = 128

#: The payload: StepPlan tensor fields in order, each with its length for (N, B, M, P, C, S) =
#: (tokens, sequences, block-table width, prompt-logits rows, block copies, speculative rows). The
#: one definition used by pack, unpack and broadcast_plan.
PAYLOAD_FIELDS = (
    ("input_ids", lambda n, b, m, p, c, s: n),
    ("positions", lambda n, b, m, p, c, s: n),
    ("slot_mapping", lambda n, b, m, p, c, s: n),
    ("block_tables", lambda n, b, m, p, c, s: b * m),
    ("cu_seqlens_q", lambda n, b, m, p, c, s: b + 1),
    ("cu_seqlens_k", lambda n, b, m, p, c, s: b + 1),
    ("context_lens", lambda n, b, m, p, c, s: b),
    ("sample_idx", lambda n, b, m, p, c, s: b),
    ("prompt_idx", lambda n, b, m, p, c, s: p),
    ("block_copies", lambda n, b, m, p, c, s: 2 * c),
    ("spec_idx", lambda n, b, m, p, c, s: s),
)


def payload_sizes(n: int, b: int, m: int, p: int = 0, c: int = 0, s: int = 0) -> list[int]:
    """Lengths of the :data:`PAYLOAD_FIELDS` for ``n`` tokens, ``b`` sequences, a block table ``m``
    blocks wide, ``p`` prompt-logits rows, ``c`` block copies and ``s`` speculative rows (their sum
    is the payload length: ``3n + b*m + 2(b+1) + 2b + p + 2c + s``)."""
    return [size(n, b, m, p, c, s) for _, size in PAYLOAD_FIELDS]


class StepKind(enum.IntEnum):
    PREFILL = 1
    DECODE = 2
    STOP = 3
    IDLE = 4  # nothing to run: a heartbeat while a server waits for requests (no payload)


#: Kinds whose plan carries no payload and runs no model.
CONTROL_KINDS = (StepKind.STOP, StepKind.IDLE)


@dataclass
class StepPlan:
    """One engine step; every tensor is int64 on CPU.

    * ``input_ids``, ``positions``, ``slot_mapping``: ``[N]`` tokens run this step.
    * ``block_tables``: ``[B, M]`` physical block ids, -1 padded.
    * ``cu_seqlens_q`` / ``cu_seqlens_k``: ``[B+1]`` new / total tokens per sequence (prefill).
    * ``context_lens``: ``[B]`` tokens in the cache per sequence after this step.
    * ``sample_idx``: ``[B]`` index into the N tokens whose logits are sampled.
    * ``prompt_idx``: ``[P]`` more indices into the N tokens whose logits rank 0 needs (prompt
      logprobs); their rows follow the ``B`` sampled rows in :meth:`ModelRunner.execute`'s result.
    * ``block_copies``: ``[C, 2]`` (source, destination) physical blocks whose K/V every rank copies
      before the step runs (copy-on-write of a shared partial block when ``n > 1`` samples fork).
    * ``spec_idx``: ``[S]`` more indices into the N tokens whose logits verify speculative tokens
      (:mod:`tpengine.engine.spec_decode`): for a sequence that runs its last token and k proposed
      ones, the first k of those k + 1 positions (its last one is its ``sample_idx``). Their rows
      follow the ``B`` sampled and ``P`` prompt rows in :meth:`ModelRunner.execute`'s result.
    * ``draft``: the step runs the draft model of speculative decoding (its own runner and KV cache,
      the same block tables), not the model.
    * ``greedy``: every sequence samples greedily, so the ranks return the argmax token ids
      instead of gathering the logits.
    * ``grammar_mask``: (with ``greedy``) some rows are constrained by a structured output: before the
      LM head, rank 0 broadcasts the step's token bitmask and every rank masks its vocabulary shard
      before its argmax.
    * ``payload``: the one int64 tensor whose views the tensor fields are, in :data:`PAYLOAD_FIELDS`'
      order (:func:`build_plan`, :class:`PlanBuilder`, :func:`unpack`), which :func:`pack` sends as it
      is; None (a plan made field by field): :func:`pack` concatenates the fields.
    """

    kind: StepKind
    step: int = 0
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    sample_idx: torch.Tensor | None = None
    prompt_idx: torch.Tensor | None = None
    block_copies: torch.Tensor | None = None
    spec_idx: torch.Tensor | None = None
    greedy: bool = False
    grammar_mask: bool = False
    draft: bool = False
    payload: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in CONTROL_KINDS:
            if self.prompt_idx is None:
                self.prompt_idx = torch.empty(0, dtype=torch.int64)
            if self.block_copies is None:
                self.block_copies = torch.empty(0, 2, dtype=torch.int64)
            if self.spec_idx is None:
                self.spec_idx = torch.empty(0, dtype=torch.int64)

    @property
    def is_prefill(self) -> bool:
        return self.kind == StepKind.PREFILL

    @property
    def num_seqs(self) -> int:
        return 0 if self.sample_idx is None else int(self.sample_idx.numel())


def split_plan(plan: StepPlan, parts: int) -> list[tuple[StepPlan, torch.Tensor]]:
    """``plan``'s sequences as up to ``parts`` micro-batches of consecutive sequences, as even as possible
    (a pipeline's stages work on them one after another, so stage s runs micro-batch m while stage
    s + 1 runs m - 1): each sub-plan (its own token rows, block tables, lengths and row indices; no
    block copies: they run before the step) and ``[R_m]`` int64, where its result rows go in the whole
    plan's result (:meth:`tpengine.engine.model_runner.ModelRunner.execute`'s row order: the sampled
    rows, then the prompt-logprob rows, then the speculative rows). ``[(plan, all rows)]`` for one part
    or one sequence."""
    b = plan.num_seqs
    cu_q = plan.cu_seqlens_q if plan.cu_seqlens_q is not None else torch.arange(b + 1)
    n_p = plan.prompt_idx.numel()
    out = []
    for b0, b1 in _even(b, min(parts, b)):
        t0, t1 = int(cu_q[b0]), int(cu_q[b1])

        def inside(idx: torch.Tensor) -> torch.Tensor:
            return ((idx >= t0) & (idx < t1)).nonzero().flatten()

        p_sel, s_sel = inside(plan.prompt_idx), inside(plan.spec_idx)
        sub = StepPlan(kind=plan.kind, step=plan.step, input_ids=plan.input_ids[t0:t1],
                       positions=plan.positions[t0:t1], slot_mapping=plan.slot_mapping[t0:t1],
                       block_tables=plan.block_tables[b0:b1],
                       cu_seqlens_q=None if plan.cu_seqlens_q is None else plan.cu_seqlens_q[b0:b1 + 1] - t0,
                       cu_seqlens_k=None if plan.cu_seqlens_k is None
                       else plan.cu_seqlens_k[b0:b1 + 1] - plan.cu_seqlens_k[b0],
                       context_lens=plan.context_lens[b0:b1], sample_idx=plan.sample_idx[b0:b1] - t0,
                       prompt_idx=plan.prompt_idx[p_sel] - t0, spec_idx=plan.spec_idx[s_sel] - t0,
                       greedy=plan.greedy, grammar_mask=plan.grammar_mask, draft=plan.draft)
        out.append((sub, torch.cat([torch.arange(b0, b1), b + p_sel, b + n_p + s_sel])))
    return out


def _even(n: int, parts: int) -> list[tuple[int, int]]:
    """``range(n)`` as ``parts`` consecutive ``[start, end)`` ranges, sizes differing by at most one."""
    base, extra = divmod(n, max(parts, 1))
    bounds = [0]
    for i in range(max(parts, 1)):
        bounds.append(bounds[-1] + base + (i < extra))
    return list(zip(bounds, bounds[1:]))


def build_plan(seqs, is_prefill: bool, block_size: int, step: int, greedy: bool = False,
               block_copies: list[tuple[int, int]] = ()) -> StepPlan:
    """Rank 0: the StepPlan for ``seqs`` (tpengine.engine.sequence.Sequence, blocks already
    allocated by the scheduler). Each sequence runs its tokens ``[num_cached_tokens,
    num_cached_tokens + num_new_tokens)``: in a decode its last token, in a prefill the rest of its
    prompt or one chunk of it after the cached prefix (a decode in a mixed step is a one-token
    prefill over its cache); the logits of each sequence's last token in the step are sampled. A
    sequence asking for prompt logprobs also gets the logits of its other prompt positions in the
    step (``prompt_idx``: each position predicts the next prompt token). A decoding sequence with
    speculative tokens (``s.proposal``, the scheduler counted them in ``num_new_tokens``) runs its last
    token and them, and the first k of those positions' logits are wanted too (``spec_idx``).
    ``block_copies``: (source, destination) blocks to copy before the step. Its tensors are its own
    (:class:`PlanBuilder` makes the same plan into tensors it reuses)."""
    fields, width = _plan_fields(seqs, block_size, block_copies)
    payload = torch.tensor([x for f in fields for x in f], dtype=torch.int64)
    return StepPlan(kind=StepKind.PREFILL if is_prefill else StepKind.DECODE, step=step, greedy=greedy,
                    payload=payload, **_views(payload, fields, len(seqs), width))


class PlanBuilder:
    """Rank 0's :func:`build_plan`, into tensors it reuses: while a step's plan has the last one's field
    sizes (a decode step of the same batch, until a block table grows a column), its values are written
    into the last plan's payload and the plan takes that payload's views again, so a step makes no tensor
    (a batch-1 decode step's Python runs cold after the decode program, where each torch call costs
    several times its warm figure: docs/notes/kernels.md). So a plan's tensors hold its values until
    the builder's next :meth:`build` only: the engine builds a step's plan after the last step's update,
    and nothing keeps a plan's tensors past its step (a backend that compares steps keeps copies:
    :class:`tpengine.backends.cpu.kv_mirror.Continuity`).

    Args:
        block_size: tokens per KV block.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._key: tuple[int, ...] | None = None  # the last plan's width and field sizes
        self._payload: torch.Tensor | None = None
        self._values = None  # the payload's memory as a ctypes int64 array (written without a torch call)
        self._views: dict[str, torch.Tensor] = {}

    def build(self, seqs, is_prefill: bool, step: int, greedy: bool = False,
              block_copies: list[tuple[int, int]] = ()) -> StepPlan:
        """:func:`build_plan`'s plan for ``seqs`` (the same values), in the builder's tensors."""
        fields, width = _plan_fields(seqs, self.block_size, block_copies)
        flat = [x for f in fields for x in f]
        key = (width, *(len(f) for f in fields))
        if key != self._key:  # another shape: a new payload and its views, kept for the next steps
            self._payload = torch.empty(len(flat), dtype=torch.int64)
            self._values = (ctypes.c_int64 * len(flat)).from_address(self._payload.data_ptr())
            self._views = _views(self._payload, fields, len(seqs), width)
            self._key = key
        self._values[:] = flat
        return StepPlan(kind=StepKind.PREFILL if is_prefill else StepKind.DECODE, step=step, greedy=greedy,
                        payload=self._payload, **self._views)


def _plan_fields(seqs, block_size: int, block_copies) -> tuple[tuple[list[int], ...], int]:
    """:func:`build_plan`'s fields as Python lists in :data:`PAYLOAD_FIELDS`' order, and the block tables'
    width."""
    ids, pos, slots, cu_q, cu_k, ctx, prompt_idx, spec_idx = [], [], [], [0], [0], [], [], []
    for s in seqs:
        start = s.num_cached_tokens
        end = start + s.num_new_tokens
        if s.prompt_logprobs is not None:  # position p's logits predict prompt token p + 1
            base, first = len(ids), max(start, len(s.prompt_logprobs))  # not those collected already
            prompt_idx.extend(base + p - start for p in range(first, min(end, s.num_prompt_tokens - 1)))
        if s.proposal:
            spec_idx.extend(range(len(ids), len(ids) + len(s.proposal)))
            ids.extend(s.token_ids[start:] + s.proposal)
        else:
            ids.extend(s.token_ids[start:end])
        pos.extend(range(start, end))
        bt = s.block_table
        slots.extend(bt[p // block_size] * block_size + p % block_size for p in range(start, end))
        cu_q.append(cu_q[-1] + end - start)
        cu_k.append(cu_k[-1] + end)
        ctx.append(end)
    width = max(len(s.block_table) for s in seqs)
    tables = [b for s in seqs for b in s.block_table + [-1] * (width - len(s.block_table))]
    copies = [int(b) for pair in block_copies for b in pair]
    return (ids, pos, slots, tables, cu_q, cu_k, ctx, [c - 1 for c in cu_q[1:]], prompt_idx, copies, spec_idx), width


def _views(payload: torch.Tensor, fields: tuple[list[int], ...], b: int, width: int) -> dict[str, torch.Tensor]:
    """The plan's tensor fields as views of ``payload``, in :data:`PAYLOAD_FIELDS`' order (as :func:`unpack`
    gives them): one tensor made a step, not eleven."""
    parts = payload.split([len(f) for f in fields])
    named = dict(zip((name for name, _ in PAYLOAD_FIELDS), parts))
    named["block_tables"] = named["block_tables"].view(b, width)
    named["block_copies"] = named["block_copies"].view(-1, 2)
    return named


def build_draft_plan(rows: list[tuple[list[int], int, list[int]]], block_size: int, step: int,
                     block_copies: list[tuple[int, int]] = ()) -> StepPlan:
    """Rank 0: a greedy step of the draft model over ``rows``, each ``(token ids, first position,
    block table)``: the tokens run at consecutive positions from the first one over the cache
    before it, and the last one's argmax is wanted. A DECODE when every row runs one token, else a
    PREFILL. ``block_copies``: (source, destination) blocks the draft's cache copies first.

    Raises:
        ValueError: no rows, or a row without tokens.
    """
    if not rows or any(not ids for ids, _, _ in rows):
        raise ValueError(f"a draft step needs rows with tokens, got {[len(ids) for ids, _, _ in rows]}")
    ids, pos, slots, cu_q, cu_k = [], [], [], [0], [0]
    for tokens, start, bt in rows:
        end = start + len(tokens)
        ids.extend(tokens)
        pos.extend(range(start, end))
        slots.extend(bt[p // block_size] * block_size + p % block_size for p in range(start, end))
        cu_q.append(cu_q[-1] + len(tokens))
        cu_k.append(cu_k[-1] + end)
    width = max(len(bt) for _, _, bt in rows)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    cu_q_t, cu_k_t = t(cu_q), t(cu_k)
    decode = all(len(tokens) == 1 for tokens, _, _ in rows)
    return StepPlan(
        kind=StepKind.DECODE if decode else StepKind.PREFILL, step=step, input_ids=t(ids), positions=t(pos),
        slot_mapping=t(slots), block_tables=t([bt + [-1] * (width - len(bt)) for _, _, bt in rows]),
        cu_seqlens_q=cu_q_t, cu_seqlens_k=cu_k_t, context_lens=cu_k_t[1:] - cu_k_t[:-1], sample_idx=cu_q_t[1:] - 1,
        block_copies=t(list(block_copies)).view(-1, 2), greedy=True, draft=True)


def pack(plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header [HEADER_LEN], payload [sum(payload_sizes(N, B, M))])`` int64 tensors."""
    return torch.tensor(_header(plan), dtype=torch.int64), _payload(plan)


def _header(plan: StepPlan) -> list[int]:
    """:func:`pack`'s header as a list."""
    if plan.kind in CONTROL_KINDS:
        return [MAGIC, int(plan.kind), 0, 0, 0, plan.step, 0, 0, 0, 0, 0]
    n, (b, m) = plan.input_ids.numel(), plan.block_tables.shape
    p, c, s = plan.prompt_idx.numel(), plan.block_copies.shape[0], plan.spec_idx.numel()
    greedy = int(plan.greedy) + int(plan.greedy and plan.grammar_mask)
    return [MAGIC, int(plan.kind), n, b, m, plan.step, greedy, p, c, s, int(plan.draft)]


def _payload(plan: StepPlan) -> torch.Tensor:
    """:func:`pack`'s payload: the plan's own (its fields are its views), else the fields concatenated."""
    if plan.kind in CONTROL_KINDS:
        return torch.empty(0, dtype=torch.int64)
    if plan.payload is not None:
        return plan.payload
    return torch.cat([getattr(plan, name).flatten() for name, _ in PAYLOAD_FIELDS])


def unpack(header: torch.Tensor, payload: torch.Tensor) -> StepPlan:
    """Inverse of :func:`pack`.

    Raises:
        RuntimeError: a header without the magic number or with an unknown kind (ranks out of
            step with each other).
    """
    magic, kind, n, b, m, step, greedy, p, c, s, draft = (int(x) for x in header.tolist())
    if magic != MAGIC or kind not in {k.value for k in StepKind}:
        raise RuntimeError(f"corrupt StepPlan header {header.tolist()}: ranks are out of lockstep")
    if kind in CONTROL_KINDS:
        return StepPlan(kind=StepKind(kind), step=step)
    parts = dict(zip((name for name, _ in PAYLOAD_FIELDS), torch.split(payload, payload_sizes(n, b, m, p, c, s))))
    parts["block_tables"] = parts["block_tables"].view(b, m)
    parts["block_copies"] = parts["block_copies"].view(c, 2)
    return StepPlan(kind=StepKind(kind), step=step, greedy=bool(greedy), grammar_mask=greedy == 2, draft=bool(draft),
                    payload=payload, **parts)


def broadcast_plan(plan: StepPlan | None) -> StepPlan:
    """The driver passes its plan; the replica's other ranks (every pipeline stage's) pass None and
    receive it. One broadcast on the gloo control group of ``HEADER_LEN + INLINE_PAYLOAD`` int64: the
    header, then the payload where it has at most :data:`INLINE_PAYLOAD` values (zeros after it); a longer
    payload follows in a second broadcast. Each is bounded by the process-group timeout."""
    if plan is not None:
        if get_tp().engine_size > 1:
            payload = _payload(plan)
            n = payload.numel()
            inline = payload.tolist() + [0] * (INLINE_PAYLOAD - n) if n <= INLINE_PAYLOAD else [0] * INLINE_PAYLOAD
            broadcast_control(torch.tensor(_header(plan) + inline, dtype=torch.int64), "the step plan's broadcast")
            if n > INLINE_PAYLOAD:
                broadcast_control(payload, "the step plan's payload broadcast")
        _note(plan)
        return plan
    message = broadcast_control(torch.empty(HEADER_LEN + INLINE_PAYLOAD, dtype=torch.int64),
                                "the step plan's broadcast")
    header = message[:HEADER_LEN]
    _, kind, n, b, m, _, _, p, c, s, _ = header.tolist()
    size = 0 if kind in CONTROL_KINDS else sum(payload_sizes(n, b, m, p, c, s))
    if size <= INLINE_PAYLOAD:
        payload = message[HEADER_LEN:HEADER_LEN + size]
    else:
        payload = broadcast_control(torch.empty(size, dtype=torch.int64), "the step plan's payload broadcast")
    plan = unpack(header, payload)
    _note(plan)
    return plan


def _note(plan: StepPlan) -> None:
    """The plan in this rank's forensics ring (:mod:`tpengine.forensics`)."""
    forensics.step(plan.step, plan.kind.name, 0 if plan.input_ids is None else plan.input_ids.numel(),
                   0 if plan.context_lens is None else plan.context_lens.numel())
