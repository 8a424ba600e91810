"""Pooling: a pooling engine's requests (vLLM's pooling runner, ``runner`` "pooling"), each one
prompt's final hidden states pooled into one embedding.

A pooling request is a prefill and nothing more: the scheduler admits and chunks it as any prompt
(its blocks come at admission, a long prompt is prefilled in chunks beside others), the model runs
its one forward (:class:`tpengine.model.layers.fused.DecoderStack`) and skips the LM head, and the
request ends in the step that computes its last prompt token: its KV blocks are freed then, no
token is sampled. The stack's output, after the model's final norm, is replicated on every rank
(its last all-reduce runs before that norm), so rank 0 pools alone: :func:`pool_rows` on every
step's rows, :class:`PoolingRequests` across a prompt's chunks (MEAN sums each chunk's rows and
divides by the prompt's length at the end; LAST takes the row of the last prompt token).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tpengine.config import EngineConfig, PoolerConfig
from tpengine.engine.output_processor import failed_output
from tpengine.engine.outputs import CompletionOutput, EngineOutput
from tpengine.engine.sequence import Sequence
from tpengine.engine.step import StepPlan
from tpengine.pooling_params import PoolingParams
from tpengine.sampling_params import SamplingParams


def pool_rows(hidden: torch.Tensor, plan: StepPlan, pooling_type: str) -> torch.Tensor:
    """One float32 row per sequence of ``plan`` from the step's final hidden states ``hidden``
    ``[N, hidden_size]`` (the step's tokens back to back, as ``plan.cu_seqlens_q`` splits them):
    "LAST" the row of each sequence's last token in the step (``plan.sample_idx``), "MEAN" the sum of
    each sequence's rows in the step (the caller divides by the prompt's length once every chunk is in).

    Returns:
        ``[B, hidden_size]`` float32 on ``hidden``'s device.
    """
    if pooling_type == "LAST":
        return hidden.index_select(0, plan.sample_idx.to(hidden.device)).float()
    cu = plan.cu_seqlens_q.to(hidden.device)
    owner = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=hidden.device), cu[1:] - cu[:-1])
    sums = torch.zeros(cu.numel() - 1, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    return sums.index_add_(0, owner, hidden.float())


def add_pooling_request(pooling: PoolingRequests | None, scheduler, config: EngineConfig, vocab_size: int,
                        new_id: Callable[[], int], request_id: str, prompt: list[int],
                        params: PoolingParams | SamplingParams) -> EngineOutput | None:
    """Queue a pooling request on rank 0 (``LLMEngine.add_request``): a prefill-only sequence with id
    ``new_id()``, tracked by ``pooling`` and added to ``scheduler``
    (:class:`tpengine.engine.scheduler.Scheduler`). ``pooling`` is None on a generate engine.

    Returns:
        None once queued, else the request's error output: a generate engine (``config.runner``),
        sampling params, ids outside ``[0, vocab_size)``, a prompt longer than ``config.max_model_len``,
        ``dimensions`` the model does not take (``error_field`` "prompt" or "dimensions"), or any other
        exception the request raised while it was added ("scheduling").
    """
    limit = config.max_model_len
    try:
        if not config.pooling:
            raise ValueError(f"request {request_id!r}: embeddings need a pooling engine (runner pooling, "
                             f"--runner pooling); this one generates (runner {config.runner!r})")
        if not isinstance(params, PoolingParams):
            raise ValueError(f"request {request_id!r}: this engine makes embeddings (runner pooling) and "
                             "generates no text; send PoolingParams (LLM.embed, /v1/embeddings)")
        if bad := [t for t in prompt if not 0 <= t < vocab_size]:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if len(prompt) > limit:
            raise ValueError(f"request {request_id!r}: the prompt has {len(prompt)} tokens, but max_model_len "
                             f"is {limit}; shorten the input")
        seq = Sequence(new_id(), request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0),
                       arrival_time=time.monotonic())
        pooling.add(seq, params)
        try:
            scheduler.add(seq)
        except BaseException:
            pooling.drop(request_id)
            raise
    except ValueError as e:
        msg = str(e)
        field = "dimensions" if msg.startswith("dimensions") else "prompt"
        return EngineOutput(request_id, prompt, error=msg, error_field=field)
    except Exception as e:  # noqa: BLE001 -- one request's failure is its own error output
        return failed_output(request_id, prompt, "scheduling", e)
    return None


@dataclass
class _Live:
    """One pooling request in flight: its sequence, options and (MEAN) the sum of its rows so far."""

    seq: Sequence
    params: PoolingParams
    total: torch.Tensor | None = None


class PoolingRequests:
    """Rank 0's pooling requests in flight, keyed by request id.

    Args:
        config: the engine's pooling (type and default normalization).
        hidden_size: the model's hidden size (the embedding's length).
        matryoshka: whether the model's embeddings may be cut to fewer ``dimensions``
            (its config's ``is_matryoshka`` / ``matryoshka_dimensions``).
        matryoshka_dimensions: the lengths it allows (None: any up to ``hidden_size``).
    """

    def __init__(self, config: PoolerConfig, hidden_size: int, matryoshka: bool = False,
                 matryoshka_dimensions: list[int] | None = None) -> None:
        self.config, self.hidden_size = config, hidden_size
        self.matryoshka, self.matryoshka_dimensions = matryoshka, matryoshka_dimensions
        self.live: dict[str, _Live] = {}

    @classmethod
    def for_model(cls, config: PoolerConfig, hf_config: Any, hidden_size: int) -> PoolingRequests:
        """The pooling requests of a model whose HF config is ``hf_config``: matryoshka when it sets
        ``is_matryoshka`` or ``matryoshka_dimensions`` (the lengths it allows)."""
        dims = getattr(hf_config, "matryoshka_dimensions", None)
        return cls(config, hidden_size, bool(getattr(hf_config, "is_matryoshka", False) or dims), dims)

    def check(self, params: PoolingParams) -> None:
        """A request's options against the model.

        Raises:
            ValueError: ``dimensions`` for a model without matryoshka representations (as vLLM), or
                one it does not allow, naming the field.
        """
        d = params.dimensions
        if d is None:
            return
        if not self.matryoshka:
            raise ValueError(f"dimensions: this model does not support matryoshka representation (its config sets "
                             f"no is_matryoshka or matryoshka_dimensions), so its embeddings keep all "
                             f"{self.hidden_size} dimensions; leave dimensions unset")
        allowed = self.matryoshka_dimensions
        if d > self.hidden_size or allowed and d not in allowed:
            valid = ", ".join(map(str, allowed)) if allowed else f"1 to {self.hidden_size}"
            raise ValueError(f"dimensions: this model's embeddings can be cut to {valid} dimensions, got {d}")

    def add(self, seq: Sequence, params: PoolingParams) -> None:
        """Track ``seq``, a new pooling request (its id must not be live).

        Raises:
            ValueError: the id is live already; ``params`` that :meth:`check` refuses.
        """
        if seq.request_id in self.live:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        self.check(params)
        self.live[seq.request_id] = _Live(seq, params)

    def drop(self, request_id: str) -> None:
        """Stop tracking ``request_id`` (it failed before it ran)."""
        self.live.pop(request_id, None)

    def update(self, seqs: list[Sequence], pooled: torch.Tensor, scheduler) -> list[EngineOutput]:
        """Take one step's pooled rows (``pooled[i]`` of ``seqs[i]``, from :func:`pool_rows`): a sequence
        whose prompt is not all computed yet (a chunk) advances in ``scheduler``
        (:class:`tpengine.engine.scheduler.Scheduler`), one whose last prompt token ran finishes there
        ("stop", its blocks freed, its computed blocks left in the prefix cache) and gives its output.
        Sequences aborted meanwhile are skipped. Returns the finished requests' outputs."""
        outs, chunks = [], []
        pooled = pooled.cpu()
        for seq, row in zip(seqs, pooled):
            live = self.live.get(seq.request_id)
            if live is None or seq.is_finished:
                continue
            if self.config.pooling_type == "MEAN":
                live.total = row if live.total is None else live.total + row
            if not seq.samples:
                chunks.append(seq)
                continue
            seq.num_cached_tokens = seq.num_tokens  # every prompt token computed: their full blocks are cached
            scheduler.block_manager.cache_computed(seq)
            scheduler.finish(seq, "stop")
            del self.live[seq.request_id]
            vec = row if live.total is None else live.total / seq.num_prompt_tokens
            outs.append(self._output(live, vec))
        if chunks:
            scheduler.postprocess(chunks, [0] * len(chunks), [False] * len(chunks))
        return outs

    def abort(self, request_id: str, scheduler) -> EngineOutput | None:
        """End live ``request_id`` now (its blocks freed): its output, finish reason "abort" and no
        embedding; None when it is not live."""
        live = self.live.pop(request_id, None)
        if live is None:
            return None
        scheduler.finish(live.seq, "abort")
        return self._output(live, None)

    def _output(self, live: _Live, vec: torch.Tensor | None) -> EngineOutput:
        """The final output of ``live``: ``vec`` cut to ``dimensions`` and normalized as asked, or none
        (aborted)."""
        seq, p = live.seq, live.params
        if vec is not None:
            if p.dimensions is not None:
                vec = vec[: p.dimensions]
            if p.normalize if p.normalize is not None else self.config.normalize:
                vec = F.normalize(vec, p=2, dim=0)
            vec = vec.contiguous()
        t0, end = seq.arrival_time, seq.finish_time or time.monotonic()
        return EngineOutput(seq.request_id, seq.prompt_token_ids, [CompletionOutput(0, "", [], seq.finish_reason)],
                            num_cached_tokens=seq.num_prefix_cached_tokens or 0, latency_s=end - t0,
                            queue_s=None if seq.scheduled_time is None else seq.scheduled_time - t0, embedding=vec)
