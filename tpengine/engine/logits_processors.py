"""Logits processors on rank 0: ``logit_bias``, ``min_tokens``, repetition / presence / frequency
penalties, applied to full-vocabulary float32 rows before temperature and the filters.

Order (vLLM's, :class:`~tpengine.sampling_params.SamplingParams`): bias, min_tokens, then
the penalties. Hugging Face ``generate`` runs ``sequence_bias``, then ``repetition_penalty``, then
``min_new_tokens`` (``GenerationMixin._get_logits_processor``); the two orders give the same rows,
since a -inf logit stays -inf under every penalty.

Each processor is one batched op over the ``[R, V]`` rows that need it (token counts built with
``torch.bincount``), never a Python loop over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch

from tpengine.engine.sequence import Sequence


def token_counts(token_ids: Seq[Seq[int]], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """How often each vocabulary id occurs in each of ``R`` id lists.

    Returns:
        float32 ``[R, vocab_size]`` counts on ``device``.

    Raises:
        ValueError: an id outside ``[0, vocab_size)``.
    """
    lens = torch.tensor([len(t) for t in token_ids], dtype=torch.int64)
    flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64)
    if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < vocab_size):
        bad = int(flat.min()) if int(flat.min()) < 0 else int(flat.max())
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), lens)
    counts = torch.bincount(rows * vocab_size + flat, minlength=len(token_ids) * vocab_size)
    return counts.view(len(token_ids), vocab_size).to(device=device, dtype=torch.float32)


def apply_logit_bias(logits: torch.Tensor, biases: Seq[dict[int, float]]) -> torch.Tensor:
    """Add ``biases[r][id]`` to ``logits[r, id]`` (OpenAI's / vLLM's ``logit_bias``; HF's
    ``sequence_bias`` with one-token sequences).

    Args:
        logits: float ``[R, V]``.
        biases: ``R`` dicts token id -> bias.

    Returns:
        a new ``[R, V]`` tensor.

    Raises:
        ValueError: a biased id outside ``[0, V)``.
    """
    v = logits.shape[1]
    rows = [r for r, b in enumerate(biases) for _ in b]
    cols = [t for b in biases for t in b]
    bad = [t for t in cols if not 0 <= t < v]
    if bad:
        raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {v})")
    vals = torch.tensor([x for b in biases for x in b.values()], dtype=logits.dtype, device=logits.device)
    idx = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(idx, vals, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, banned: Seq[Iterable[int]]) -> torch.Tensor:
    """Set ``logits[r, id]`` to -inf for every id in ``banned[r]`` (vLLM's ``min_tokens``: the
    EOS ids, unless ``ignore_eos``, and ``stop_token_ids``; HF's ``MinNewTokensLengthLogitsProcessor``).
    Ids outside ``[0, V)`` cannot be sampled and are skipped.

    Args:
        logits: float ``[R, V]``.
        banned: ``R`` collections of token ids.

    Returns:
        a new ``[R, V]`` tensor.
    """
    v = logits.shape[1]
    pairs = [(r, t) for r, ids in enumerate(banned) for t in ids if 0 <= t < v]
    if not pairs:
        return logits
    idx = torch.tensor(pairs, device=logits.device).T
    return logits.index_put((idx[0], idx[1]), torch.tensor(float("-inf"), device=logits.device, dtype=logits.dtype))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """The CTRL repetition penalty with Hugging Face's semantics: a logit of a token already in the
    row's prompt or output is divided by ``penalty`` when > 0 and multiplied by it otherwise.

    Source: Keskar et al. 2019, "CTRL: A Conditional Transformer Language Model for Controllable
    Generation" (arXiv:1909.05858); ``transformers.RepetitionPenaltyLogitsProcessor``.

    Args:
        logits: float ``[R, V]``.
        seen: bool ``[R, V]``, True for the ids in the row's prompt + output.
        penalty: float ``[R]`` (> 0; 1.0 leaves the row unchanged).

    Returns:
        a new ``[R, V]`` tensor.
    """
    p = penalty.to(logits.dtype).unsqueeze(1)
    return torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)


def apply_presence_frequency_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                                       frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI's penalties: ``logit -= presence * (count > 0) + frequency * count``, with ``count``
    the token's occurrences in the row's output (not its prompt).

    Source: OpenAI API reference, "Parameter details: frequency and presence penalties"; vLLM's
    ``apply_penalties``.

    Args:
        logits: float ``[R, V]``.
        counts: float ``[R, V]`` output-token counts.
        presence, frequency: float ``[R]`` penalties (0 off).

    Returns:
        a new ``[R, V]`` tensor.
    """
    counts = counts.to(logits.dtype)
    return logits - frequency.to(logits.dtype).unsqueeze(1) * counts \
        - presence.to(logits.dtype).unsqueeze(1) * (counts > 0).to(logits.dtype)


def min_tokens_banned(seq: Sequence, eos_token_ids: Iterable[int]) -> set[int]:
    """The ids ``seq`` may not sample now: while it has fewer than ``params.min_tokens`` generated
    tokens, its ``stop_token_ids`` and (unless ``ignore_eos``) the EOS ids; else none."""
    p = seq.params
    if seq.num_completion_tokens >= p.min_tokens:
        return set()
    return set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))


