"""The protocol layer: pydantic v2 models of what tpengine reads and writes.

Requests (:mod:`.requests`): :class:`SimpleRequest` (a simple JSONL line),
:class:`CompletionRequest` and :class:`ChatCompletionRequest` (OpenAI bodies, also a server's
request bodies), :class:`BatchRequestLine` (an OpenAI Batch input line); chat messages in
:mod:`.messages`, the shared sampling fields in :mod:`.sampling`, field types in :mod:`.fields`.
Records (:mod:`.records`): the output lines (one entry per sample; the logprobs shapes).
Errors (:mod:`.errors`): a ``ValidationError`` as ``(field path, message)`` pairs.
"""

from tpengine.protocol.errors import field_errors, field_path
from tpengine.protocol.messages import ChatMessage, ChatTemplateFields, TextContentPart
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
    SimpleMultiRecord,
    SimpleRecord,
    SimpleSample,
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
    "ChatTemplateFields", "CompletionRequest", "CompletionResponse", "CompletionResponseChoice", "Metrics",
    "OpenAIBody", "PromptTokensDetails", "SamplingFields", "SimpleError", "SimpleErrorRecord", "SimpleMultiRecord",
    "SimpleRecord", "SimpleRequest", "SimpleSample", "SimpleUsage", "TextContentPart", "UsageInfo", "field_errors",
    "field_path"
]
