"""Logprobs on rank 0: the chosen token's log-probability and rank, and the top-k, from the raw
logits (vLLM's default ``raw_logprobs``: before logit_bias, penalties and temperature; what Hugging
Face's ``output_logits`` give)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from tpengine.engine.outputs import Logprob, PositionLogprobs


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
