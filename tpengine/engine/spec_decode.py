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
* **When it pays** (:class:`SpecPolicy`): a proposed token costs part of a step, measured per decode
  batch size as it runs (``rho``: the extra seconds of a speculative step per proposed token, in plain
  seconds per emitted token); a sequence proposes a position while its recent proposals were accepted
  there more often than ``rho``, backs off for a number of steps when even its first position was
  not (retrying later, each failed retry waiting twice as long), and no sequence proposes at a batch
  size where ``rho`` >= 1; a fixed ``disable_by_batch_size`` replaces all of this.

Sequences with a structured output (a grammar matcher) or asking for prompt logprobs get no proposals.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median

import numpy as np

from tpengine.config import SpeculativeConfig
from tpengine.engine.sequence import Sequence
from tpengine.engine.step import StepPlan, build_draft_plan


@dataclass
class SpecState:
    """One sample's speculative decoding state (``Sequence.spec``): ``proposed`` and ``accepted``
    count the tokens proposed for it and those accepted (its output's ``spec_num_*_tokens``);
    ``num_draft_cached_tokens``: with a draft model, the tokens whose K/V the draft's cache holds (it
    writes into the same blocks; 0 again after a preemption). :class:`SpecPolicy`'s per-sequence
    state: ``recent``, the (proposed, accepted) counts of its last :attr:`SpecPolicy.WINDOW` proposals;
    ``skip``, the decode steps it still sits out (a back-off); ``backoff``, the next back-off's steps
    (0: :attr:`SpecPolicy.BACKOFF_START`); ``shadows``, the n-gram proposals made while it sits out
    and not proposed, each (its first token's index, its tokens), judged once the tokens they
    predicted have come."""

    proposed: int = 0
    accepted: int = 0
    num_draft_cached_tokens: int = 0
    recent: list[tuple[int, int]] = field(default_factory=list)
    skip: int = 0
    backoff: int = 0
    shadows: list[tuple[int, list[int]]] = field(default_factory=list)


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
    """Which sequences of a decode step of ``b`` should propose, and how many tokens, on the running machine.

    With ``disable_by_batch_size`` set: every sequence proposes all it can while ``b`` is at most
    that, none beyond. Otherwise two measurements meet:

    * **What a proposed token costs** (per batch-size bucket: 1, 2-3, 4-7, ...; machine-bound, not
      request-bound): the median seconds of the bucket's last :attr:`SAMPLES` plain decode steps
      (``T``), and of its speculative steps' seconds beyond ``T`` per proposed token (``c``); their
      ratio ``rho = c * b / T`` is a proposed token's cost in plain emitted tokens. A sequence's
      proposed token pays when it is accepted with a probability above ``rho``. Where ``rho`` >= 1
      nothing can pay: the bucket runs plain steps, and speculative ones again only while their time
      is under :data:`EXPLORE_SHARE` of the bucket's (so a change of machine load is seen). A plain
      step runs when the bucket has run :attr:`REFRESH` steps without one (its ``T`` kept current).
      Unmeasured, ``rho`` is taken as 0.
    * **How a sequence's proposals fare** (:class:`SpecState`): over its last :attr:`WINDOW`
      proposals, position j's acceptance is the share of those reaching j that had their first j
      tokens accepted; a sequence proposes up to the last position (from 2 on) whose acceptance,
      once :attr:`MIN_SAMPLES` proposals reached it, is above ``rho``. When the first position's is
      not, it backs off: it sits out :attr:`BACKOFF_START` decode steps, then proposes again; each
      further failed judgement doubles the wait (up to :attr:`BACKOFF_MAX`), a passed one resets it.
      While it sits out, the n-gram proposer's proposals are still made but not proposed (a
      *shadow*, which costs no step) and judged against the tokens that come; the back-off ends as
      soon as they bring the window's first position above ``rho`` again. So a request is never
      switched off for good after a few misses: a stretch of text it cannot predict costs a few
      probes, and a later stretch that repeats earlier text is found again within a step or two.

    Speculative decoding's gain and the acceptance it needs: Leviathan et al. 2023 (arXiv:2211.17192,
    section 3.4); the window and back-off are this engine's.
    """

    #: The proposals of a sequence its acceptance is judged over.
    WINDOW = 8
    #: Proposals that must reach a position before its acceptance is judged.
    MIN_SAMPLES = 3
    #: A sequence's first back-off (decode steps), and its longest.
    BACKOFF_START, BACKOFF_MAX = 4, 64
    #: Step timings per bucket the medians are taken over.
    SAMPLES = 16
    #: A bucket's plain step is measured again after this many of its steps without one.
    REFRESH = 64
    #: The most of a bucket's time spent on speculative steps where a proposed token costs an emitted one.
    EXPLORE_SHARE = 0.03

    def __init__(self, disable_by_batch_size: int | None = None) -> None:
        self.disable_by_batch_size = disable_by_batch_size
        self.plain: dict[int, deque[float]] = {}  # bucket -> seconds of its last plain steps
        self.extra: dict[int, deque[float]] = {}  # bucket -> extra seconds per proposed token
        self.since_plain: dict[int, int] = {}  # bucket -> its steps since its last plain one
        self.seconds: dict[tuple[int, bool], float] = {}  # (bucket, speculative) -> total seconds

    @staticmethod
    def bucket(b: int) -> int:
        """The bucket of a decode batch of ``b`` >= 1 sequences: ``b.bit_length()``."""
        return max(1, b).bit_length()

    def token_cost(self, b: int) -> float | None:
        """``rho`` at batch ``b``: a proposed token's measured cost in plain emitted tokens (>= 0), or
        None before the bucket has both timings."""
        key = self.bucket(b)
        if not self.plain.get(key) or not self.extra.get(key):
            return None
        return max(0.0, median(self.extra[key]) * b / median(self.plain[key]))

    def threshold(self, b: int) -> float | None:
        """The acceptance a proposed position needs in the next decode step of ``b`` sequences
        (``rho``; 0 unmeasured or exploring, or with ``disable_by_batch_size``), or None when the step
        should carry no proposals."""
        if self.disable_by_batch_size is not None:
            return 0.0 if b <= self.disable_by_batch_size else None
        key = self.bucket(b)
        if self.since_plain.get(key, 0) >= (self.REFRESH if self.plain.get(key) else 2):
            return None  # time a plain step: the first ones after two speculative, then every REFRESH
        rho = self.token_cost(b)
        if rho is None or rho < 1:
            return rho or 0.0
        spec, plain = self.seconds.get((key, True), 0.0), self.seconds.get((key, False), 0.0)
        return 0.0 if spec < self.EXPLORE_SHARE * (spec + plain) else None

    def _acceptance(self, state: SpecState, j: int) -> float | None:
        """Position ``j``'s acceptance over ``state``'s recent proposals; None if under MIN_SAMPLES reached it."""
        reach = [m for n, m in state.recent if n >= j]
        return sum(m >= j for m in reach) / len(reach) if len(reach) >= self.MIN_SAMPLES else None

    def length(self, state: SpecState | None, k: int, rho: float) -> int:
        """The most tokens (<= ``k``) the sequence of ``state`` should propose in a step of threshold
        ``rho`` (:meth:`threshold`): 0 while it backs off (this step counts as one it sat out)."""
        if state is None or self.disable_by_batch_size is not None:
            return k
        if state.skip > 0:
            state.skip -= 1
            return 0
        for j in range(2, k + 1):
            if (p := self._acceptance(state, j)) is not None and p <= rho:
                return j - 1
        return k

    def judge(self, state: SpecState | None, proposed: int, accepted: int, rho: float, shadow: bool = False) -> None:
        """The sequence of ``state`` proposed ``proposed`` tokens and ``accepted`` were taken, at a
        threshold ``rho``: into its window, and a back-off when its first position does not pay.
        ``shadow``: a proposal made while it sat out, not proposed: it can only end the back-off."""
        if state is None:
            return
        state.recent = (state.recent + [(proposed, accepted)])[-self.WINDOW:]
        if self.disable_by_batch_size is not None:
            return
        if shadow:
            if (p := self._acceptance(state, 1)) is not None and p > rho:
                state.skip = state.backoff = 0
        elif (p := self._acceptance(state, 1)) is not None and p <= rho:
            state.skip = state.backoff or self.BACKOFF_START
            state.backoff = min(2 * state.skip, self.BACKOFF_MAX)
        else:
            state.backoff = 0

    def record(self, b: int, speculative: bool, seconds: float, tokens: int, proposed: int = 0) -> None:
        """A decode step of ``b`` sequences ran (``speculative``: with ``proposed`` proposed tokens)
        in ``seconds`` and emitted ``tokens`` tokens."""
        if tokens < 1 or seconds <= 0:
            return
        key = self.bucket(b)
        self.seconds[(key, speculative)] = self.seconds.get((key, speculative), 0.0) + seconds
        if not speculative:
            self.plain.setdefault(key, deque(maxlen=self.SAMPLES)).append(seconds)
            self.since_plain[key] = 0
            return
        self.since_plain[key] = self.since_plain.get(key, 0) + 1
        if proposed > 0 and self.plain.get(key):
            self.extra.setdefault(key, deque(maxlen=self.SAMPLES)).append(
                (seconds - median(self.plain[key])) / proposed)


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

    def limit(self, seq: Sequence, rho: float) -> int:
        """The most tokens ``seq`` should propose in a step of threshold ``rho`` (:meth:`SpecPolicy.length`).
        While it sits out a back-off, it makes an n-gram proposal every step without proposing it (a
        shadow), and each is judged once the tokens it predicted have come or one of them differed
        (:meth:`SpecPolicy.judge`; a judgement that passes ends the back-off)."""
        st, k = seq.spec, self.config.num_speculative_tokens
        if st is not None and st.shadows:
            pending = []
            for at, shadow in st.shadows:
                got = seq.token_ids[at:at + len(shadow)]
                m = next((j for j, (a, b) in enumerate(zip(shadow, got)) if a != b), len(got))
                if m < len(got) or m == len(shadow):
                    self.policy.judge(st, len(shadow), m, rho, shadow=True)
                else:
                    pending.append((at, shadow))
            st.shadows = pending
        n = self.policy.length(st, k, rho)
        if st is not None and self.proposer is not None:
            if n > 0:
                st.shadows = []
            elif st.skip and (shadow := self.propose(seq, k)):
                st.shadows.append((seq.num_tokens, shadow))
        return n

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """The n-gram proposal for ``seq``, at most ``limit`` tokens (and :meth:`room`)."""
        k = min(limit, self.room(seq))
        return self.proposer.propose(seq.token_ids, k) if k > 0 else []

    def draft(self, seqs: list[Sequence], limits: list[int], budget: int, scheduler,
              run: Callable[[StepPlan], list[int]], step: int) -> dict[int, list[int]]:
        """Draft-model proposals for the decode batch ``seqs`` (index -> tokens), at most ``limits[i]``
        tokens for ``seqs[i]`` and ``budget`` tokens in all. Each sequence's table first grows for its
        k more positions (``scheduler.reserve``; one that cannot grow gets none); then one draft step
        runs every sequence's tokens the draft has not seen (``num_draft_cached_tokens`` on: usually
        its last one or two, its whole prompt the first time) and takes its argmax, and k - 1
        one-token steps feed each argmax back (greedy draft: a point-mass proposal). The block copies
        the target step will run go with the first draft step too. ``run``: broadcasts a draft plan
        and returns its argmax ids."""
        want: list[tuple[int, int]] = []
        for i, (seq, limit) in enumerate(zip(seqs, limits)):
            k = min(budget, limit, self.room(seq))
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
        """Give each sequence of the decode batch ``seqs`` its proposal, as long as the policy finds
        it worth it (:meth:`SpecPolicy.threshold`, :meth:`SpecPolicy.length`) and the step's token
        budget (``scheduler.max_num_batched_tokens``) and free blocks allow
        (``scheduler.reserve_proposal``). ``run``: broadcasts a draft plan and returns its argmax ids
        (a draft model). True if any got one."""
        rho = self.policy.threshold(len(seqs)) if seqs else None
        if rho is None:
            return False
        limits = [self.limit(seq, rho) for seq in seqs]
        budget, any_ = scheduler.max_num_batched_tokens - len(seqs), False
        if self.uses_draft_model:
            for i, proposal in self.draft(seqs, limits, budget, scheduler, run, step).items():
                any_ |= scheduler.reserve_proposal(seqs[i], proposal)  # blocks reserved: never fails
            return any_
        for seq, limit in zip(seqs, limits):
            if budget <= 0:
                break
            proposal = self.propose(seq, min(budget, limit))
            if proposal and scheduler.reserve_proposal(seq, proposal):
                budget -= len(proposal)
                any_ = True
        return any_

    @staticmethod
    def count_proposed(seqs: list[Sequence]) -> int:
        """Count this step's proposals in their samples' ``spec.proposed`` (before any token goes out:
        a request that finishes in this step reports them). Returns the step's proposed tokens."""
        total = 0
        for s in seqs:
            if s.proposal:
                s.spec.proposed += len(s.proposal)
                total += len(s.proposal)
        return total

    def verify(self, seqs: list[Sequence], tokens: list[int], take: Callable[[list[int], int], list[int]],
               trim: Callable[[Sequence], None]) -> int:
        """Verify the proposals of the scheduled ``seqs``, whose last-token position took ``tokens``
        (row i for ``seqs[i]``): for j = 1, 2, ..., the sequences whose position j - 1 took the proposed
        token (and that have not finished) take position j through ``take(live, j)`` (indices into
        ``seqs`` -> their tokens). Then each sequence's counters are added, its draft K/V is kept only
        for accepted tokens, its proposal is cleared and, unless finished, the blocks of its rejected
        positions go back (``trim``), and the policy judges its proposal (:meth:`SpecPolicy.judge`).
        Returns the tokens taken here (beyond ``tokens``)."""
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
        rho = self.policy.token_cost(len(seqs)) or 0.0
        for i, m in accepted.items():
            seq = seqs[i]
            self.stats.add(len(seq.proposal), m)
            self.policy.judge(seq.spec, len(seq.proposal), m, rho)
            # the draft's K/V stays valid for the accepted tokens it was fed
            seq.spec.num_draft_cached_tokens = min(seq.spec.num_draft_cached_tokens, seq.num_cached_tokens)
            seq.proposal = []
            if not seq.is_finished:  # the blocks of the rejected positions go back
                trim(seq)
        return emitted
