"""OpenAI's embeddings API (``POST /v1/embeddings``) as vLLM's pooling server takes it: the request
body and the response object.

``input``: a string, a list of strings, a list of token ids or a list of token-id lists (each string
or id list one input, answered as ``data[i]`` in order); ``encoding_format`` "float" (lists of
numbers) or "base64" (each embedding's float32 values, little-endian, base64-encoded: what the
``openai`` SDK asks for by default and decodes); ``dimensions`` (only a matryoshka model takes it);
``user``; vLLM's ``add_special_tokens`` (default true, as a completions prompt) and ``normalize``
(default: the server's ``--pooler-config``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import annotated_types as at
from pydantic import Strict

from tpengine.protocol.base import ProtocolModel
from tpengine.protocol.fields import Flag, Prompts, Valid
from tpengine.protocol.records import RecordModel

_Str = Annotated[str, Strict(), Valid("a string")]
#: The most inputs one body may hold (OpenAI's limit).
MAX_INPUTS = 2048


class EmbeddingRequest(ProtocolModel):
    """A ``/v1/embeddings`` body (see the module's docstring)."""

    MISSING = {"input": "is required: a string, a list of strings, a list of token ids or a list of such lists"}

    input: Prompts
    model: _Str | None = None
    encoding_format: Annotated[Literal["float", "base64"], Valid('"float" or "base64"')] | None = None
    dimensions: Annotated[int, Strict(), at.Ge(1), Valid("an integer >= 1")] | None = None
    user: _Str | None = None
    add_special_tokens: Flag | None = None
    normalize: Flag | None = None

    def inputs(self) -> list[tuple[str, str | list[int]]]:
        """Each input as ``(kind, payload)``: ``("prompt", text)`` or ``("token_ids", ids)``, in order.

        Raises:
            ValueError: more than :data:`MAX_INPUTS` inputs.
        """
        v = self.input
        if isinstance(v, str):
            items = [("prompt", v)]
        elif isinstance(v[0], str):
            items = [("prompt", s) for s in v]
        elif isinstance(v[0], list):
            items = [("token_ids", list(ids)) for ids in v]
        else:
            items = [("token_ids", list(v))]
        if len(items) > MAX_INPUTS:
            raise ValueError(f"must hold at most {MAX_INPUTS} inputs, got {len(items)}")
        return items


class EmbeddingData(RecordModel):
    """One input's embedding: ``embedding`` a list of floats, or a base64 string of its float32 bytes."""

    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingUsage(RecordModel):
    """The tokens the inputs held (an embedding generates none)."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(RecordModel):
    """OpenAI's embeddings response (``object`` "list"); ``id`` and ``created`` as vLLM adds them."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
