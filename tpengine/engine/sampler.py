"""Token sampling on rank 0: logits processors (bias, min_tokens, penalties), then greedy,
temperature, top-k, top-p, min-p, per-request seeds.

The processors run batched over the rows that need them (:mod:`tpengine.engine.logits_processors`);
seeded rows then draw one at a time with the row's own ``torch.Generator``, so a seeded request
draws the same tokens whatever else is in the batch (case C17) and at any tp size; the unseeded
rows of a step draw together from the sampler's default generator, in one call.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tpengine.engine.logits_processors import process_logits
from tpengine.engine.sequence import Sequence


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest entries of a 1-D ``logits`` row, set the rest to -inf.
    ``k <= 0`` or ``k >= len(logits)`` returns ``logits`` unchanged."""
    if k <= 0 or k >= logits.numel():
        return logits
    idx = torch.topk(logits, k).indices
    out = torch.full_like(logits, float("-inf"))
    out[idx] = logits[idx]
    return out


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering of a 1-D row: keep the smallest set of most likely tokens whose
    cumulative probability is >= ``top_p``; the most likely token is always kept.

    Source: Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration"
    (arXiv:1904.09751).
    """
    if top_p >= 1.0:
        return logits
    probs, idx = torch.sort(torch.softmax(logits, dim=-1), descending=True)
    # probability mass strictly before each token; token i is kept while that mass < top_p
    # (the top token has 0 before it and top_p > 0, so it is always kept)
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
    out = logits.clone()
    out[idx[drop]] = float("-inf")
    return out


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Min-p filtering of a 1-D row: drop tokens whose probability is < ``min_p`` times the
    largest probability (the most likely token always survives).

    Source: Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling for Creative and Coherent
    LLM Outputs" (arXiv:2407.01082).
    """
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    drop = probs < min_p * probs.max()
    drop[probs.argmax()] = False
    return logits.masked_fill(drop, float("-inf"))


def _filtered(row: torch.Tensor, p) -> torch.Tensor:
    """A 1-D row of temperature-scaled logits after ``p``'s top-k, top-p and min-p, in that order."""
    return apply_min_p(apply_top_p(apply_top_k(row, p.top_k), p.top_p), p.min_p)


