"""Sessions in the base URL, for clients that can set a base URL and a key but no headers.

`{gateway}/sessions/{sid}/v1/...`, `{gateway}/groups/{gid}/sessions/{sid}/v1/...` and
`{gateway}/tasks/{task}/sessions/{sid}/v1/...` are the routes under `/v1/...` with
`X-Session-Id` (and `X-Group-Id`, or `X-Task-Id`) set from the path;
headers the client did send win. The `/v1` may be left out (`/sessions/{sid}/messages`)
for clients such as Anthropic's that are given a base URL without it and add their own.
A pure rewrite of the ASGI scope, done before routing, so every route (the chat fast path
too) sees a plain request.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from starlette.types import Scope

_PATTERN = re.compile(
    r"^(?:/groups/(?P<group>[^/]+)|/tasks/(?P<task>[^/]+))?/sessions/(?P<session>[^/]+)(?P<rest>/.*)?$"
)


def rewrite(scope: Scope) -> Scope:
    """The scope with the session prefix taken off its path and put into headers, or `scope`
    itself when its path has no such prefix."""
    path = scope["path"]
    if not path.startswith(("/sessions/", "/groups/", "/tasks/")):
        return scope
    match = _PATTERN.match(path)
    if match is None:
        return scope
    rest = match["rest"] or "/"
    if rest != "/v1" and not rest.startswith("/v1/"):
        rest = "/v1" + rest
    headers = list(scope["headers"])
    present = {name for name, _ in headers}
    # The ids are checked where every session id is (gateway.chat.service.identify): a bad one is a 400.
    if b"x-session-id" not in present:
        headers.append((b"x-session-id", unquote(match["session"]).encode()))
    if match["group"] is not None and b"x-group-id" not in present:
        headers.append((b"x-group-id", unquote(match["group"]).encode()))
    if match["task"] is not None and b"x-task-id" not in present:
        headers.append((b"x-task-id", unquote(match["task"]).encode()))
    return {**scope, "path": rest, "raw_path": rest.encode(), "headers": headers}
