"""LLMEngine: SPMD inference over tensor-parallel ranks (design after nano-vllm / vLLM).

Every rank constructs the engine and calls :meth:`LLMEngine.generate`. Rank 0 (the driver)
owns requests, tokenizer, scheduler, sampler and detokenizer; each step it broadcasts a
StepPlan, every rank executes it, and rank 0 samples from the gathered logits. Other ranks
follow the broadcasts until STOP.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from tpengine import forensics
from tpengine.config import EngineConfig
from tpengine.distributed import TPInfo, init_distributed
from tpengine.engine.model_runner import ModelRunner
from tpengine.engine.output_processor import OutputProcessor, failed_output
from tpengine.engine.outputs import EngineOutput
from tpengine.engine.parallel_sampling import SampleForker
from tpengine.engine.pooling import PoolingRequests, add_pooling_request
from tpengine.engine.process import setup_process
from tpengine.engine.row_sampler import RowSampler
from tpengine.engine.sampler import Sampler
from tpengine.engine.scheduler import Scheduler
from tpengine.engine.sequence import Sequence
from tpengine.engine.spec_decode import SpecDecoder, SpecState
from tpengine.engine.stats import EngineStats
from tpengine.engine.step import PlanBuilder, StepKind, StepPlan, broadcast_plan
from tpengine.engine.structured_output import StructuredOutputs
from tpengine.engine.thoughts import thought_tags
from tpengine.engine.update import ScheduledStep, StepUpdater
from tpengine.errors import UserError
from tpengine.model.spec import ModelSpec
from tpengine.model.surgery import check_model_limits
from tpengine.pooling_params import PoolingParams
from tpengine.sampling_params import SamplingParams
from tpengine.startup import collector_paused


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

    A step is schedule -> execute -> update (vLLM's ``EngineCore.step``): rank 0 schedules
    (:class:`Scheduler`; speculative proposals, :class:`SpecDecoder`; the grammar bitmask,
    :class:`StructuredOutputs`) and broadcasts the plan, every rank executes it (:class:`ModelRunner`),
    and rank 0 updates from the output (:class:`StepUpdater`: tokens, n > 1 forks, verification,
    logprobs, stops, outputs). A step whose sequences are all greedy without anything else on their
    logits (no ``params.needs_logits``, no prompt logprobs rows) takes the argmax on each rank's
    vocabulary shard (no logits gathered, no Sampler call); other steps gather the logits to rank 0
    and sample there.

    A pooling engine (``config.runner`` "pooling", :mod:`tpengine.engine.pooling`) takes
    :class:`PoolingParams` requests instead: each is a prefill only (chunked as any prompt), the
    steps skip the LM head and rank 0 pools the final hidden states into each request's
    ``EngineOutput.embedding``; the request ends, its blocks freed, in the step that computes its last
    prompt token.

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
        with collector_paused():  # the set-up makes the process's long-lived objects (tpengine/startup.py)
            self._set_up(config, tokenizer)

    def _set_up(self, config: EngineConfig, tokenizer) -> None:
        """Read the model folder, start the process groups, load this rank's slice and, on rank 0,
        the tokenizer and the scheduler (the constructor's work; its errors are the constructor's)."""
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
                                           dp_size=config.data_parallel_size, pp_size=config.pipeline_parallel_size)
        forensics.configure(self.tp.global_rank, self.tp.world_size, config.dist_timeout_s)  # kill -USR1: a report
        # the model this launch runs, read once: a shard folder checked against the launch, or the plan built
        self.spec = ModelSpec.from_config(config.model, hf_config, self.tp, config.enable_expert_parallel,
                                          config.layer_counts)
        setup_process(config, self.tp, self.spec.shard_plan)
        self.runner = ModelRunner(config, self.tp, self.spec)
        self.draft_runner = draft_runner(config, self.tp, self.spec, self.runner.num_blocks)  # on every rank
        if self.is_driver:
            self._driver_init(tokenizer)
            print(self.runner.ready_line(time.perf_counter() - started), file=sys.stderr, flush=True)

    def _driver_init(self, tokenizer) -> None:
        """Rank 0's parts: tokenizer, scheduler, sampler, outputs and the step's collaborators."""
        from transformers import AutoTokenizer

        config = self.config
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(config.model)
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        self.scheduler = driver_scheduler(config, self.runner, self.draft_runner is not None, self.eos_token_ids)
        self._pooling = PoolingRequests.for_model(config.pooler, self.runner.hf_config,
                                                  self.runner.shard_plan.hidden_size) if config.pooling else None
        self.sampler = Sampler(config.seed, self.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler.is_stop_token)
        # a thinking model's tag ids (--reasoning-parser; a tokenizer without them is refused): a chat
        # request that starts inside its thought (params.thinking) is constrained after its </think> token
        self.structured_outputs = StructuredOutputs(self._grammar_manager,
                                                    thought_tags(config.reasoning_parser, self.tokenizer))
        self._spec = None if config.speculative_config is None else \
            SpecDecoder(config.speculative_config, config.max_model_len, config.block_size)
        self._ids = itertools.count()  # engine-unique sequence ids
        self._updater = StepUpdater(self.scheduler, self.outputs,
                                    RowSampler(self.sampler, self.vocab_size, self.structured_outputs),
                                    SampleForker(self.scheduler, self.outputs, lambda: next(self._ids)), self._spec)
        self._plans = PlanBuilder(config.block_size)  # each step's plan, in tensors reused while its shape repeats
        self._pending: list[EngineOutput] = []
        self._steps = self._prefill_steps = self._computed_tokens = self._output_tokens = 0

    def _grammar_manager(self):
        """A new :class:`tpengine.structured.StructuredOutputManager` over this engine's tokenizer."""
        from tpengine.structured import StructuredOutputManager

        return StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                       self.config.structured_outputs_backend)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (ids ``>= vocab_size`` are invalid)."""
        return self.runner.shard_plan.vocab_size

    @property
    def is_driver(self) -> bool:
        """Whether this rank is its TP group's rank 0 (owns requests, scheduler and sampler)."""
        return self.tp.is_driver

    @property
    def structured(self):
        """Rank 0's :class:`tpengine.structured.StructuredOutputManager` (made on first use: the
        grammar libraries read the tokenizer's vocabulary then)."""
        return self.structured_outputs.manager

    # ------------------------------------------------------------------ driver API
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                    stream: bool = False) -> None:
        """Queue a request (rank 0). One that cannot run (too long for max_model_len or the
        KV cache, empty, ids outside the vocabulary, an id already running) becomes an error output
        of the next step, and so does any other exception its content raises here: no request ends
        the engine. ``stream``: :meth:`step` also returns this request's output so far (``finished``
        False) after every step that gives it a token. ``params.max_tokens`` 0 (score the prompt):
        the prompt runs through prefill and one greedy token, which the output leaves out. A pooling
        engine takes :class:`PoolingParams` (``stream`` ignored): its output's ``embedding`` comes once
        the prompt is prefilled; sampling params there, or pooling params on a generate engine, are
        that request's error output."""
        vocab, prompt = self.vocab_size, list(prompt_token_ids)
        if self.config.pooling or isinstance(params, PoolingParams):  # queued or refused by the pooling module
            if (error := add_pooling_request(self._pooling, self.scheduler, self.config, vocab,
                                             lambda: next(self._ids), request_id, prompt, params)) is not None:
                self._pending.append(error)
            return
        try:
            bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
            asked = params
            if params.prompt_only:  # one greedy token through the prefill, dropped from the output
                params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=params.prompt_logprobs)
            seq = Sequence(next(self._ids), request_id, prompt, params, arrival_time=time.monotonic())
            seq.spec = None if self._spec is None else SpecState()
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
            for name, ids in (("stop_token_ids", asked.stop_token_ids), ("logit_bias", asked.logit_bias or ())):
                if bad := [t for t in ids if t >= vocab]:
                    self._pending.append(EngineOutput(request_id, prompt, error=(
                        f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})"), error_field=name))
                    return
            self.outputs.add(seq, stream, asked)
            if params.structured_outputs is not None:  # scheduled once its grammar is compiled
                self.structured_outputs.submit(seq)
                return
            try:
                self.scheduler.add(seq)
            except BaseException:
                self.outputs.drop(seq.request_id)
                raise
        except ValueError as e:
            field = "n" if str(e).startswith(f"request {request_id!r}: n=") else "prompt"
            self._pending.append(EngineOutput(request_id, prompt, error=str(e), error_field=field))
        except Exception as e:  # noqa: BLE001 -- one request's failure is its own error output
            self._pending.append(failed_output(request_id, prompt, "scheduling", e))

    def num_waiting(self) -> int:
        """Rank 0: requests not yet scheduled (waiting, or outputs not yet handed back)."""
        return len(self.scheduler.waiting) + len(self._pending)

    def has_unfinished(self) -> bool:
        """Rank 0: whether any request is compiling its grammar, scheduled, or has an output to hand back."""
        return bool(self._pending) or self.scheduler.has_unfinished or bool(self.structured_outputs.compiling)

    def step(self) -> list[EngineOutput]:
        """Rank 0: one step: schedule, execute (every rank), update from the output. Returns the
        requests finished in it (error outputs of rejected requests and aborted requests first),
        then the outputs so far of streaming requests that got a token (``finished`` False)."""
        done = self._take_pending()
        if not self.scheduler.has_unfinished:
            return done
        step = self._schedule()
        out = self._execute(step)
        if self._pooling is not None:  # pooled rows: the finished requests' embeddings, no token
            return done + self._pooling.update(step.seqs, out, self.scheduler)
        outputs, emitted = self._updater.update(step, out)
        self._output_tokens += emitted
        return done + outputs

    def _take_pending(self) -> list[EngineOutput]:
        """The outputs waiting to be handed back, after admitting the constrained requests whose
        grammar is compiled (a failed one's error output among them). When nothing else can run,
        the admission waits (at most 50 ms) for a compile, so a loop of steps does not spin."""
        idle = not self.scheduler.has_unfinished and not self._pending
        self._pending += self.structured_outputs.admit(self.scheduler.add, self.outputs.drop, idle)
        done, self._pending = self._pending, []
        return done

    def _schedule(self) -> ScheduledStep:
        """Rank 0: the next step's sequences, their proposals (a decode step the speculative policy
        finds worth it), its plan and the grammar bitmask of its constrained rows (filled on a worker
        thread while the forward runs)."""
        seqs, is_prefill = self.scheduler.schedule()
        started = time.perf_counter()
        speculative = self._spec is not None and not is_prefill and \
            self._spec.schedule(seqs, self.scheduler, self._run_draft, self._steps)
        plan = self._plans.build(seqs, is_prefill or speculative, self._steps,
                                 block_copies=self.scheduler.take_block_copies())
        plan.greedy = not plan.prompt_idx.numel() and not any(s.params.needs_logits for s in seqs)  # on-shard argmax
        sampled = [s.samples for s in seqs]  # False: a prefill chunk, nothing to sample
        masks = self.structured_outputs.masks(seqs, sampled)
        # a greedy step's ranks mask their vocabulary shards with it (broadcast at the LM head), else
        # rank 0 masks the gathered rows
        plan.grammar_mask = plan.greedy and masks is not None
        return ScheduledStep(seqs, is_prefill, speculative, plan, sampled, masks, started)

    def _execute(self, step: ScheduledStep) -> torch.Tensor:
        """Broadcast ``step``'s plan and run it: this rank's result (argmax ids or logits rows)."""
        plan = broadcast_plan(step.plan)
        out = self.runner.execute(plan, step.masks.result if plan.grammar_mask else None)
        self._steps += 1
        self._prefill_steps += step.is_prefill
        self._computed_tokens += int(plan.input_ids.numel())
        return out

    def _run_draft(self, plan: StepPlan) -> list[int]:
        """Rank 0: broadcast a draft-model plan, run it, return its argmax ids."""
        return self.draft_runner.execute(broadcast_plan(plan)).tolist()

    def abort_request(self, request_id: str) -> bool:
        """Rank 0: end a live request now (a client went away); its KV blocks are freed at once and
        its final output (every sample's ``finish_reason`` "abort" unless it had finished) comes
        with the next :meth:`step`. Returns False when no such request is live."""
        if self._pooling is not None:
            out = self._pooling.abort(request_id, self.scheduler)
            if out is not None:
                self._pending.append(out)
            return out is not None
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
                           self._computed_tokens, s.num_cached_blocks, *spec_counters(self._spec))

    def replica_stats(self) -> list[EngineStats]:
        """The stats of each data-parallel replica: this engine's alone (rank 0)."""
        return [self.stats()]

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
        """Ranks 1..N-1: run each broadcast plan (the draft model's or the model's) until STOP."""
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


