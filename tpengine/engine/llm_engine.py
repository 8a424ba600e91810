"""LLMEngine: SPMD inference over tensor-parallel ranks (design after nano-vllm / vLLM).

Every rank constructs the engine and calls :meth:`LLMEngine.generate`. Rank 0 (the driver)
owns requests, tokenizer, scheduler, sampler and detokenizer; each step it broadcasts a
StepPlan, every rank executes it, and rank 0 samples from the gathered logits. Other ranks
follow the broadcasts until STOP.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import replace
from pathlib import Path

import torch

from tpengine import forensics
from tpengine.config import EngineConfig
from tpengine.distributed import TPInfo, init_distributed
from tpengine.engine.logprobs import add_sample_logprobs, collect_prompt_logprobs
from tpengine.engine.model_runner import ModelRunner
from tpengine.engine.output_processor import OutputProcessor, failed_output
from tpengine.engine.outputs import EngineOutput
from tpengine.engine.process import setup_process
from tpengine.engine.sampler import Sampler
from tpengine.engine.scheduler import Scheduler
from tpengine.engine.sequence import Sequence
from tpengine.engine.spec_decode import SpecDecoder
from tpengine.engine.stats import EngineStats
from tpengine.engine.step import StepKind, StepPlan, broadcast_plan, build_plan
from tpengine.errors import UserError
from tpengine.model.spec import ModelSpec
from tpengine.model.surgery import check_model_limits
from tpengine.sampling_params import SEED_END, SamplingParams


def eos_token_ids(model_dir: str, tokenizer) -> set[int]:
    """Union of the tokenizer's EOS, ``generation_config.json``'s ``eos_token_id`` (int or list)
    and ``config.json``'s (case C12: Llama-3-style instruct models end turns with a second id).

    Raises:
        tpengine.errors.UserError: an ``eos_token_id`` that is not a token id >= 0 or a list of them.
    """
    tok = getattr(tokenizer, "eos_token_id", None)
    ids: set[int] = {tok} if isinstance(tok, int) else set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.is_file() or (v := json.loads(path.read_text()).get("eos_token_id")) is None:
            continue
        vals = [v] if isinstance(v, int) else v if isinstance(v, list) else None
        if vals is None or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in vals):
            raise UserError(f"{path}: invalid eos_token_id={json.dumps(v)}: must be a token id >= 0 or a list of them")
        ids.update(vals)
    return ids


def _holds(ids: list[int], part: tuple[int, ...]) -> bool:
    """Whether ``part`` occurs in ``ids`` as a contiguous run."""
    n = len(part)
    return any(tuple(ids[i:i + n]) == part for i in range(len(ids) - n + 1))


def run_requests(engine, requests: Iterable[tuple[str, list[int], SamplingParams]], lookahead: int,
                 on_output: Callable[[EngineOutput], None] | None,
                 on_step: Callable[[EngineStats], None] | None) -> list[EngineOutput]:
    """The driver's loop of ``generate`` for ``engine`` (an :class:`LLMEngine`, or a
    :class:`tpengine.engine.data_parallel.DataParallelEngine`: the same driver interface): take
    ``requests`` lazily while fewer than ``lookahead`` wait (``engine.num_waiting()``), step until nothing
    is unfinished, hand each output to ``on_output`` (or return them all) and the stats after each step
    to ``on_step``, then stop the workers."""
    source = iter(requests)
    outputs: list[EngineOutput] = []
    while True:
        while source is not None and engine.num_waiting() < lookahead:
            item = next(source, None)
            if item is None:
                source = None
                break
            engine.add_request(*item)
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if on_output:
                on_output(out)
            else:
                outputs.append(out)
        if on_step:
            on_step(engine.stats())
    engine.stop_workers()
    return outputs


class LLMEngine:
    """The engine on one rank.

    Args:
        config: engine settings; ``config.model`` is a full HF folder or a shard folder.
        tokenizer: optional tokenizer for rank 0 (default: loaded from ``config.model``).

    A step whose sequences are all greedy without anything else on their logits (no
    ``params.needs_logits``, no prompt logprobs rows) takes the argmax on each rank's vocabulary shard
    (no logits gathered, no Sampler call); other steps gather the logits to rank 0 and sample there.

    The model folder is read once (:class:`tpengine.model.spec.ModelSpec`): its config before the
    process groups start (the ``max_model_len`` default and ``check_model_limits`` need it), its
    ``ShardPlan`` (or a shard folder's manifest check) once the tp size is known; the process
    set-up and the :class:`ModelRunner` (the loader) take that spec (``self.spec``).

    Raises:
        tpengine.model.shard_folder.CheckpointMismatchError, FileNotFoundError: bad model folder.
        tpengine.errors.UserError: not a model folder (no folder, no or a broken ``config.json``),
            ``max_model_len`` beyond the model's limit, or a model feature tpengine does not support
            (from ``check_model_limits``), a tp size the model cannot split over.
    """

    def __init__(self, config: EngineConfig, tokenizer=None):
        started = time.perf_counter()
        hf_config = ModelSpec.read_config(config.model)  # UserError: not a model folder
        if config.max_model_len is None:  # as vLLM: the model's own context length
            try:
                config = config.replace(max_model_len=int(getattr(hf_config, "max_position_embeddings", 2048)))
            except ValueError as e:  # a setting that does not fit the model's length: the user's to fix
                raise UserError(f"{e} (max_model_len taken from the model's max_position_embeddings; "
                                "pass --max-model-len to choose it)") from None
        check_model_limits(hf_config, config.max_model_len)  # UserError: settings this model cannot honour
        self.config = config
        self.tp: TPInfo = init_distributed(config.dist_timeout_s, tp_size=config.tensor_parallel_size,
                                           dp_size=config.data_parallel_size)
        forensics.configure(self.tp.global_rank, self.tp.world_size, config.dist_timeout_s)  # kill -USR1: a report
        # the model this launch runs, read once: a shard folder checked against the launch, or the plan built
        self.spec = ModelSpec.from_config(config.model, hf_config, self.tp)
        setup_process(config, self.tp, self.spec.shard_plan)
        self.runner = ModelRunner(config, self.tp, self.spec)
        self.draft_runner = self._draft_runner(config)  # speculative decoding's draft model, on every rank
        if not self.is_driver:
            return
        from transformers import AutoTokenizer

        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(config.model)
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        self.scheduler = Scheduler(config, self.runner.num_blocks, self.eos_token_ids)
        self.sampler = Sampler(config.seed, self.eos_token_ids)
        self._next_id = 0
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler.is_stop_token)
        # a thinking model's end-of-thought ids: its structured outputs start after them
        self._reasoning_end = tuple(self.tokenizer.encode("</think>", add_special_tokens=False)) \
            if config.reasoning_parser else None
        self._pending: list[EngineOutput] = []
        self._structured = None  # the StructuredOutputManager, made by the first constrained request
        self._structured_lock = threading.Lock()
        self._compiling: list[tuple[Sequence, Future]] = []  # constrained requests waiting for their grammar
        self._spec = None if config.speculative_config is None else \
            SpecDecoder(config.speculative_config, config.max_model_len, config.block_size)
        self._steps = self._prefill_steps = self._computed_tokens = self._output_tokens = 0
        print(self.runner.ready_line(time.perf_counter() - started), file=sys.stderr, flush=True)

    def _draft_runner(self, config: EngineConfig) -> ModelRunner | None:
        """The draft model's runner (``speculative_config`` method ``draft_model``): this rank's shard
        of it, with a KV cache of the target's block count (block tables address both). None without one.

        Raises:
            tpengine.errors.UserError: not a model folder, a vocabulary other than the target's (naming
                both sizes), or a model that cannot split over this tp size or hold ``max_model_len``.
        """
        sc = config.speculative_config
        if sc is None or sc.method != "draft_model":
            return None
        hf = ModelSpec.read_config(sc.model)
        draft_spec = ModelSpec.from_config(sc.model, hf, self.tp)
        mine, theirs = self.spec.shard_plan.vocab_size, draft_spec.shard_plan.vocab_size
        if mine != theirs:
            raise UserError(f"speculative_config model {sc.model}: its vocabulary has {theirs} tokens, the "
                            f"model's {mine}; a draft model must share the model's vocabulary")
        check_model_limits(hf, config.max_model_len)
        draft = config.replace(model=sc.model, num_kv_blocks=self.runner.num_blocks, speculative_config=None)
        return ModelRunner(draft, self.tp, draft_spec)

    def _run_draft(self, plan: StepPlan) -> list[int]:
        """Rank 0: broadcast a draft-model plan, run it, return its argmax ids."""
        return self.draft_runner.execute(broadcast_plan(plan)).tolist()

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (ids ``>= vocab_size`` are invalid)."""
        return self.runner.shard_plan.vocab_size

    @property
    def is_driver(self) -> bool:
        return self.tp.is_driver

    # ------------------------------------------------------------------ driver API
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    stream: bool = False) -> None:
        """Queue a request (rank 0). One that cannot run (too long for max_model_len or the
        KV cache, empty, ids outside the vocabulary, an id already running) becomes an error output
        of the next step, and so does any other exception its content raises here: no request ends
        the engine. ``stream``: :meth:`step` also returns this request's output so far (``finished``
        False) after every step that gives it a token. ``params.max_tokens`` 0 (score the prompt):
        the prompt runs through prefill and one greedy token, which the output leaves out."""
        vocab = self.vocab_size
        try:
            bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
            asked = params
            if params.prompt_only:  # one greedy token through the prefill, dropped from the output
                params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=params.prompt_logprobs)
            seq = Sequence(self._next_id, request_id, list(prompt_token_ids), params, arrival_time=time.monotonic())
            self._next_id += 1
            if self._spec is not None:
                seq.spec_draft_tokens = seq.spec_accepted_tokens = 0
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
            for name, ids in (("stop_token_ids", asked.stop_token_ids), ("logit_bias", asked.logit_bias or ())):
                if bad := [t for t in ids if t >= vocab]:
                    self._pending.append(EngineOutput(request_id, list(prompt_token_ids), error=(
                        f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})"), error_field=name))
                    return
            self.outputs.add(seq, stream, asked)
            if params.structured_outputs is not None:  # scheduled once its grammar is compiled (_admit)
                self._compiling.append((seq, self.structured.compile(params.structured_outputs)))
                return
            try:
                self.scheduler.add(seq)
            except BaseException:
                self.outputs.drop(seq.request_id)
                raise
        except ValueError as e:
            field = "n" if str(e).startswith(f"request {request_id!r}: n=") else "prompt"
            self._pending.append(EngineOutput(request_id, list(prompt_token_ids), error=str(e), error_field=field))
        except Exception as e:  # noqa: BLE001 -- one request's failure is its own error output
            self._pending.append(failed_output(request_id, list(prompt_token_ids), "scheduling", e))

    @property
    def structured(self):
        """Rank 0's :class:`tpengine.structured.StructuredOutputManager` (made on first use: the
        grammar libraries read the tokenizer's vocabulary then)."""
        with self._structured_lock:  # the server's request threads ask for it too
            if self._structured is None:
                from tpengine.structured import StructuredOutputManager

                self._structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                           self.config.structured_outputs_backend)
            return self._structured

    def _admit(self) -> None:
        """Schedule the constrained requests whose grammar is compiled; one whose grammar failed
        becomes its error output (``error_field`` "structured_outputs"), an aborted one is dropped.
        When nothing else can run, wait (at most 50 ms) for a compile to finish, so a loop calling
        :meth:`step` does not spin."""
        if not self._compiling:
            return
        if not self.scheduler.has_unfinished and not self._pending:
            wait_futures([f for _, f in self._compiling], timeout=0.05, return_when=FIRST_COMPLETED)
        still = []
        for seq, fut in self._compiling:
            if seq.is_finished:  # aborted while compiling; its output was given then
                continue
            if not fut.done():
                still.append((seq, fut))
                continue
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            try:
                seq.grammar = fut.result()
                seq.matcher = seq.grammar.matcher()
                if self._reasoning_end and not _holds(prompt, self._reasoning_end):  # still to think
                    seq.reasoning_end = self._reasoning_end
                self.scheduler.add(seq)
            except ValueError as e:  # GrammarError, or a prompt the scheduler refuses
                self.outputs.drop(seq.request_id)
                field = "prompt" if seq.grammar is not None else "structured_outputs"
                self._pending.append(EngineOutput(seq.request_id, prompt, error=str(e), error_field=field))
            except Exception as e:  # noqa: BLE001 -- one request's failure is its own error output
                self.outputs.drop(seq.request_id)
                self._pending.append(failed_output(seq.request_id, prompt, "compiling the grammar", e))
        self._compiling = still

    def num_waiting(self) -> int:
        """Rank 0: requests not yet scheduled (waiting, or outputs not yet handed back)."""
        return len(self.scheduler.waiting) + len(self._pending)

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished or bool(self._compiling)

    def step(self) -> list[EngineOutput]:
        """Rank 0: schedule, broadcast, execute, sample, postprocess one step. Returns the
        requests finished in it (error outputs of rejected requests and aborted requests included),
        then the outputs so far of streaming requests that got a token (``finished`` False)."""
        self._admit()
        done, self._pending = self._pending, []
        if not self.scheduler.has_unfinished:
            return done
        seqs, is_prefill = self.scheduler.schedule()
        started = time.perf_counter()
        speculative = self._propose(seqs, is_prefill)  # some decodes verify proposed tokens too
        plan = build_plan(seqs, is_prefill or speculative, self.config.block_size, self._steps,
                          block_copies=self.scheduler.take_block_copies())
        plan.greedy = not plan.prompt_idx.numel() and not any(s.params.needs_logits for s in seqs)  # on-shard argmax
        sampled = [s.samples for s in seqs]  # False: a prefill chunk, nothing to sample
        # the grammar bitmask of the constrained rows, filled on a worker thread while the forward runs;
        # a greedy step's ranks mask their vocabulary shards with it (broadcast at the LM head), else
        # rank 0 masks the gathered rows
        matchers = [s.matcher if ok and s.reasoning_end is None else None for s, ok in zip(seqs, sampled)]
        masks = self._structured.fill_async(matchers) if any(m is not None for m in matchers) else None
        plan.grammar_mask = plan.greedy and masks is not None
        plan = broadcast_plan(plan)
        out = self.runner.execute(plan, masks.result if plan.grammar_mask else None)
        self._steps += 1
        self._prefill_steps += is_prefill
        self._computed_tokens += int(plan.input_ids.numel())
        batch, rows = self._fork(seqs, sampled)  # + the new samples of n > 1 requests, on their parent's row
        sampled += [True] * (len(batch) - len(seqs))
        emitted = sum(sampled)
        failed: dict[int, tuple[str, Exception]] = {}
        b, p = len(seqs), int(plan.prompt_idx.numel())
        if not plan.greedy:
            self._prompt_logprobs(seqs, out[b:b + p], failed)
        # the output row of scheduled sequence i's position j: a speculative one's first k positions are
        # rows after the sampled and prompt rows (plan.spec_idx), its last one is row i
        first_spec, at = [], b + p
        for s in seqs:
            first_spec.append(at)
            at += len(s.proposal)
            if s.proposal:  # counted before the tokens go out: a request finished now reports them
                s.spec_draft_tokens += len(s.proposal)
        row = lambda i, j: first_spec[i] + j if j < len(seqs[i].proposal) else i  # noqa: E731
        tokens = self._take(out, plan.greedy, batch, [row(r, 0) for r in rows], rows, sampled, failed, masks)
        self._accept(batch, tokens, sampled, failed, done)
        if speculative:  # position j of a sequence, while its position j - 1 took the proposed token
            took = dict(zip(range(b), tokens))
            live = [i for i in range(b) if seqs[i].proposal]
            accepted = dict.fromkeys(live, 0)
            for j in range(1, max(len(seqs[i].proposal) for i in live) + 1):
                live = [i for i in live if j <= len(seqs[i].proposal) and not seqs[i].is_finished
                        and took[i] == seqs[i].proposal[j - 1]]
                if not live:
                    break
                sub, ok, sub_failed = [seqs[i] for i in live], [True] * len(live), {}
                for seq in sub:  # its proposed token j - 1 was taken
                    seq.spec_accepted_tokens += 1
                sub_tokens = self._take(out, plan.greedy, sub, [row(i, j) for i in live], live, ok, sub_failed, None)
                self._accept(sub, sub_tokens, ok, sub_failed, done)
                emitted += len(live)
                for i, tok in zip(live, sub_tokens):
                    took[i], accepted[i] = tok, j
            for i, m in accepted.items():
                self._spec.stats.add(len(seqs[i].proposal), m)
                # the draft's K/V stays valid for the accepted tokens it was fed
                seqs[i].num_draft_cached_tokens = min(seqs[i].num_draft_cached_tokens, seqs[i].num_cached_tokens)
                seqs[i].proposal = []
                if not seqs[i].is_finished:  # the blocks of the rejected positions go back
                    self.scheduler.block_manager.trim(seqs[i])
        self._output_tokens += emitted
        if self._spec is not None and not is_prefill:  # a decode step: how fast each kind emits tokens
            self._spec.policy.record(b, speculative, time.perf_counter() - started, emitted)
        for rid in dict.fromkeys(seq.request_id for seq, ok in zip(batch, sampled) if ok):
            if (partial := self.outputs.stream_output(rid)) is not None:
                done.append(partial)
        return done

    def _propose(self, seqs: list[Sequence], is_prefill: bool) -> bool:
        """With speculative decoding, in a decode step the policy finds worth it: give each sequence
        its proposal (as many as the step's token budget and free blocks allow). True if any got one."""
        if self._spec is None or is_prefill or not seqs or not self._spec.policy.wants(len(seqs)):
            return False
        budget, any_ = self.scheduler.max_num_batched_tokens - len(seqs), False
        if self._spec.uses_draft_model:
            proposals = self._spec.draft(seqs, budget, self.scheduler, self._run_draft, self._steps)
            for i, proposal in proposals.items():
                any_ |= self.scheduler.reserve_proposal(seqs[i], proposal)  # blocks reserved: never fails
            return any_
        for seq in seqs:
            if budget <= 0:
                break
            proposal = self._spec.propose(seq, budget)
            if proposal and self.scheduler.reserve_proposal(seq, proposal):
                budget -= len(proposal)
                any_ = True
        return any_

    def _take(self, out: torch.Tensor, greedy: bool, batch: list[Sequence], out_rows: list[int], rows: list[int],
              sampled: list[bool], failed: dict[int, tuple[str, Exception]], masks) -> list[int]:
        """One token per ``batch`` sequence from the step's result ``out``: its row ``out_rows[i]``'s
        argmax id (a greedy step) or a sample from that row's logits, masked first by the grammar
        ``masks`` (rows by scheduled sequence, ``rows[i]``)."""
        if greedy:
            ids = out.tolist()
            return [ids[r] for r in out_rows]
        if out_rows == list(range(len(out_rows))):
            logits = out[:len(out_rows)]
        else:
            logits = out.index_select(0, torch.tensor(out_rows, device=out.device))
        if masks is not None:  # the gathered rows, masked on rank 0
            logits = self._mask(logits, masks.result(), batch, rows, sampled, failed)
        return self._sample(logits, batch, sampled, failed)

    def _accept(self, batch: list[Sequence], tokens: list[int], sampled: list[bool],
                failed: dict[int, tuple[str, Exception]], done: list[EngineOutput]) -> None:
        """Take one token per ``batch`` sequence (``sampled`` False: a prefill chunk, none): the grammar
        advances, the text grows and is checked for stop strings, the failed requests end with their
        error output, and the scheduler appends the tokens and finishes what stops (outputs into
        ``done``)."""
        stopped = []
        for i, (seq, tok, ok) in enumerate(zip(batch, tokens, sampled)):
            if ok and i not in failed and seq.matcher is not None:
                if seq.reasoning_end is not None:  # thinking: unconstrained until the thought ends
                    end = seq.reasoning_end
                    if (seq.token_ids[len(seq.token_ids) - len(end) + 1:] + [tok])[-len(end):] == list(end):
                        seq.reasoning_end = None
                elif not seq.matcher.accept(tok):
                    failed[i] = ("structured output", RuntimeError(f"the grammar does not allow the sampled token "
                                                                   f"{tok}"))
            try:
                # the grammar is complete: the sample ends
                ended = seq.matcher is not None and seq.reasoning_end is None and seq.matcher.is_terminated
                stopped.append(i not in failed and ok and (self.outputs.detokenize(seq, tok) or ended))
            except Exception as e:  # noqa: BLE001 -- this request's own failure
                failed[i] = ("detokenizing", e)
                stopped.append(False)
        for i, (stage, e) in sorted(failed.items()):
            if not batch[i].is_finished:  # one error output per request, whichever sample failed
                done.append(self._fail(batch[i], stage, e))  # finished now: postprocess skips it
        for seq in self.scheduler.postprocess(batch, tokens, stopped):
            try:
                if (final := self.outputs.finish_sample(seq)) is not None:
                    done.append(final)
            except Exception as e:  # noqa: BLE001
                done.append(self._fail(seq, "detokenizing", e))

    def _fork(self, seqs: list[Sequence], sampled: list[bool]) -> tuple[list[Sequence], list[int]]:
        """Start samples 1..n-1 of every ``n > 1`` request whose first token this step samples (they
        share its KV blocks: the prompt is computed once). Returns ``(batch, rows)``: ``seqs`` then
        the new samples, and the logits row of each (a new sample draws from its parent's row)."""
        batch, rows = list(seqs), list(range(len(seqs)))
        for i, (seq, ok) in enumerate(zip(seqs, sampled)):
            if ok and seq.params.n > 1 and self.scheduler.room(seq) > 1:
                children = [self._new_sample(seq, k) for k in range(1, seq.params.n)]
                self.scheduler.fork(seq, children)
                for child in children:
                    self.outputs.add_sample(child)
                batch += children
                rows += [i] * len(children)
        return batch, rows

    def _mask(self, logits: torch.Tensor, masks: torch.Tensor, batch: list[Sequence], rows: list[int],
              sampled: list[bool], failed: dict[int, tuple[str, Exception]]) -> torch.Tensor:
        """``logits`` with the grammar bitmask ``masks`` (int32 ``[len(seqs), words]``, row per scheduled
        sequence) applied to ``logits [len(batch), V]`` (a new tensor when a row changes), whose row i
        is ``batch[i]``'s, from the scheduled sequence ``rows[i]`` (a new sample of an n > 1 request
        starts where its parent is, so it takes its parent's mask). Only the sampled rows of
        constrained sequences change; a failure fails those rows' requests."""
        hit = [i for i, seq in enumerate(batch) if sampled[i] and seq.matcher is not None]
        if not hit:
            return logits
        try:
            idx = torch.tensor(hit, device=logits.device)
            sub = logits.index_select(0, idx)
            self._structured.apply(sub, masks[[rows[i] for i in hit]])
            return logits.index_copy(0, idx, sub)
        except Exception as e:  # noqa: BLE001 -- the constrained requests' own failure
            failed.update({i: ("structured output", e) for i in hit})
            return logits

    def _new_sample(self, parent: Sequence, k: int) -> Sequence:
        """Sample ``k`` of ``parent``'s request: its prompt, its params with seed ``seed + k``
        (wrapping at 2**64, as vLLM's parallel sampling seeds its children) and no prompt logprobs
        (sample 0 collects them)."""
        p = parent.params
        seed = None if p.seed is None else p.seed + k - (SEED_END if p.seed + k >= SEED_END else 0)
        child = Sequence(self._next_id, parent.request_id, parent.prompt_token_ids,
                         replace(p, seed=seed, prompt_logprobs=None), arrival_time=parent.arrival_time)
        self._next_id += 1
        child.index = k
        if parent.spec_draft_tokens is not None:  # speculative decoding: its own counts, from 0
            child.spec_draft_tokens = child.spec_accepted_tokens = 0
        if parent.grammar is not None:  # its own matcher, at the grammar's start (no token sampled yet)
            child.grammar, child.matcher = parent.grammar, parent.grammar.matcher()
            child.reasoning_end = parent.reasoning_end
        return child

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], sampled: list[bool],
                failed: dict[int, tuple[str, Exception]]) -> list[int]:
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

    def _prompt_logprobs(self, seqs: list[Sequence], rows: torch.Tensor,
                         failed: dict[int, tuple[str, Exception]]) -> None:
        """:func:`collect_prompt_logprobs` of this step's prompt rows; a failure is the requests' own
        (every sequence with rows enters ``failed`` as ("prompt logprobs", exception))."""
        try:
            collect_prompt_logprobs(seqs, rows, self.vocab_size)
        except Exception as e:  # noqa: BLE001
            failed.update({i: ("prompt logprobs", e) for i, s in enumerate(seqs) if s.prompt_logprobs is not None})

    def _fail(self, seq: Sequence, stage: str, exc: Exception) -> EngineOutput:
        """End ``seq``'s request (every sample's blocks freed) with the error output of ``exc`` raised
        while ``stage``."""
        for s in self.outputs.sequences(seq.request_id) or [seq]:
            self.scheduler.finish(s, "abort")
        self.outputs.drop(seq.request_id)
        return failed_output(seq.request_id, seq.token_ids[: seq.num_prompt_tokens], stage, exc)

    def abort_request(self, request_id: str) -> bool:
        """Rank 0: end a live request now (a client went away); its KV blocks are freed at once and
        its final output (every sample's ``finish_reason`` "abort" unless it had finished) comes
        with the next :meth:`step`. Returns False when no such request is live."""
        seqs = self.outputs.sequences(request_id)
        if not seqs:
            return False
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self._pending.append(self.outputs.output(request_id))
        return True

    def heartbeat(self) -> None:
        """Rank 0, while there is nothing to run: broadcast an IDLE plan, so the other ranks' wait
        for the next plan never reaches ``dist_timeout_s`` and a dead rank is noticed (the broadcast
        raises within ``dist_timeout_s``)."""
        broadcast_plan(StepPlan(kind=StepKind.IDLE, step=self._steps))

    def stop_workers(self) -> None:
        """Rank 0: broadcast STOP, so the other ranks of this TP group leave :meth:`generate`."""
        broadcast_plan(StepPlan(kind=StepKind.STOP, step=self._steps))

    def reset_prefix_cache(self) -> int:
        """Rank 0: forget every cached prefix, so later requests compute their prompts again (as
        vLLM's ``LLM.reset_prefix_cache``; e.g. between benchmark rounds). Returns the number of
        cached blocks dropped; other ranks hold no prefix cache and return 0."""
        return self.scheduler.block_manager.reset_prefix_cache() if self.is_driver else 0

    def stats(self) -> EngineStats:
        """Counters and queue state (rank 0)."""
        s = self.scheduler.stats()
        return EngineStats(self._steps, self._prefill_steps, self._steps - self._prefill_steps,
                           s.prompt_tokens, self._output_tokens, s.num_preemptions, s.num_free_blocks,
                           s.num_total_blocks, s.num_running, s.num_waiting, s.cached_prompt_tokens,
                           self._computed_tokens, s.num_cached_blocks, *self._spec_counters())

    def replica_stats(self) -> list[EngineStats]:
        """The stats of each data-parallel replica: this engine's alone (rank 0)."""
        return [self.stats()]

    def _spec_counters(self) -> tuple:
        """EngineStats' speculative fields: (on, drafts, draft tokens, accepted tokens, accepted per position)."""
        if self._spec is None:
            return (False, 0, 0, 0, ())
        st = self._spec.stats
        return (True, st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, tuple(st.accepted_per_pos))

    # ------------------------------------------------------------------ SPMD API
    def generate(self, requests: Iterable[tuple[str, list[int], SamplingParams]],
                 on_output: Callable[[EngineOutput], None] | None = None,
                 on_step: Callable[[EngineStats], None] | None = None) -> list[EngineOutput]:
        """Run ``requests`` to completion; every rank calls this. Other ranks ignore ``requests``,
        follow rank 0's broadcasts until STOP and return [].

        Rank 0 takes requests from the iterable lazily, as the waiting queue drains (at most
        ``2 * max_num_seqs`` waiting), so a generator of any length is never held at once. Without
        ``on_output`` it returns every output in finishing order; with it, each output is handed to
        ``on_output`` as it finishes and not kept (returns []). ``on_step`` gets the stats after each
        step. Then it broadcasts STOP."""
        if not self.is_driver:
            self._follow()
            return []
        return run_requests(self, requests, 2 * self.config.max_num_seqs, on_output, on_step)

    def _follow(self) -> None:
        while True:
            plan = broadcast_plan(None)
            if plan.kind == StepKind.STOP:
                return
            if plan.kind != StepKind.IDLE:
                (self.draft_runner if plan.draft else self.runner).execute(plan)

    def shutdown(self) -> None:
        """Tear down the process groups (after :meth:`generate` returned on every rank)."""
        from tpengine.distributed import shutdown

        shutdown()
