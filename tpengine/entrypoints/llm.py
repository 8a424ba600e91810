"""LLM: the offline Python API, after vLLM's ``vllm.LLM``.

    from tpengine import LLM, SamplingParams

    llm = LLM("models/smollm2-135m-instruct", max_model_len=2048)
    for out in llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=32)):
        print(out.outputs[0].text)
    print(llm.chat([{"role": "user", "content": "Hi!"}])[0].outputs[0].text)

    embedder = LLM("models/smollm2-135m-instruct", runner="pooling")   # vLLM's pooling runner
    vec = embedder.embed(["The capital of France is"])[0].outputs.embedding  # list of hidden_size floats

At tp=1 it runs in the calling process. Under ``torchrun --nproc_per_node=N script.py`` every rank
runs the same script, builds the same ``LLM`` and makes the same calls (vLLM's
``external_launcher``): rank 0 tokenizes and runs the engine, the other ranks follow its step
broadcasts, and then rank 0 broadcasts the outputs, so every rank returns the same list. With
``data_parallel_size=D`` the world is D replicas: rank 0 routes the prompts between them
(:mod:`tpengine.engine.data_parallel`) and still broadcasts every output to every rank. Input
checks that raise run on every rank before any collective, so every rank raises alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tpengine.config import DEFAULT_MODEL_DIR
from tpengine.entrypoints.outputs import EmbeddingRequestOutput, RequestOutput
from tpengine.entrypoints.setup import build_engine, read_launch, start_rank
from tpengine.errors import UserError
from tpengine.pooling_params import PoolingParams
from tpengine.sampling_params import SamplingParams

#: One prompt as the engine takes it: (kind, payload, text): kind "prompt" (payload the text),
#: "token_ids" (payload list[int]) or "messages" (payload [{"role", "content"[, "name"]}, ...]);
#: text: the prompt text for :attr:`RequestOutput.prompt`, or None.
PromptItem = tuple[str, Any, "str | None"]

_PROMPT_KINDS = ("a str, a list of token ids (ints), {'prompt': str} or {'prompt_token_ids': [int, ...]}")


class LLM:
    """A model loaded for offline generation.

    Args:
        model: a Hugging Face model folder (Llama, Mistral, Qwen2, Qwen3). Under torchrun at world
            size N, ``{model}-tpN`` is used instead when it holds pre-split shards
            (``tpengine-shard``), as ``tpengine run`` does.
        tensor_parallel_size: ranks per model replica; default the world size (torchrun's
            ``WORLD_SIZE``, 1 without torchrun) / ``data_parallel_size``.
        data_parallel_size: (an engine setting) model replicas, each a TP group of consecutive
            ranks with its own scheduler and KV cache; the prompts are routed between them, and every
            rank still gets every output, in prompt order. World size = data_parallel_size x
            tensor_parallel_size.
        **engine_settings: :class:`tpengine.config.EngineConfig` fields (``dtype``,
            ``max_model_len``, ``kv_cache_gb``, ``max_num_seqs``, ``seed``, ``generation_config``,
            ``runner`` ("pooling": :meth:`embed` instead of :meth:`generate`), ``pooler_config``,
            ...); None means unset. ``generation_config`` (vLLM's): "auto" (default: the model's
            ``generation_config.json`` sampling values are the defaults of
            :meth:`get_default_sampling_params`), "ignore", or a folder holding one.

    Attributes:
        llm_engine: the :class:`tpengine.engine.llm_engine.LLMEngine` (None after :meth:`shutdown`).

    Raises:
        UserError: an unknown engine setting (naming it and the valid ones), a world size that is
            not ``data_parallel_size x tensor_parallel_size``, a model folder that does not exist
            or is not a model folder, ``max_model_len`` beyond the model's limit.
        ValueError: an invalid setting value (naming the field, the value and what is valid).
    """

    def __init__(self, model: str = DEFAULT_MODEL_DIR, *, tensor_parallel_size: int | None = None,
                 **engine_settings: Any) -> None:
        from tpengine.engine.llm_engine import LLMEngine

        rank, world_size = start_rank()
        launch = read_launch(None, {**engine_settings, "model": model, "tensor_parallel_size": tensor_parallel_size},
                             world_size)
        self._sampling_defaults = launch.sampling
        self.llm_engine: LLMEngine | None = build_engine(launch.config, rank, world_size, launch.defaults_line,
                                                         announce_loading=False)
        self._next_id = 0  # request ids "0", "1", ...: the same on every rank

    # ------------------------------------------------------------------ public API
    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams used when ``generate`` / ``chat`` get none (vLLM's method): the
        built-in defaults with the model's ``generation_config.json`` values over them (per the
        ``generation_config`` setting; see :mod:`tpengine.entrypoints.generation_defaults`)."""
        return SamplingParams(**self._sampling_defaults)

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate a completion for each prompt; every rank calls this with the same arguments.

        Args:
            prompts: one prompt or a list of them. A prompt is a str (tokenized as
                ``tokenizer(text)["input_ids"]``, the tokenizer's default special tokens once), a
                list of token ids (a list of ints is one prompt; a list of such lists is a batch),
                ``{"prompt": str}`` or ``{"prompt_token_ids": [int, ...]}``.
            sampling_params: one :class:`SamplingParams` for every prompt, or a list with one per
                prompt; default :meth:`get_default_sampling_params` (``max_tokens`` 16, temperature
                1.0, unless the model's generation_config.json sets them).

        Returns:
            One :class:`RequestOutput` per prompt, in prompt order, on every rank. A prompt that
            cannot run (longer than ``max_model_len`` allows, no tokens, a token id outside the
            vocabulary, a failure while tokenizing) does not raise: its output has ``error`` set
            and ``outputs == []``; the other prompts run as usual.

        Raises:
            TypeError: a prompt or ``sampling_params`` of another type (naming its position).
            ValueError: a list of ``sampling_params`` whose length is not the number of prompts; a
                pooling engine (``runner="pooling"``: use :meth:`embed`).
            RuntimeError: after :meth:`shutdown`.
        """
        self._check_runner("generate")
        items = _parse_prompts(prompts)
        return self._run(items, self._per_prompt(sampling_params, len(items)), None)

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate a reply to each conversation; every rank calls this with the same arguments.

        Args:
            messages: one conversation (a list of ``{"role", "content"[, "name"]}`` dicts; content a
                str or a list of ``{"type": "text", "text"}`` parts, joined with "\\n") or a list of
                conversations. The prompt ids are exactly the tokenizer's
                ``apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=True,
                **chat_template_kwargs)``, as the batch job's ``messages`` requests.
            sampling_params: as :meth:`generate` (default :meth:`get_default_sampling_params`:
                ``max_tokens`` 16, as vLLM's ``LLM.chat``).
            add_generation_prompt: open the assistant's turn after the messages.
            continue_final_message: continue the last message (each conversation's must be the
                assistant's) without closing it; needs ``add_generation_prompt=False``.
            chat_template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``).

        Returns:
            One :class:`RequestOutput` per conversation, in order (``prompt`` None); a conversation
            that cannot run (too long, no chat template) has ``error`` set and ``outputs == []``.

        Raises:
            UserError: a malformed message or template option (naming the conversation, the field
                and what is valid: e.g. ``continue_final_message`` with ``add_generation_prompt``
                true, or a last message that is not the assistant's).
            TypeError, ValueError, RuntimeError: as :meth:`generate`.
        """
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                   "chat_template_kwargs": chat_template_kwargs}
        self._check_runner("chat")
        items = _parse_conversations(messages, options)
        return self._run(items, self._per_prompt(sampling_params, len(items)), _template_options(options))

    def embed(self, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (vLLM's ``LLM.embed``): the engine's pooling (``pooler_config``:
        the last token's or the mean final hidden state, after the model's final norm) of one
        prefill, L2-normalized unless the pooler config or ``pooling_params`` say otherwise. Every rank
        calls this with the same arguments; the LLM must be a pooling one (``runner="pooling"``).

        Args:
            prompts: as :meth:`generate`'s.
            pooling_params: one :class:`PoolingParams` for every prompt, or a list with one per
                prompt; default ``PoolingParams()``.

        Returns:
            One :class:`EmbeddingRequestOutput` per prompt, in prompt order, on every rank
            (``outputs.embedding``: a list of floats). A prompt that cannot run (longer than
            ``max_model_len``, no tokens, an id outside the vocabulary, ``dimensions`` the model does
            not take) does not raise: its ``error`` is set and ``outputs`` is None.

        Raises:
            TypeError: a prompt or ``pooling_params`` of another type (naming its position).
            ValueError: a list of ``pooling_params`` whose length is not the number of prompts; an LLM
                that is not a pooling one.
            RuntimeError: after :meth:`shutdown`.
        """
        self._check_runner("embed")
        items = _parse_prompts(prompts)
        params = _per_prompt(PoolingParams() if pooling_params is None else pooling_params, len(items),
                             PoolingParams, "pooling_params")
        return self._run(items, params, None, embed=True)

    def _check_runner(self, method: str) -> None:
        """``embed`` needs a pooling engine, ``generate`` and ``chat`` a generating one (checked on every
        rank alike, before any collective).

        Raises:
            ValueError: the other kind, naming the method and the setting.
            RuntimeError: after :meth:`shutdown`.
        """
        if self.llm_engine is None:
            raise RuntimeError("this LLM is shut down: create a new LLM")
        pooling = self.llm_engine.config.pooling
        if method == "embed" and not pooling:
            raise ValueError("LLM.embed needs a pooling model: create the LLM with runner=\"pooling\" "
                             "(vLLM's --runner pooling)")
        if method != "embed" and pooling:
            raise ValueError(f"LLM.{method} generates text, but this LLM runs runner=\"pooling\" (embeddings); "
                             "use LLM.embed, or create the LLM without runner=\"pooling\"")

    def shutdown(self) -> None:
        """Free the engine and tear down the process groups; every rank calls it. Safe to call twice."""
        if self.llm_engine is not None:
            engine, self.llm_engine = self.llm_engine, None
            engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals
    def _per_prompt(self, sampling_params: Any, n: int) -> list[SamplingParams]:
        return _per_prompt(self.get_default_sampling_params() if sampling_params is None else sampling_params, n)

    def _run(self, items: list[PromptItem], params: list[Any], template_options: dict[str, Any] | None,
             embed: bool = False) -> list[Any]:
        """Run ``items`` with ``params`` (one each) on the engine; rank 0's outputs on every rank: a
        :class:`RequestOutput` per item, or with ``embed`` an :class:`EmbeddingRequestOutput`."""
        from tpengine.distributed import broadcast_object

        engine = self.llm_engine
        if engine is None:
            raise RuntimeError("this LLM is shut down: create a new LLM")
        ids = [str(self._next_id + i) for i in range(len(items))]
        self._next_id += len(items)
        if not engine.is_driver:
            engine.generate([])  # follow rank 0's steps (or the front's ticks) until its STOP
            return broadcast_object(None, world=True)
        texts = {rid: item[2] for rid, item in zip(ids, items)}
        results: dict[str, Any] = {}
        feed = self._feed(ids, items, params, template_options, results)
        for out in engine.generate(feed):
            convert = EmbeddingRequestOutput.from_engine if embed else RequestOutput.from_engine
            results[out.request_id] = convert(out, texts[out.request_id])
        if embed:  # a prompt that failed before the engine
            results = {rid: EmbeddingRequestOutput.failed(r) if isinstance(r, RequestOutput) else r
                       for rid, r in results.items()}
        return broadcast_object([results[rid] for rid in ids], world=True)

    def _feed(self, ids: list[str], items: list[PromptItem], params: list[SamplingParams],
              template_options: dict[str, Any] | None, results: dict[str, RequestOutput]
              ) -> Iterator[tuple[str, list[int], SamplingParams]]:
        """Rank 0: tokenize each item as the engine takes it (as the batch job does); one that fails
        gets its error output in ``results`` and is not yielded."""
        from tpengine.engine.output_processor import failed_output
        from tpengine.frontend.requests import ParsedRequest, RequestValidationError, to_token_ids

        engine = self.llm_engine
        for rid, (kind, payload, text), p in zip(ids, items, params):
            req = ParsedRequest(rid, 0, kind, "simple", payload, p, None, template_options)  # line 0: not a file
            try:
                prompt_ids = to_token_ids(req, engine.tokenizer, engine.vocab_size)
            except RequestValidationError as e:
                results[rid] = RequestOutput(rid, text, [], error=str(e))
                continue
            except Exception as e:  # noqa: BLE001 -- e.g. the chat template's raise_exception
                stage = "applying the chat template" if kind == "messages" else "tokenizing"
                results[rid] = RequestOutput.from_engine(failed_output(rid, [], stage, e), text)
                continue
            yield rid, prompt_ids, p


def _is_token_ids(v: Any) -> bool:
    """A non-empty list or tuple of ints (not bools): one token-id prompt."""
    return isinstance(v, (list, tuple)) and bool(v) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in v)


def _parse_prompts(prompts: Any) -> list[PromptItem]:
    """``generate``'s ``prompts`` as a list of :data:`PromptItem` (see :meth:`LLM.generate`).

    Raises:
        TypeError: anything else, naming its position (``prompts[i]``) and the valid kinds.
    """
    if isinstance(prompts, (str, Mapping)) or _is_token_ids(prompts):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a prompt or a list of prompts ({_PROMPT_KINDS}), "
                        f"got {type(prompts).__name__}")
    items: list[PromptItem] = []
    for i, p in enumerate(prompts):
        if isinstance(p, Mapping) and len(p) == 1 and isinstance(p.get("prompt"), str):
            p = p["prompt"]
        elif isinstance(p, Mapping) and len(p) == 1 and isinstance(p.get("prompt_token_ids"), (list, tuple)):
            ids = p["prompt_token_ids"]
            if ids and not _is_token_ids(ids):
                raise TypeError(f"prompts[{i}]['prompt_token_ids'] must be a list of ints, got {list(ids)[:8]!r}")
            items.append(("token_ids", list(ids), None))  # [] is that prompt's own error: no tokens
            continue
        if isinstance(p, str):
            items.append(("prompt", p, p))
        elif _is_token_ids(p):
            items.append(("token_ids", list(p), None))
        else:
            raise TypeError(f"prompts[{i}] must be {_PROMPT_KINDS}, got {type(p).__name__} {_short(p)}")
    return items


def _template_options(options: dict[str, Any]) -> dict[str, Any]:
    """``apply_chat_template`` options for ``chat``'s (validated) arguments."""
    return {**options, "chat_template_kwargs": dict(options["chat_template_kwargs"] or {})}


def _parse_conversations(messages: Any, options: dict[str, Any] | None = None) -> list[PromptItem]:
    """``chat``'s ``messages`` as a list of :data:`PromptItem` of kind "messages", each message
    validated by the batch job's pydantic layer (:class:`tpengine.protocol.SimpleRequest`).

    Raises:
        TypeError: not a conversation or a list of conversations.
        UserError: a malformed message, naming the conversation and the field.
    """
    from pydantic import ValidationError

    from tpengine.protocol.errors import field_errors
    from tpengine.protocol.requests import SimpleRequest

    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a conversation (a list of {{'role', 'content'}} dicts) or a list of "
                        f"conversations, got {type(messages).__name__}")
    convs = [messages] if messages and all(isinstance(m, Mapping) for m in messages) else messages
    items: list[PromptItem] = []
    for i, conv in enumerate(convs):
        if not isinstance(conv, (list, tuple)):
            raise TypeError(f"messages[{i}] must be a conversation (a list of {{'role', 'content'}} dicts), "
                            f"got {type(conv).__name__} {_short(conv)}")
        try:
            req = SimpleRequest.model_validate({"messages": list(conv), **(options or {})})
        except ValidationError as e:
            problems = "; ".join(f"{f}: {m}" if f else m for f, m in field_errors(e))
            raise UserError(f"conversation {i}: {problems}") from None
        items.append(req.prompt_payload() + (None,))
    return items


def _per_prompt(sampling_params: Any, n: int, kind: type = SamplingParams, name: str = "sampling_params") -> list:
    """One ``kind`` (:class:`SamplingParams`, or :class:`PoolingParams` for ``embed``) per prompt (see
    :meth:`LLM.generate`); ``name``: the argument's name in messages.

    Raises:
        TypeError: not a ``kind``, a list of them, or None.
        ValueError: a list whose length is not ``n``.
    """
    if sampling_params is None:
        sampling_params = kind()
    if isinstance(sampling_params, kind):
        return [sampling_params] * n
    if isinstance(sampling_params, (list, tuple)) and all(isinstance(p, kind) for p in sampling_params):
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} {name} for {n} prompts: pass one "
                             f"{kind.__name__} for all, or a list with one per prompt")
        return list(sampling_params)
    raise TypeError(f"{name} must be a {kind.__name__}, a list of them (one per prompt) or None, "
                    f"got {type(sampling_params).__name__} {_short(sampling_params)}")


def _short(v: Any) -> str:
    """``repr(v)``, cut to 60 characters."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."
