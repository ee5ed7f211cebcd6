"""The chat service: what a chat completion does between the route and the engine.

`service` identifies the session, picks the adapter, calls the engine and records the call;
`passthrough` relays another protocol to an upstream that speaks it; `toolcalls` turns tool
calls in model text into OpenAI `tool_calls`; `gate` holds requests while a colocated trainer
has the GPU. The chat form itself (the wire models) is `gateway.protocols.chat`."""