def driver_scheduler(config: EngineConfig, runner: ModelRunner, has_draft: bool, eos_ids: set[int]) -> Scheduler:
    """Rank 0's scheduler over ``runner``'s KV blocks: blocks that leave the model's sliding window
    (``runner.kv_window``) are freed, except with a draft model (``has_draft``: it reads the same block
    tables from its own position, after a preemption from 0); a pooling engine's prompt may fill
    ``max_model_len`` (it needs no room for an output token, vLLM's rule)."""
    window = runner.kv_window if not has_draft else None
    scheduler = Scheduler(config, runner.num_blocks, eos_ids, sliding_window=window)
    if config.pooling:
        scheduler.max_model_len = config.max_model_len + 1
    return scheduler


def draft_runner(config: EngineConfig, tp: TPInfo, spec: ModelSpec, num_blocks: int) -> ModelRunner | None:
    """The draft model's runner (``speculative_config`` method ``draft_model``): this rank's shard
    of it, with a KV cache of the target's ``num_blocks`` (block tables address both). None without one.

    Raises:
        tpengine.errors.UserError: not a model folder, a vocabulary other than the target's (naming
            both sizes), or a model that cannot split over this tp size or hold ``max_model_len``.
    """
    sc = config.speculative_config
    if sc is None or sc.method != "draft_model":
        return None
    hf = ModelSpec.read_config(sc.model)
    draft_spec = ModelSpec.from_config(sc.model, hf, tp, config.enable_expert_parallel)
    mine, theirs = spec.shard_plan.vocab_size, draft_spec.shard_plan.vocab_size
    if mine != theirs:
        raise UserError(f"speculative_config model {sc.model}: its vocabulary has {theirs} tokens, the "
                        f"model's {mine}; a draft model must share the model's vocabulary")
    check_model_limits(hf, config.max_model_len)
    draft = config.replace(model=sc.model, num_kv_blocks=num_blocks, speculative_config=None)
    return ModelRunner(draft, tp, draft_spec)


def spec_counters(spec: SpecDecoder | None) -> tuple:
    """EngineStats' speculative fields: (on, drafts, draft tokens, accepted tokens, accepted per position)."""
    if spec is None:
        return (False, 0, 0, 0, ())
    st = spec.stats
    return (True, st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, tuple(st.accepted_per_pos))
