"""OpenAI's Responses API (`POST /v1/responses`) in terms of chat completions.

`to_chat` turns a request (and, for `previous_response_id`, the conversation so far in
chat form) into a chat request body; `from_chat` turns the chat.completion back into a
`response` object; `ResponsesStream` re-encodes chat chunks as the documented event
sequence: `response.created`, `response.in_progress`, per output item
`response.output_item.added` ... `response.output_text.delta` /
`response.function_call_arguments.delta` ... `response.output_item.done`, then
`response.completed`. Item ids are derived from the response id, so the streamed items
and the stored response agree.
"""
