"""The protocol layer: pydantic v2 models of what tpengine reads and writes.

Requests (:mod:`.requests`): :class:`SimpleRequest` (a simple JSONL line),
:class:`CompletionRequest` and :class:`ChatCompletionRequest` (OpenAI bodies, also a server's
request bodies), :class:`BatchRequestLine` (an OpenAI Batch input line); chat messages in
:mod:`.messages`, the shared sampling fields in :mod:`.sampling`, field types in :mod:`.fields`.
Records (:mod:`.records`): the output lines. Errors (:mod:`.errors`): a ``ValidationError`` as
``(field path, message)`` pairs.
"""

from tpengine.protocol.errors import field_errors, field_path
from tpengine.protocol.messages import ChatMessage, TextContentPart
from tpengine.protocol.records import (
    BatchError,
    BatchOutputLine,
    BatchResponse,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatResponseMessage,
    CompletionResponse,
    CompletionResponseChoice,
    Metrics,
    PromptTokensDetails,
    SimpleError,
    SimpleErrorRecord,
    SimpleRecord,
    SimpleUsage,
    UsageInfo,
)
from tpengine.protocol.requests import (
    STREAM_ERROR,
    BatchRequestLine,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIBody,
    SimpleRequest,
)
from tpengine.protocol.sampling import SamplingFields

__all__ = [
    "STREAM_ERROR", "BatchError", "BatchOutputLine", "BatchRequestLine", "BatchResponse", "ChatCompletionRequest",
    "ChatCompletionResponse", "ChatCompletionResponseChoice", "ChatMessage", "ChatResponseMessage",
    "CompletionRequest", "CompletionResponse", "CompletionResponseChoice", "Metrics", "OpenAIBody",
    "PromptTokensDetails", "SamplingFields", "SimpleError", "SimpleErrorRecord", "SimpleRecord", "SimpleRequest",
    "SimpleUsage", "TextContentPart", "UsageInfo", "field_errors", "field_path",
]
