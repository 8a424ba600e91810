"""The engine's structured outputs (tpengine/engine/structured_output.py) on fakes: grammar admission
and its error outputs, the step's bitmask rows, masking with a new sample on its parent's row, and the
matcher's advance through a thought. The grammar libraries themselves: tests/test_structured.py."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from tpengine.engine.sequence import Sequence
from tpengine.engine.structured_output import StructuredOutputs, StructuredState
from tpengine.engine.thoughts import ThoughtTags
from tpengine.sampling_params import SamplingParams
from tpengine.structured.bitmask import apply_bitmask


class Matcher:
    """Allows the token ids in ``allowed``; ends after ``length`` accepted tokens."""

    def __init__(self, allowed: set[int], length: int = 2):
        self.allowed, self.length, self.taken = allowed, length, []

    def accept(self, tok: int) -> bool:
        if tok not in self.allowed:
            return False
        self.taken.append(tok)
        return True

    @property
    def is_terminated(self) -> bool:
        return len(self.taken) >= self.length

    def fill(self, mask: torch.Tensor, row: int) -> None:
        mask[row] = 0
        for t in self.allowed:
            mask[row, t // 32] |= 1 << (t % 32)


class Grammar:
    def __init__(self, allowed=frozenset({3, 4})):
        self.allowed = set(allowed)

    def matcher(self) -> Matcher:
        return Matcher(self.allowed)


class Manager:
    """The manager's interface the engine uses, synchronous."""

    def __init__(self, vocab: int = 8):
        self.words = (vocab + 31) // 32

    def compile(self, p) -> Future:
        return done(Grammar())

    def fill_async(self, matchers) -> Future:
        mask = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        for i, m in enumerate(matchers):
            if m is not None:
                m.fill(mask, i)
        return done(mask)

    @staticmethod
    def apply(logits, mask):
        apply_bitmask(logits, mask)


def done(value=None, error: Exception | None = None) -> Future:
    f = Future()
    if error is None:
        f.set_result(value)
    else:
        f.set_exception(error)
    return f


def seq(sid: int, prompt=(1, 2, 3), thinking: bool = False) -> Sequence:
    return Sequence(sid, f"r{sid}", list(prompt), SamplingParams(thinking=thinking))


def test_admission_schedules_compiled_grammars_and_turns_failures_into_outputs():
    so = StructuredOutputs(Manager, ThoughtTags(start_id=6, end_id=8))
    ok, thought, bad, refused, broken, slow, aborted = (seq(i, thinking=i == 0) for i in range(7))
    aborted.status = aborted.status.FINISHED
    so.compiling = [(ok, done(Grammar())), (thought, done(Grammar())), (bad, done(error=ValueError("bad schema"))),
                    (refused, done(Grammar())), (broken, done(error=KeyError("lib"))), (slow, Future()),
                    (aborted, done(Grammar()))]
    added, dropped = [], []

    def add(s):
        if s is refused:
            raise ValueError("prompt too long")
        added.append(s.request_id)

    errors = so.admit(add, dropped.append, idle=False)
    assert added == ["r0", "r1"] and dropped == ["r2", "r3", "r4"]
    assert [(e.request_id, e.error, e.error_field) for e in errors[:2]] == [
        ("r2", "bad schema", "structured_outputs"), ("r3", "prompt too long", "prompt")]
    assert errors[2].request_id == "r4" and errors[2].error == "compiling the grammar failed: KeyError: 'lib'"
    assert so.compiling == [(slow, so.compiling[0][1])]  # still compiling; the aborted one is forgotten
    # the front end's decision: r0 starts inside its thought; r1 (a completion, or a closed thought) does not
    assert ok.structured.reasoning_end == 8 and thought.structured.reasoning_end is None
    assert so.admit(add, dropped.append, idle=True) == [] and len(so.compiling) == 1  # waits 50 ms, no more


def test_advance_waits_for_the_thought_then_follows_the_grammar():
    s = seq(0)
    s.structured = StructuredState(Grammar(), Matcher({3, 4}), reasoning_end=8)
    assert StructuredOutputs.advance(s, 5) is None and s.structured.reasoning_end == 8  # thinking: free
    assert StructuredOutputs.advance(s, 8) is None and s.structured.reasoning_end is None  # the end token ends it
    assert not StructuredOutputs.is_complete(s)
    assert str(StructuredOutputs.advance(s, 5)) == "the grammar does not allow the sampled token 5"
    assert StructuredOutputs.advance(s, 3) is None and StructuredOutputs.advance(s, 4) is None
    assert StructuredOutputs.is_complete(s) and s.structured.matcher.taken == [3, 4]
    assert not StructuredOutputs.is_complete(seq(1))  # no grammar


def test_masks_cover_the_sampled_constrained_rows_and_a_new_sample_takes_its_parents_row():
    so = StructuredOutputs(Manager)
    a, free, chunk, thinking = seq(0), seq(1), seq(2), seq(3)
    a.structured = StructuredState(Grammar(), Matcher({3}))
    chunk.structured = StructuredState(Grammar(), Matcher({4}))
    thinking.structured = StructuredState(Grammar(), Matcher({4}), reasoning_end=7)
    assert so.masks([free], [True]) is None
    masks = so.masks([a, free, chunk, thinking], [True, True, False, True]).result()
    assert masks.tolist() == [[1 << 3], [-1], [-1], [-1]]  # only a's row constrains
    child = seq(4)
    child.structured = a.structured.fork()
    assert child.structured.matcher is not a.structured.matcher and child.structured.matcher.taken == []
    batch, rows = [a, free, chunk, thinking, child], [0, 1, 2, 3, 0]
    logits, failed = torch.zeros(5, 8), {}
    out = so.apply(logits, masks, batch, rows, [True, True, False, True, True], failed)
    assert failed == {} and torch.equal(logits, torch.zeros(5, 8))  # a new tensor, the input unchanged
    allowed = [(out[i] > float("-inf")).nonzero().flatten().tolist() for i in range(5)]
    assert allowed == [[3], list(range(8)), list(range(8)), list(range(8)), [3]]


def test_a_failing_mask_fails_the_constrained_rows_only():
    class Broken(Manager):
        @staticmethod
        def apply(logits, mask):
            raise RuntimeError("bitmask width")

    so = StructuredOutputs(Broken)
    a, free = seq(0), seq(1)
    a.structured = StructuredState(Grammar(), Matcher({3}))
    logits, failed = torch.zeros(2, 8), {}
    assert so.apply(logits, torch.zeros(2, 1, dtype=torch.int32), [a, free], [0, 1], [True, True], failed) is logits
    assert list(failed) == [0] and failed[0][0] == "structured output" and str(failed[0][1]) == "bitmask width"


def test_manager_is_made_once_on_first_use():
    made = []
    so = StructuredOutputs(lambda: made.append(1) or Manager())
    assert made == []
    assert so.manager is so.manager and made == [1]