def needs_processing(seq: Sequence, eos_token_ids: Iterable[int] = ()) -> bool:
    """Whether :func:`process_logits` changes ``seq``'s row this step."""
    p = seq.params
    return bool(p.logit_bias or min_tokens_banned(seq, eos_token_ids) or p.repetition_penalty != 1.0
                or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)


def _on_rows(out: torch.Tensor, rows: list[int], fn) -> None:
    """``out[rows] = fn(out[rows])`` (all rows when ``rows`` covers the batch)."""
    if len(rows) == out.shape[0]:
        out.copy_(fn(out))
        return
    idx = torch.tensor(rows, device=out.device)
    out.index_copy_(0, idx, fn(out.index_select(0, idx)))


def process_logits(logits: torch.Tensor, seqs: Seq[Sequence], eos_token_ids: Iterable[int] = ()) -> torch.Tensor:
    """Apply each sequence's ``logit_bias``, ``min_tokens`` and penalties to its row, in vLLM's
    order, each processor one batched op over only the rows that use it.

    Args:
        logits: float ``[len(seqs), V]`` raw next-token logits over the real vocabulary.
        seqs: the rows' sequences (``params``, ``token_ids``, ``num_completion_tokens``).
        eos_token_ids: the engine's EOS ids (masked by ``min_tokens`` unless ``ignore_eos``).

    Returns:
        ``logits`` itself when no row needs processing, else a new float ``[len(seqs), V]`` tensor.

    Raises:
        ValueError: ``logits`` has not one row per sequence; a ``logit_bias`` or prompt/output id
            outside ``[0, V)``.
    """
    if logits.dim() != 2 or logits.shape[0] != len(seqs):
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(seqs)} sequences")
    eos = set(eos_token_ids)
    if not any(needs_processing(s, eos) for s in seqs):
        return logits
    out, v, dev = logits.clone(), logits.shape[1], logits.device
    ps = [s.params for s in seqs]
    rows = [i for i, p in enumerate(ps) if p.logit_bias]
    if rows:
        _on_rows(out, rows, lambda x: apply_logit_bias(x, [ps[i].logit_bias for i in rows]))
    banned = {i: b for i, s in enumerate(seqs) if (b := min_tokens_banned(s, eos))}
    if banned:
        _on_rows(out, list(banned), lambda x: apply_min_tokens(x, list(banned.values())))
    rows = [i for i, p in enumerate(ps) if p.repetition_penalty != 1.0]
    if rows:
        seen = token_counts([seqs[i].token_ids for i in rows], v, dev) > 0
        pen = torch.tensor([ps[i].repetition_penalty for i in rows], device=dev)
        _on_rows(out, rows, lambda x: apply_repetition_penalty(x, seen, pen))
    rows = [i for i, p in enumerate(ps) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if rows:
        counts = token_counts([seqs[i].completion_token_ids for i in rows], v, dev)
        pres = torch.tensor([ps[i].presence_penalty for i in rows], device=dev)
        freq = torch.tensor([ps[i].frequency_penalty for i in rows], device=dev)
        _on_rows(out, rows, lambda x: apply_presence_frequency_penalties(x, counts, pres, freq))
    return out
