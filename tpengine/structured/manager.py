"""Rank 0's structured-output bookkeeping: grammars compiled off the step loop and cached, and the
token bitmask of a step's constrained rows, filled while the forward runs (vLLM's design:
``vllm/v1/structured_output``).

Under tensor parallelism the mask is applied on rank 0 to the gathered full-vocabulary logits, the
rows every sampler reads, so constrained output is the same at every tp size.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tpengine.structured.backends import BACKEND_CLASSES, Grammar, GrammarError, Matcher, xgrammar_unsupported
from tpengine.structured.bitmask import apply_bitmask
from tpengine.structured.params import STRUCTURED_BACKENDS, StructuredOutputsParams

#: What each constraint kind is called in an error message.
_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
         "grammar": "grammar"}


class StructuredOutputManager:
    """Compiles constraints and masks logits for the engine on rank 0.

    Args:
        tokenizer: the model's HF tokenizer.
        vocab_size: the logits row width.
        stop_token_ids: the engine's EOS ids (allowed once a grammar is complete).
        backend: one of :data:`~tpengine.structured.params.STRUCTURED_BACKENDS`; "auto" (vLLM's
            rule) takes xgrammar, and guidance for a schema using a keyword xgrammar does not enforce
            (:func:`~tpengine.structured.backends.xgrammar_unsupported`) or for what xgrammar cannot
            compile (a Lark grammar). With "xgrammar" such a schema is refused (:class:`GrammarError`
            naming the keyword and where it is), never compiled into a grammar that lets it through.
        cache_size: compiled grammars kept (least recently used dropped first).

    Raises:
        ValueError: an unknown ``backend``, naming the valid ones.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], backend: str = "auto",
                 cache_size: int = 256) -> None:
        if backend not in STRUCTURED_BACKENDS:
            raise ValueError(f"invalid structured_outputs_backend={backend!r}: must be one of "
                             f"{', '.join(STRUCTURED_BACKENDS)}")
        self.tokenizer, self.vocab_size, self.backend = tokenizer, vocab_size, backend
        self.stop_token_ids = sorted(stop_token_ids)
        self.words = (vocab_size + 31) // 32
        self._backends: dict[str, Any] = {}
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        # compiling runs beside the step loop; filling a step's mask beside its forward
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="tpengine-grammar")
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="tpengine-bitmask")

    def _library(self, name: str) -> Any:
        with self._lock:
            if name not in self._backends:
                self._backends[name] = BACKEND_CLASSES[name](self.tokenizer, self.vocab_size, self.stop_token_ids)
            return self._backends[name]

    def _compile(self, p: StructuredOutputsParams) -> Grammar:
        names = ["xgrammar", "guidance"] if self.backend == "auto" else [self.backend]
        problems = []
        dropped = xgrammar_unsupported(p.json) if p.kind == "json" and "xgrammar" in names else None
        if dropped is not None:  # xgrammar would compile it and not keep it: never a 200 that breaks it
            names.remove("xgrammar")
            problems.append(f"xgrammar does not enforce {dropped}")
        for name in names:
            try:
                return self._library(name).compile(p)
            except GrammarError as e:
                problems.append(f"{name}: {e}" if len(names) > 1 or problems else str(e))
        raise GrammarError(f"cannot compile the {_WHAT[p.kind]}: {'; '.join(problems)}")

    def compile(self, p: StructuredOutputsParams) -> Future:
        """The :class:`Grammar` of ``p``, compiled on a worker thread the first time ``p``'s
        constraint is seen and cached after (a failure too, so a bad schema is refused at once).
        The future raises :class:`GrammarError` when the backend refuses the constraint."""
        key = p.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._compile_pool.submit(self._compile, p)
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def check(self, p: StructuredOutputsParams) -> None:
        """Compile ``p`` now (the server's request handler does, in a thread, so a bad constraint is
        that request's 400). Raises GrammarError."""
        self.compile(p).result()

    def fill(self, matchers: Sequence[Matcher | None]) -> torch.Tensor:
        """The bitmask int32 ``[len(matchers), ceil(vocab_size / 32)]``: row i from ``matchers[i]``,
        all ones (every token allowed) where it is None."""
        mask = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        for i, m in enumerate(matchers):
            if m is not None:
                m.fill(mask, i)
        return mask

    def fill_async(self, matchers: Sequence[Matcher | None]) -> Future:
        """:meth:`fill` on the mask thread (the engine starts it before the step's forward)."""
        return self._fill_pool.submit(self.fill, list(matchers))

    @staticmethod
    def apply(logits: torch.Tensor, mask: torch.Tensor) -> None:
        """Set ``logits[i, t]`` to -inf where ``mask[i]`` does not allow ``t``, in place; ``logits``
        float ``[R, V]``, ``mask`` int32 ``[R, ceil(V / 32)]`` (:func:`~tpengine.structured.bitmask.apply_bitmask`)."""
        apply_bitmask(logits, mask)

    def close(self) -> None:
        """Stop the worker threads (compiles in flight finish)."""
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)