class Sampler:
    """Picks one next token per sequence from its logits.

    Args:
        seed: seed of the default generator used by requests without ``params.seed``.
        eos_token_ids: the engine's EOS ids, which ``min_tokens`` masks (unless ``ignore_eos``).
    """

    def __init__(self, seed: int = 0, eos_token_ids: Iterable[int] = ()) -> None:
        self.seed = seed
        self.eos_token_ids = frozenset(eos_token_ids)
        self._default: dict[torch.device, torch.Generator] = {}

    def _default_generator(self, device: torch.device) -> torch.Generator:
        g = self._default.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._default[device] = g
        return g

    @staticmethod
    def _seq_generator(seq: Sequence, device: torch.device) -> torch.Generator:
        if seq.generator is None:
            seq.generator = torch.Generator(device=device)
            seq.generator.manual_seed(seq.params.seed)
        return seq.generator

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               errors: dict[int, Exception] | None = None) -> list[int]:
        """Sample one token id per row.

        Args:
            logits: float ``[len(seqs), V]`` raw next-token logits, row i for ``seqs[i]``, over the
                real vocabulary (the LM head drops the padding columns, so a padded id is never
                sampled). Not modified.
            seqs: the sequences (their ``params``, token ids and generators are used).
            errors: when given, a row whose processing or sampling raises (e.g. a ``logit_bias``
                id outside the vocabulary, a temperature so small that ``logits / temperature``
                overflows to inf) is entered here (row -> exception) and gets token 0, and the other
                rows are sampled as usual; when None, it raises. A failing row draws nothing from
                its generator.

        First :func:`~tpengine.engine.logits_processors.process_logits` (logit_bias, min_tokens,
        repetition / presence / frequency penalties) on the rows that need it. Greedy rows
        (temperature 0) then take the argmax, all in one op. Other rows: logits / temperature,
        then top-k, top-p, min-p, then ``torch.multinomial`` with the sequence's own generator
        (seeded from ``params.seed`` once per sequence, advanced only by its own draws), or, for the
        unseeded rows, one call over them all with this sampler's default generator.

        Returns:
            ``len(seqs)`` token ids.

        Raises:
            ValueError: ``logits`` is not 2-D with one row per sequence.
        """
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match {len(seqs)} sequences"
            )
        logits = self._process(logits.float(), seqs, errors)
        failed = errors if errors is not None else {}
        out: list[int] = [0] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.params.temperature == 0.0 and i not in failed]
        if greedy:
            rows = torch.tensor(greedy, device=logits.device)
            for i, tok in zip(greedy, logits.index_select(0, rows).argmax(dim=-1).tolist()):
                out[i] = tok
        sampled = [i for i, s in enumerate(seqs) if s.params.temperature != 0.0 and i not in failed]
        shared = [i for i in sampled if seqs[i].params.seed is None]
        if len(shared) > 1 and self._draw_together(logits, seqs, shared, out):
            sampled = [i for i in sampled if seqs[i].params.seed is not None]
        for i in sampled:
            try:
                out[i] = self._sample_row(logits[i], seqs[i])
            except Exception as e:  # noqa: BLE001 -- one request's failure, handed to the caller
                if errors is None:
                    raise
                errors[i] = e
        return out

    def _draw_together(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], out: list[int]) -> bool:
        """Sample the unseeded ``rows`` (two or more) in one ``torch.multinomial`` call from the default
        generator (vLLM samples a batch so): each row's filters as :meth:`_sample_row` applies them (in
        one op for rows with only a temperature), then one draw per row. Writes ``out[i]`` and returns
        True; False (nothing drawn, ``out`` untouched) where a row's filtered probabilities are not a
        distribution (a temperature that overflows its logits, say): the caller then samples each row
        alone and reports the failing one."""
        idx = torch.tensor(rows, device=logits.device)
        temps = torch.tensor([seqs[i].params.temperature for i in rows], device=logits.device)
        try:
            scaled = logits.index_select(0, idx) / temps[:, None]
            for j, i in enumerate(rows):
                p = seqs[i].params
                if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
                    scaled[j] = _filtered(scaled[j], p)
            probs = torch.softmax(scaled, dim=-1)
        except Exception:  # noqa: BLE001 -- the rows alone find and report the failing one
            return False
        if not bool(torch.isfinite(probs).all()):
            return False
        draws = torch.multinomial(probs, 1, generator=self._default_generator(probs.device))[:, 0].tolist()
        for i, tok in zip(rows, draws):
            out[i] = tok
        return True

    def _process(self, logits: torch.Tensor, seqs: list[Sequence],
                 errors: dict[int, Exception] | None) -> torch.Tensor:
        """:func:`process_logits` over the batch; if that raises and ``errors`` is given, each row
        is processed alone and a failing one is entered in ``errors`` (its row left raw)."""
        try:
            return process_logits(logits, seqs, self.eos_token_ids)
        except Exception:
            if errors is None:
                raise
        out = logits.clone()
        for i, seq in enumerate(seqs):
            try:
                out[i] = process_logits(logits[i : i + 1], [seq], self.eos_token_ids)[0]
            except Exception as e:  # noqa: BLE001 -- one request's failure, handed to the caller
                errors[i] = e
        return out

    def _sample_row(self, logits: torch.Tensor, seq: Sequence) -> int:
        """One token from a 1-D ``logits [V]`` row with ``seq``'s params and generator."""
        p = seq.params
        probs = torch.softmax(_filtered(logits / p.temperature, p), dim=-1)
        if p.seed is None:
            gen = self._default_generator(probs.device)
        else:
            gen = self._seq_generator(seq, probs.device)
            if gen.device != probs.device:
                probs = probs.to(gen.device)
        return int(torch.multinomial(probs, 1, generator=gen).item())
