"""Speculative decoding (rank 0): propose tokens, verify them in one step, keep what the target agrees with.

A batch-1 decode step reads every weight once for one token and is bound by memory bandwidth, so a step
that runs a sequence's last token and k proposed ones costs little more than a plain one and yields up
to k + 1 tokens (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318).

* **Proposing.** :class:`NgramProposer` (prompt lookup, vLLM's ``ngram`` method): the tokens that
  followed the latest earlier occurrence of the sequence's last n tokens, for the longest n in
  ``[prompt_lookup_min, prompt_lookup_max]`` that occurs; or a draft model (``draft_model``, a smaller
  model with the same vocabulary, split over the same ranks with its own KV cache addressed by the
  same block tables), run greedily k times (:meth:`SpecDecoder.draft`). Proposals are deterministic
  (a point-mass draft distribution q).
* **Verifying** (:meth:`SpecDecoder.verify`, called by the engine's update,
  :class:`tpengine.engine.update.StepUpdater`): the step computes the logits of all k + 1 positions;
  rank 0 then takes the sequence's tokens one position at a time exactly as a
  plain decode step would (logits processors, penalties, sampling with the request's own generator,
  stop checks, logprobs), and moves to the next position only while the token it took equals the
  proposed one. With a point-mass q, Leviathan et al.'s rule (accept the proposal d with probability
  min(1, p(d) / q(d)) = p(d), else draw from the residual norm(max(0, p - q)), which is p without d)
  is exactly this: draw x ~ p, accept iff x == d, else x is the draw from the residual. So the output
  distribution is the target's, and since each position draws once from the request's generator as
  a plain step does, greedy and seeded outputs are token for token those without speculation.
* **KV of rejected positions** is left behind: ``num_cached_tokens`` counts only accepted tokens (so
  prefix-cache hashes only cover them), the next step overwrites the first rejected slot, and the
  blocks past the accepted tokens go back to the pool (:meth:`BlockManager.trim`).
* **When it pays** (:class:`SpecPolicy`): per decode batch size, the seconds per emitted token of
  speculative and of plain steps are measured as they run, and a step speculates when that has been
  the faster; a fixed ``disable_by_batch_size`` replaces the measurement.

Sequences with a structured output (a grammar matcher) or asking for prompt logprobs get no proposals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tpengine.config import SpeculativeConfig
from tpengine.engine.sequence import Sequence
from tpengine.engine.step import StepPlan, build_draft_plan


@dataclass
class SpecState:
    """One sample's speculative decoding state (``Sequence.spec``): ``proposed`` and ``accepted``
    count the tokens proposed for it and those accepted (its output's ``spec_num_*_tokens``);
    ``num_draft_cached_tokens``: with a draft model, the tokens whose K/V the draft's cache holds (it
    writes into the same blocks; 0 again after a preemption)."""

    proposed: int = 0
    accepted: int = 0
    num_draft_cached_tokens: int = 0


def output_rows(seqs: list[Sequence], first: int) -> Callable[[int, int], int]:
    """The output row of scheduled sequence ``i``'s position ``j`` in a step's result: a sequence
    with a proposal of k tokens has its first k positions in rows after the sampled and prompt rows
    (``first`` on, in ``seqs`` order: ``StepPlan.spec_idx``) and its last one in row ``i``."""
    starts, at = [], first
    for s in seqs:
        starts.append(at)
        at += len(s.proposal)
    return lambda i, j: starts[i] + j if j < len(seqs[i].proposal) else i


class NgramProposer:
    """Prompt-lookup proposals over a sequence's prompt and output (vLLM's ``ngram`` method).

    Args:
        config: ``num_speculative_tokens`` (k), ``prompt_lookup_min`` / ``prompt_lookup_max`` (n range).

    :meth:`propose` looks for the sequence's last n tokens earlier in it, for n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``; the first n that occurs gives the proposal:
    the up to k tokens that followed its latest occurrence. (vLLM takes the earliest occurrence of
    the longest n; the latest is the more recent context, the one an edited copy of a text repeats.)
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to ``k`` (default ``num_speculative_tokens``) token ids to follow ``token_ids``; [] when
        the last ``prompt_lookup_min`` tokens occur nowhere earlier (or ``k`` < 1)."""
        k = self.k if k is None else min(k, self.k)
        total = len(token_ids)
        if k < 1 or total <= self.min_n:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        before = ids[:-1]  # a match ends at e <= total - 2, so a token follows it
        # match[e]: before[e - t .. e] equals the last t + 1 tokens, grown one t at a time while any match
        match = before == ids[-1]
        length, end = 0, -1
        for t in range(min(self.max_n, total - 1)):
            if t:
                match[:t] = False
                match[t:] &= before[: before.size - t] == ids[-1 - t]
            hits = np.flatnonzero(match)
            if not hits.size:
                break
            length, end = t + 1, int(hits[-1])
        if length < self.min_n:
            return []
        return ids[end + 1: end + 1 + k].tolist()


class SpecPolicy:
    """Whether a decode step of ``b`` sequences should carry proposals, chosen on the running machine.

    With ``disable_by_batch_size`` set: while ``b`` is at most that. Otherwise measured: decode batch
    sizes fall in power-of-two buckets (1, 2-3, 4-7, ...); each keeps an exponential moving average
    (weight :data:`ALPHA`) of the seconds per emitted token of its plain and of its speculative steps,
    and the seconds it spent on each. A bucket without both runs the one it lacks; then the faster one
    runs, and the slower one runs again (to keep its average current, so a change such as another
    workload's acceptance is seen) while the time spent on it is under :data:`EXPLORE_SHARE` of the
    bucket's time. Exploring is so bounded in time, not in steps: where a speculative step costs many
    plain ones (a large batch verifying proposals), it is retried that much more rarely, and what
    exploring loses stays under that share however slow the slower option is.
    """

    #: Weight of the newest step in the moving averages.
    ALPHA = 0.2
    #: The most of a bucket's time spent running the option that is not the faster.
    EXPLORE_SHARE = 0.03

    def __init__(self, disable_by_batch_size: int | None = None) -> None:
        self.disable_by_batch_size = disable_by_batch_size
        self.seconds_per_token: dict[tuple[int, bool], float] = {}  # (bucket, speculative) -> EMA
        self.seconds: dict[tuple[int, bool], float] = {}  # (bucket, speculative) -> total seconds

    @staticmethod
    def bucket(b: int) -> int:
        """The bucket of a decode batch of ``b`` >= 1 sequences: ``b.bit_length()``."""
        return max(1, b).bit_length()

    def wants(self, b: int) -> bool:
        """Whether the next decode step of ``b`` sequences should carry proposals."""
        if self.disable_by_batch_size is not None:
            return b <= self.disable_by_batch_size
        key = self.bucket(b)
        spec, plain = self.seconds_per_token.get((key, True)), self.seconds_per_token.get((key, False))
        if spec is None or plain is None:
            return spec is None
        slower = spec > plain
        total = self.seconds[(key, True)] + self.seconds[(key, False)]
        return slower if self.seconds[(key, slower)] < self.EXPLORE_SHARE * total else not slower

    def record(self, b: int, speculative: bool, seconds: float, tokens: int) -> None:
        """A decode step of ``b`` sequences ran (``speculative``: with proposals) in ``seconds`` and
        emitted ``tokens`` tokens."""
        if tokens < 1 or seconds <= 0:
            return
        key = (self.bucket(b), speculative)
        v = seconds / tokens
        old = self.seconds_per_token.get(key)
        self.seconds_per_token[key] = v if old is None else old + self.ALPHA * (v - old)
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds


class SpecDecodeStats:
    """Counters of speculative decoding, by vLLM's ``spec_decode_*`` metric names: ``num_drafts``
    (sequence-steps that carried proposals), ``num_draft_tokens`` (tokens proposed),
    ``num_accepted_tokens`` (proposed tokens accepted) and ``accepted_per_pos`` (accepted at each
    proposal position 0..k-1); :class:`~tpengine.engine.stats.EngineStats` carries them and their ratios."""

    def __init__(self, k: int) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def add(self, proposed: int, accepted: int) -> None:
        """One sequence-step that proposed ``proposed`` tokens, of which the first ``accepted`` were
        taken."""
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1


class SpecDecoder:
    """Rank 0's speculative decoding: the proposer, the policy and the counters.

    Args:
        config: the launch's :class:`~tpengine.config.SpeculativeConfig`.
        max_model_len: no proposal reaches past it.
        block_size: tokens per KV block (the draft model's steps use the sequences' block tables).

    With method ``draft_model`` every rank holds the draft model's runner (its own KV cache with the
    target's block count, so a sequence's block table addresses both); :meth:`draft` runs it through
    a callable that broadcasts a draft plan and returns the argmax ids.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int, block_size: int = 16) -> None:
        self.config = config
        self.uses_draft_model = config.method == "draft_model"
        self.proposer = None if self.uses_draft_model else NgramProposer(config)
        self.policy = SpecPolicy(config.disable_by_batch_size)
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        self.max_model_len, self.block_size = max_model_len, block_size

    def room(self, seq: Sequence) -> int:
        """The most tokens ``seq`` may propose now: k, less what would pass ``max_tokens`` (the step
        emits up to proposals + 1 tokens) or ``max_model_len``; 0 for a sequence with a grammar or
        prompt logprobs."""
        if seq.structured is not None or seq.params.prompt_logprobs is not None:
            return 0
        k = self.config.num_speculative_tokens
        if seq.params.max_tokens is not None:
            k = min(k, seq.params.max_tokens - seq.num_completion_tokens - 1)
        return max(0, min(k, self.max_model_len - seq.num_tokens - 1))

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """The n-gram proposal for ``seq``, at most ``limit`` tokens (and :meth:`room`)."""
        k = min(limit, self.room(seq))
        return self.proposer.propose(seq.token_ids, k) if k > 0 else []

    def draft(self, seqs: list[Sequence], budget: int, scheduler, run: Callable[[StepPlan], list[int]],
              step: int) -> dict[int, list[int]]:
        """Draft-model proposals for the decode batch ``seqs`` (index -> tokens), at most ``budget``
        tokens in all. Each sequence's table first grows for k more positions (``scheduler.reserve``;
        one that cannot grow gets none); then one draft step runs every sequence's tokens the draft
        has not seen (``num_draft_cached_tokens`` on: usually its last one or two, its whole prompt
        the first time) and takes its argmax, and k - 1 one-token steps feed each argmax back (greedy
        draft: a point-mass proposal). The block copies the target step will run go with the first
        draft step too. ``run``: broadcasts a draft plan and returns its argmax ids."""
        want: list[tuple[int, int]] = []
        for i, seq in enumerate(seqs):
            k = min(budget, self.room(seq))
            if k > 0 and scheduler.reserve(seq, k):
                want.append((i, k))
                budget -= k
        if not want:
            return {}
        rows = [(seqs[i].token_ids[seqs[i].spec.num_draft_cached_tokens:], seqs[i].spec.num_draft_cached_tokens,
                 seqs[i].block_table) for i, _ in want]
        ids = run(build_draft_plan(rows, self.block_size, step, scheduler.block_copies))
        proposals = {i: [tok] for (i, _), tok in zip(want, ids)}
        for j in range(1, max(k for _, k in want)):
            live = [i for i, k in want if k > j]
            ids = run(build_draft_plan([([proposals[i][-1]], seqs[i].num_tokens - 1 + j, seqs[i].block_table)
                                        for i in live], self.block_size, step))
            for i, tok in zip(live, ids):
                proposals[i].append(tok)
        for i, k in want:  # fed: the tokens up to the last one, then the first k - 1 proposals
            seqs[i].spec.num_draft_cached_tokens = seqs[i].num_tokens + k - 1
        return proposals

    def schedule(self, seqs: list[Sequence], scheduler, run: Callable[[StepPlan], list[int]], step: int) -> bool:
        """Give each sequence of the decode batch ``seqs`` its proposal, when the policy finds a
        speculative step worth it: as many tokens as the step's token budget
        (``scheduler.max_num_batched_tokens``) and free blocks allow (``scheduler.reserve_proposal``).
        ``run``: broadcasts a draft plan and returns its argmax ids (a draft model). True if any got one."""
        if not seqs or not self.policy.wants(len(seqs)):
            return False
        budget, any_ = scheduler.max_num_batched_tokens - len(seqs), False
        if self.uses_draft_model:
            for i, proposal in self.draft(seqs, budget, scheduler, run, step).items():
                any_ |= scheduler.reserve_proposal(seqs[i], proposal)  # blocks reserved: never fails
            return any_
        for seq in seqs:
            if budget <= 0:
                break
            proposal = self.propose(seq, budget)
            if proposal and scheduler.reserve_proposal(seq, proposal):
                budget -= len(proposal)
                any_ = True
        return any_

    @staticmethod
    def count_proposed(seqs: list[Sequence]) -> None:
        """Count this step's proposals in their samples' ``spec.proposed`` (before any token goes out:
        a request that finishes in this step reports them)."""
        for s in seqs:
            if s.proposal:
                s.spec.proposed += len(s.proposal)

    def verify(self, seqs: list[Sequence], tokens: list[int], take: Callable[[list[int], int], list[int]],
               trim: Callable[[Sequence], None]) -> int:
        """Verify the proposals of the scheduled ``seqs``, whose last-token position took ``tokens``
        (row i for ``seqs[i]``): for j = 1, 2, ..., the sequences whose position j - 1 took the proposed
        token (and that have not finished) take position j through ``take(live, j)`` (indices into
        ``seqs`` -> their tokens). Then each sequence's counters are added, its draft K/V is kept only
        for accepted tokens, its proposal is cleared and, unless finished, the blocks of its rejected
        positions go back (``trim``). Returns the tokens taken here (beyond ``tokens``)."""
        took = dict(zip(range(len(seqs)), tokens))
        live = [i for i in range(len(seqs)) if seqs[i].proposal]
        accepted, emitted = dict.fromkeys(live, 0), 0
        for j in range(1, max((len(seqs[i].proposal) for i in live), default=0) + 1):
            live = [i for i in live if j <= len(seqs[i].proposal) and not seqs[i].is_finished
                    and took[i] == seqs[i].proposal[j - 1]]
            if not live:
                break
            for i in live:  # its proposed token j - 1 was taken
                seqs[i].spec.accepted += 1
            emitted += len(live)
            for i, tok in zip(live, take(live, j)):
                took[i], accepted[i] = tok, j
        for i, m in accepted.items():
            seq = seqs[i]
            self.stats.add(len(seq.proposal), m)
            # the draft's K/V stays valid for the accepted tokens it was fed
            seq.spec.num_draft_cached_tokens = min(seq.spec.num_draft_cached_tokens, seq.num_cached_tokens)
            seq.proposal = []
            if not seq.is_finished:  # the blocks of the rejected positions go back
                trim(seq)
        return emitted
