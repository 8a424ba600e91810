"""One token per batch row from a step's result (rank 0), each request's failure its own.

A greedy step's result is each row's argmax id (taken on the ranks' vocabulary shards); any other
step's is the gathered logits, which :class:`RowSampler` masks with the structured outputs' bitmask,
samples with the :class:`~tpengine.engine.sampler.Sampler` and scores for the requests asking for
logprobs. A row whose masking, sampling or logprobs raise is entered in the step's failure record
(row -> (stage, exception)) and the other rows come out as if it had not been there.
"""

from __future__ import annotations

import torch

from tpengine.engine.logprobs import add_sample_logprobs, collect_prompt_logprobs
from tpengine.engine.sampler import Sampler
from tpengine.engine.sequence import Sequence
from tpengine.engine.structured_output import Failures, StructuredOutputs


class RowSampler:
    """Takes the tokens of a step's rows.

    Args:
        sampler: the engine's :class:`~tpengine.engine.sampler.Sampler`.
        vocab_size: the model's vocabulary (logits columns from it on are padding).
        structured: the engine's structured outputs (masks the constrained rows), or None if no
            step has masks.
    """

    def __init__(self, sampler: Sampler, vocab_size: int, structured: StructuredOutputs | None = None) -> None:
        self.sampler, self.vocab_size, self.structured = sampler, vocab_size, structured

    def take(self, out: torch.Tensor, greedy: bool, batch: list[Sequence], out_rows: list[int], rows: list[int],
             sampled: list[bool], failed: Failures, masks) -> list[int]:
        """One token per ``batch`` sequence from the step's result ``out`` (int64 ``[R]`` argmax ids of
        a ``greedy`` step, else float ``[R, V]`` logits): row ``out_rows[i]``'s id, or a sample from
        that row's logits, masked first by the grammar bitmask future ``masks`` (rows by scheduled
        sequence: ``rows[i]``; None: no mask)."""
        if greedy:
            ids = out.tolist()
            return [ids[r] for r in out_rows]
        if out_rows == list(range(len(out_rows))):
            logits = out[:len(out_rows)]
        else:
            logits = out.index_select(0, torch.tensor(out_rows, device=out.device))
        if masks is not None:  # the gathered rows, masked on rank 0
            logits = self.structured.apply(logits, masks.result(), batch, rows, sampled, failed)
        return self.sample(logits, batch, sampled, failed)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], sampled: list[bool], failed: Failures) -> list[int]:
        """One token per sequence from ``logits [B, V]`` (row i for ``seqs[i]``); only the rows with
        ``sampled`` draw from their generators (a prefill chunk's row gets 0 and draws nothing, so
        seeded output does not depend on chunking, cache hits or preemption). A sampled sequence with
        ``params.logprobs`` gets its token's logprobs (from the raw row, :func:`add_sample_logprobs`).
        A row whose sampling raises is entered in ``failed`` (row -> ("sampling", exception)) and gets
        0; the other rows are sampled as if it had not."""
        rows = [i for i, ok in enumerate(sampled) if ok]
        tokens = [0] * len(seqs)
        if not rows:
            return tokens
        picked = logits if len(rows) == len(seqs) else logits.index_select(0, torch.tensor(rows, device=logits.device))
        errors: dict[int, Exception] = {}
        for i, tok in zip(rows, self.sampler.sample(picked, [seqs[i] for i in rows], errors)):
            tokens[i] = tok
        failed.update({rows[j]: ("sampling", e) for j, e in errors.items()})
        try:
            add_sample_logprobs(picked, [None if i in failed else seqs[i] for i in rows], [tokens[i] for i in rows],
                                self.vocab_size)
        except Exception as e:  # noqa: BLE001 -- failures are the requests' own
            failed.update({i: ("logprobs", e) for i in rows if i not in failed and seqs[i].params.logprobs is not None})
        return tokens

    def prompt_logprobs(self, seqs: list[Sequence], rows: torch.Tensor, failed: Failures) -> None:
        """:func:`collect_prompt_logprobs` of a step's prompt ``rows``; a failure is the requests' own
        (every sequence with prompt logprobs enters ``failed`` as ("prompt logprobs", exception))."""
        try:
            collect_prompt_logprobs(seqs, rows, self.vocab_size)
        except Exception as e:  # noqa: BLE001
            failed.update({i: ("prompt logprobs", e) for i, s in enumerate(seqs) if s.prompt_logprobs is not None})
