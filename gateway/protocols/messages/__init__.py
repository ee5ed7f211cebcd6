"""Anthropic's Messages API (`POST /v1/messages`) in terms of chat completions.

`to_chat`: `system` becomes a system message; content blocks `text`, `tool_use` (an
assistant tool call, `input` as JSON arguments) and `tool_result` (a `tool` message, put
before the user's own text as a chat template expects it); tools with `input_schema`
become function tools; `tool_choice` auto/any/tool/none map to auto/required/named/none.
`from_chat` gives a `message` with `text` and `tool_use` blocks and a `stop_reason`.
`MessagesStream` re-encodes chat chunks as `message_start`, `content_block_start`,
`content_block_delta` (`text_delta`, `input_json_delta`), `content_block_stop`,
`message_delta`, `message_stop`. Errors use Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`).
"""
