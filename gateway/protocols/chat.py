"""The internal form: OpenAI Chat Completions. Its wire models live in `gateway.protocol`
(the hot path imports them from there); this module names them for the package."""

from gateway.protocol import ChatCompletionRequest, ChatMessage, ToolCall, ToolDefinition  # noqa: F401
