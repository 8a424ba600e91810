"""Logprobs on rank 0: the chosen token's log-probability and rank, and the top-k, from the raw
logits (vLLM's default ``raw_logprobs``: before logit_bias, penalties and temperature; what Hugging
Face's ``output_logits`` give)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from tpengine.engine.outputs import Logprob, PositionLogprobs

if TYPE_CHECKING:
    from tpengine.engine.sequence import Sequence as SequenceT


def position_logprobs(logits: torch.Tensor, chosen: Seq[int] | torch.Tensor, num_top: Seq[int],
                      vocab_size: int | None = None) -> list[PositionLogprobs]:
    """The logprobs of ``R`` positions.

    Each row's float32 ``log_softmax`` over the real vocabulary gives the chosen token's logprob and
    rank (1 + the number of tokens with a strictly larger logprob) and the ``num_top[r]`` most
    likely tokens, most likely first, ranked 1..k (ties in the order ``torch.topk`` returns them).

    Args:
        logits: float ``[R, V]`` raw logits (``V >= vocab_size``).
        chosen: ``R`` token ids (sampled, or the next prompt token).
        num_top: ``R`` counts k >= 0 of top logprobs to return.
        vocab_size: the real vocabulary; columns from it on (padding) are dropped, so a padded id
            never appears (default: all ``V`` columns are real).

    Returns:
        ``R`` :class:`PositionLogprobs` (``token`` None: the output processor fills it).

    Raises:
        ValueError: lengths that do not match the rows, or a chosen id outside the vocabulary.
    """
    if vocab_size is not None:
        logits = logits[:, :vocab_size]
    r, v = logits.shape
    chosen = torch.as_tensor(chosen, dtype=torch.int64).to(logits.device)
    if chosen.shape != (r,) or len(num_top) != r:
        raise ValueError(f"{r} logits rows but {chosen.numel()} chosen ids and {len(num_top)} top-k counts")
    if r == 0:
        return []
    if not (0 <= int(chosen.min()) and int(chosen.max()) < v):
        raise ValueError(f"chosen token ids {chosen.tolist()} are not all in the vocabulary [0, {v})")
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = lp.gather(1, chosen.unsqueeze(1))
    ranks = ((lp > chosen_lp).sum(dim=1) + 1).tolist()
    k = min(max(num_top), v)
    top_lp, top_ids = (torch.topk(lp, k, dim=-1) if k else (lp[:, :0], chosen.new_empty(r, 0)))
    top_lp, top_ids, chosen_lp, ids = top_lp.tolist(), top_ids.tolist(), chosen_lp[:, 0].tolist(), chosen.tolist()
    return [PositionLogprobs(Logprob(ids[i], chosen_lp[i], ranks[i]),
                             [Logprob(t, x, j + 1) for j, (t, x) in enumerate(zip(top_ids[i][:n], top_lp[i][:n]))])
            for i, n in enumerate(num_top)]


def add_sample_logprobs(logits: torch.Tensor, seqs: Seq[SequenceT | None], tokens: Seq[int],
                        vocab_size: int | None = None) -> None:
    """Record the logprobs of the tokens just sampled: for each row ``i`` whose ``seqs[i]`` asks for
    them (``params.logprobs`` k), append the :class:`PositionLogprobs` of ``tokens[i]`` with the top k
    to ``seq.logprobs`` and add its logprob to ``seq.cumulative_logprob``.

    Args:
        logits: float ``[R, V]`` the raw rows the tokens were sampled from.
        seqs: ``R`` sequences, None for a row to skip (e.g. one whose sampling failed).
        tokens: ``R`` sampled ids.
        vocab_size: as :func:`position_logprobs`.

    Raises:
        ValueError: as :func:`position_logprobs`.
    """
    want = [i for i, s in enumerate(seqs) if s is not None and s.params.logprobs is not None]
    if not want:
        return
    rows = logits.index_select(0, torch.tensor(want, device=logits.device))
    for i, lp in zip(want, position_logprobs(rows, [tokens[i] for i in want],
                                             [seqs[i].params.logprobs for i in want], vocab_size)):
        seqs[i].logprobs.append(lp)
        seqs[i].cumulative_logprob += lp.chosen.logprob


def collect_prompt_logprobs(seqs: Seq[SequenceT], rows: torch.Tensor, vocab_size: int | None = None) -> None:
    """Append the prompt logprobs of one step's ``rows [P, V]`` (raw logits at the plan's
    ``prompt_idx``: per sequence in batch order, positions ascending, as
    :func:`tpengine.engine.step.build_plan` made them) to each sequence's ``prompt_logprobs``. The row
    of position p predicts prompt token p + 1, so it is that token's entry (entry j of
    ``seq.prompt_logprobs`` is prompt position j + 1's); positions already collected (before a
    preemption) have no rows.

    Raises:
        RuntimeError: ``rows`` does not hold one row per position the plan asked for.
        ValueError: as :func:`position_logprobs`.
    """
    owners, chosen, ks = [], [], []
    for s in seqs:
        if s.prompt_logprobs is None:
            continue
        start = s.num_cached_tokens
        first, last = max(start, len(s.prompt_logprobs)), min(start + s.num_new_tokens, s.num_prompt_tokens - 1)
        for p in range(first, last):
            owners.append(s)
            chosen.append(s.token_ids[p + 1])
            ks.append(s.params.prompt_logprobs)
    if len(owners) != rows.shape[0]:
        raise RuntimeError(f"{rows.shape[0]} prompt-logprobs rows for {len(owners)} prompt positions")
    for s, lp in zip(owners, position_logprobs(rows, chosen, ks, vocab_size)):
        s.prompt_logprobs.append(lp)
