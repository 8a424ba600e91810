"""Request shapes: the simple line, the OpenAI ``/v1/completions`` and ``/v1/chat/completions``
bodies, and the OpenAI Batch line ``{custom_id, method, url, body}`` that carries one of them.

Every model validates a parsed JSON object (``Model.model_validate(obj)``); errors are pydantic
``ValidationError``s whose messages say what is valid (see :mod:`tpengine.protocol.errors` for
the ``(field path, message)`` form). ``null`` for an optional field means "not given".
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import annotated_types as at
from pydantic import Strict, ValidationInfo, field_validator

from tpengine.protocol.base import Problem, ProtocolModel
from tpengine.protocol.fields import (
    PROMPT_LIST_ERROR,
    URL,
    ChatURL,
    CompletionURL,
    Flag,
    MaxTokens,
    Method,
    Neutral,
    NonEmptyStr,
    NumLogprobs,
    Prompt,
    Prompts,
    RequestId,
    TokenIds,
    Valid,
    as_json,
    invalid,
)
from tpengine.protocol.messages import ChatTemplateFields, Messages
from tpengine.protocol.sampling import SamplingFields
from tpengine.protocol.tools import Tool, ToolFields

#: The message for ``"stream": true`` in a batch job (vLLM's run-batch refuses it too).
STREAM_ERROR = "streaming is not supported in a batch job (each request gets one complete record); use false or omit it"

#: The prompt kinds of :meth:`SimpleRequest.prompt_payload` and the bodies' ``prompt_payload``.
PROMPT, MESSAGES, TOKEN_IDS = "prompt", "messages", "token_ids"

_Str = Annotated[str, Strict(), Valid("a string")]
_Object = Annotated[dict[str, Any], Strict(), Valid("an object")]


def _prompt_payloads(prompt: str | list) -> list[tuple[str, Any]]:
    """The prompts of an OpenAI ``prompt`` value (see :data:`~tpengine.protocol.fields.Prompts`)."""
    if isinstance(prompt, str):
        return [(PROMPT, prompt)]
    if isinstance(prompt[0], str):  # OpenAI's list of strings
        return [(PROMPT, p) for p in prompt]
    if isinstance(prompt[0], list):  # a list of token-id lists
        return [(TOKEN_IDS, list(p)) for p in prompt]
    return [(TOKEN_IDS, list(prompt))]


def _is_prompt_list(prompt: Any) -> bool:
    """Whether an OpenAI ``prompt`` value holds more than one prompt."""
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))


class SimpleRequest(SamplingFields, ChatTemplateFields):
    """A simple line: ``{"id"?, "prompt" | "messages" | "prompt_token_ids", <sampling>, "logprobs"?,
    <chat-template options>?, "stream"?}``.

    ``id``: a non-empty string or an integer; ``prompt``: a non-empty string (or a list of token
    ids, or a list holding one string); exactly one prompt field is required. ``logprobs``: the
    number of top logprobs per generated token, in [0, 20] (vLLM's). The chat-template options
    (:class:`~tpengine.protocol.messages.ChatTemplateFields`) only go with ``messages``.
    ``stream``: only false (a batch job writes complete records).
    """

    PROMPT_KEYS: ClassVar[tuple[str, ...]] = ("prompt", "messages", "prompt_token_ids")

    id: RequestId | None = None
    prompt: Prompt | None = None
    messages: Messages | None = None
    prompt_token_ids: TokenIds | None = None
    logprobs: NumLogprobs | None = None
    stream: Flag | None = None

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[Problem]:
        out: list[Problem] = []
        given = [k for k in cls.PROMPT_KEYS if data.get(k) is not None]
        need = f"exactly one of {', '.join(cls.PROMPT_KEYS)} is required"
        if not given:
            out.append((("prompt",), need))
        elif len(given) > 1:
            out.append(((), f"{need}, got {', '.join(given)}"))
        if data.get("stream") is True:
            out.append((("stream",), f"{STREAM_ERROR}, got true"))
        out.extend(super().problems(data))
        if len(given) == 1:
            out.extend(cls.template_problems(data, None if given[0] == "messages" else given[0]))
        return out

    def sampling_kwargs(self) -> dict[str, Any]:
        """As :meth:`SamplingFields.sampling_kwargs`, with ``logprobs``."""
        kw = super().sampling_kwargs()
        if self.logprobs is not None:
            kw["logprobs"] = self.logprobs
        return kw

    def request_id(self, line_index: int) -> str:
        """The id as a string; a line without one gets its 0-based line index."""
        return str(line_index) if self.id is None else str(self.id)

    def prompt_payload(self) -> tuple[str, Any]:
        """(kind, payload): ("prompt", str) | ("messages", [{"role", "content"[, "name"]}, ...]) |
        ("token_ids", list[int])."""
        if self.messages is not None:
            return MESSAGES, [m.to_template() for m in self.messages]
        if self.prompt_token_ids is not None:
            return TOKEN_IDS, list(self.prompt_token_ids)
        assert self.prompt is not None  # guaranteed by problems()
        return _prompt_payloads(self.prompt)[0]


class OpenAIBody(SamplingFields):
    """The fields both OpenAI bodies share: OpenAI's ``n``, ``presence_penalty``,
    ``frequency_penalty``, ``logit_bias``, ``seed``, ``stop``, ``temperature``, ``top_p``,
    ``max_tokens`` and ``max_completion_tokens`` (wins over ``max_tokens`` when both are given);
    vLLM's extra body fields (the rest of :class:`SamplingFields`: ``top_k``, ``min_p``,
    ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``,
    ``skip_special_tokens``, ``ignore_eos``, ``prompt_logprobs``); ``model``, ``user``, ``stream``,
    ``stream_options``, ``metadata``, ``store`` are accepted and ignored (a batch line's ``"stream":
    true`` is refused by :class:`BatchRequestLine`); the server reads ``stream_options``
    (``include_usage``, ``continuous_usage_stats``) and vLLM's ``return_tokens_as_token_ids`` (every
    logprobs token as ``"token_id:<id>"``; true is refused in a batch line); OpenAI fields tpengine
    does not implement are accepted only at their neutral values, checked by JSON type and value."""

    MAX_TOKENS_KEYS: ClassVar[tuple[str, ...]] = ("max_tokens", "max_completion_tokens")

    max_completion_tokens: MaxTokens | None = None
    model: _Str | None = None
    user: _Str | None = None
    stream: Flag | None = None
    stream_options: _Object | None = None
    metadata: _Object | None = None
    store: Flag | None = None
    return_tokens_as_token_ids: Flag | None = None
    best_of: Annotated[int, Strict(), Neutral((1,))] | None = None
    suffix: Annotated[str, Strict(), Neutral()] | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        """As :meth:`SamplingFields.sampling_kwargs`; ``max_completion_tokens`` becomes ``max_tokens``."""
        kw = super().sampling_kwargs()
        if self.max_completion_tokens is not None:
            kw["max_tokens"] = self.max_completion_tokens
        return kw


class ChatCompletionRequest(OpenAIBody, ChatTemplateFields, ToolFields):
    """An OpenAI ``/v1/chat/completions`` body: ``messages`` required; ``logprobs`` (a flag) with
    ``top_logprobs`` in [0, 20] (only with ``"logprobs": true``, as vLLM): each generated token's
    logprob and the ``top_logprobs`` most likely (``SamplingParams.logprobs`` = ``top_logprobs``,
    0 when absent); the chat-template options of
    :class:`~tpengine.protocol.messages.ChatTemplateFields`; tool calling
    (:class:`~tpengine.protocol.tools.ToolFields`: the tools go to the chat template; a
    ``required`` or named ``tool_choice`` is enforced as an output constraint, so it cannot be given
    with one)."""

    messages: Messages
    logprobs: Flag | None = None
    top_logprobs: NumLogprobs | None = None
    echo: Annotated[bool, Strict(), Neutral((False,))] | None = None

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[Problem]:
        out = super().problems(data) + cls.template_problems(data, None) + cls.tool_problems(data)
        choice = data.get("tool_choice")
        if data.get("tools") and choice is not None and choice not in ("none", "auto"):
            if given := [k for k in cls.STRUCTURED_KEYS if data.get(k) is not None and k != "response_format"
                         or k == "response_format" and isinstance(data.get(k), dict)
                         and data[k].get("type") not in (None, "text")]:
                out.append(((given[0],), f"cannot be given with tool_choice {as_json(choice)}, which constrains "
                            "the output itself"))
        if data.get("top_logprobs") is not None and data.get("logprobs") is not True:
            out.append((("top_logprobs",), f'needs "logprobs": true, got "logprobs": '
                                           f'{as_json(data.get("logprobs"))}'))
        return out

    def sampling_kwargs(self) -> dict[str, Any]:
        """As :meth:`OpenAIBody.sampling_kwargs`; ``"logprobs": true`` becomes ``logprobs`` =
        ``top_logprobs`` (0 when not given)."""
        kw = super().sampling_kwargs()
        if self.logprobs:
            kw["logprobs"] = self.top_logprobs or 0
        return kw

    def prompt_payload(self) -> tuple[str, Any]:
        """("messages", [{"role", "content"[, "name"]}, ...]); text parts joined with "\\n"."""
        return MESSAGES, [m.to_template() for m in self.messages]

    def template_options(self) -> dict[str, Any]:
        """As :meth:`ChatTemplateFields.template_options`, with ``tools`` (OpenAI's shape) when given."""
        opts = super().template_options()
        if self.tools:
            opts["tools"] = [t.to_template() for t in self.tools]
        return opts


class CompletionRequest(OpenAIBody):
    """An OpenAI ``/v1/completions`` body: ``prompt`` required: a string, a list of strings, a list
    of token ids or a list of token-id lists, each list entry a prompt of its own (a server answers
    them in one response, choice ``index`` = prompt * n + sample; a batch line holds one prompt);
    ``logprobs`` an integer in [0, 20] (OpenAI's legacy completions logprobs: the top that many per
    generated token); ``echo``: the prompt comes back before the completion, its text and, with
    ``logprobs``, its tokens' logprobs (the first ``null``). With ``max_tokens`` 0 and ``echo`` the
    prompt is scored and nothing is generated (vLLM's semantics)."""

    prompt: Prompts
    logprobs: NumLogprobs | None = None
    echo: Flag | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        """As :meth:`OpenAIBody.sampling_kwargs`, with ``logprobs``; ``echo`` with ``logprobs`` k
        asks for the prompt's logprobs with at least k top tokens (``prompt_logprobs``)."""
        kw = super().sampling_kwargs()
        if self.logprobs is not None:
            kw["logprobs"] = self.logprobs
            if self.echo:
                kw["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return kw

    def prompt_payload(self) -> tuple[str, Any]:
        """("prompt", str) | ("token_ids", list[int]): the first prompt (a batch line's only one)."""
        return _prompt_payloads(self.prompt)[0]

    def prompt_payloads(self) -> list[tuple[str, Any]]:
        """Every prompt, in order, as :meth:`prompt_payload` gives one."""
        return _prompt_payloads(self.prompt)


class TokenizeCompletionRequest(ProtocolModel):
    """vLLM's ``/tokenize`` body for a prompt: ``prompt`` (a string), ``add_special_tokens``
    (default true: the tokenizer's BOS and the like, as a completions prompt gets them),
    ``return_token_strs`` (default false: also each token's string, ``convert_ids_to_tokens``)."""

    model: _Str | None = None
    prompt: _Str
    add_special_tokens: Flag | None = None
    return_token_strs: Flag | None = None


class TokenizeChatRequest(ChatTemplateFields):
    """vLLM's ``/tokenize`` body for a conversation: ``messages`` through the chat template with its
    options (:class:`~tpengine.protocol.messages.ChatTemplateFields`) and ``tools`` (OpenAI's
    shape), exactly as ``/v1/chat/completions`` tokenizes them, so ``count`` is the chat request's
    prompt tokens; ``return_token_strs`` as for a prompt; ``add_special_tokens`` only false (the
    template writes the special tokens itself)."""

    model: _Str | None = None
    messages: Messages
    tools: Annotated[list[Tool], Strict(), Valid("a list of tools", nested=True)] | None = None
    add_special_tokens: Annotated[bool, Strict(), Neutral((False,), "only false: the chat template writes the "
                                                             "special tokens itself")] | None = None
    return_token_strs: Flag | None = None

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[Problem]:
        return super().problems(data) + cls.template_problems(data, None)

    def template_options(self) -> dict[str, Any]:
        """As :meth:`ChatCompletionRequest.template_options`: the template's options and ``tools``."""
        opts = super().template_options()
        if self.tools:
            opts["tools"] = [t.to_template() for t in self.tools]
        return opts


class DetokenizeRequest(ProtocolModel):
    """vLLM's ``/detokenize`` body: ``tokens``, a list of token ids (``[]`` gives "")."""

    model: _Str | None = None
    tokens: Annotated[list[Annotated[int, Strict(), at.Ge(0)]], Strict(),
                      Valid("a list of integer token ids >= 0")]


#: The endpoint each Batch ``url`` names, and the request format of its output records.
BODY_BY_URL: dict[str, type[OpenAIBody]] = {ChatURL: ChatCompletionRequest, CompletionURL: CompletionRequest}
FORMAT_BY_URL = {ChatURL: "openai_chat", CompletionURL: "openai_completion"}


class BatchRequestLine(ProtocolModel):
    """One OpenAI Batch API input line: ``{"custom_id", "method": "POST", "url", "body"}``; the body
    is validated as the ``url``'s request (a :class:`ChatCompletionRequest` or
    :class:`CompletionRequest`); ``"stream": true`` in it is refused."""

    FIELDS: ClassVar[tuple[str, ...]] = ("custom_id", "method", "url", "body")

    custom_id: NonEmptyStr
    method: Method
    url: URL
    body: ChatCompletionRequest | CompletionRequest

    @field_validator("body", mode="wrap")
    @classmethod
    def _body_of_url(cls, v: Any, handler: Any, info: ValidationInfo) -> Any:
        model = BODY_BY_URL.get(info.data.get("url"))  # absent when the url is invalid
        if model is not None:
            return model.model_validate(v)
        if not isinstance(v, dict):
            raise invalid(f"must be an object, got {as_json(v)}")
        return v  # the line fails on its url; the body is not checked further

    @classmethod
    def problems(cls, data: dict[str, Any]) -> list[Problem]:
        body = data.get("body")
        out: list[Problem] = []
        if isinstance(body, dict) and body.get("stream") is True:
            out.append((("body", "stream"), f"{STREAM_ERROR}, got true"))
        if isinstance(body, dict) and body.get("return_tokens_as_token_ids") is True:
            out.append((("body", "return_tokens_as_token_ids"), "is served by tpengine serve only, not in a batch "
                        "job; use false or omit it"))
        if isinstance(body, dict) and data.get("url") == CompletionURL and _is_prompt_list(body.get("prompt")):
            out.append((("body", "prompt"), f"{PROMPT_LIST_ERROR}, got a list of {len(body['prompt'])} prompts"))
        return out

    @property
    def format(self) -> str:
        """The output record format: "openai_chat" | "openai_completion"."""
        return FORMAT_BY_URL[self.url]

    @staticmethod
    def is_batch_line(obj: dict[str, Any]) -> bool:
        """Whether a JSON object is meant as a Batch line (it has any of the Batch fields)."""
        return any(k in obj for k in BatchRequestLine.FIELDS)
