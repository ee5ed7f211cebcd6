"""The chat service: what a chat completion does between the route and the engine.

`service` identifies the session, picks the adapter, calls the engine and records the call;
its parts are `identity` (whose call: session, group, split), `record` (the call row, one
split per session) and `stream` (the first chunk before the response, the stream rebuilt
for the record). `passthrough` relays another protocol to an upstream that speaks it; `gate`
holds requests while a colocated trainer has the GPU. The chat form itself (the wire
models) is `gateway.protocols.chat`."""
