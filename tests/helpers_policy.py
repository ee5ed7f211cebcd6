"""A loopback OpenAI-compatible chat server that plays a scripted policy, for the tool-agent examples.

A script is a list of steps, one per assistant turn: `call(name, **arguments)` answers with
that tool call, `say(text)` with that message, `fail(status, message)` with an error.
Scripts are keyed by a piece of the task's opening user message; a task may have several,
handed out in turn to its new conversations, so one group holds, say, a correct rollout and
a rule-breaking one. The server finds its place in a conversation from the request alone,
as a stateless model would: the step is the number of assistant turns so far, the script is
named in the first tool call's id
(`call_<script>_<step>`), so every script must open with a tool call.

`check_trajectory` reads a rollout back from the gateway and checks it against what the agent sent.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.helpers import ThreadServer


@dataclass(frozen=True)
class Step:
    tool: str | None = None  # a tool call, or
    arguments: dict | None = None
    text: str | None = None  # a message in words, or
    status: int | None = None  # an OpenAI-shaped error with this status (and `text` as its message)


def call(name: str, **arguments) -> Step:
    return Step(tool=name, arguments=arguments)


def say(text: str) -> Step:
    return Step(text=text)


def fail(status: int, message: str) -> Step:
    return Step(status=status, text=message)


class ScriptedPolicy:
    def __init__(self, scripts: dict[str, list[list[Step]]]):
        for key, options in scripts.items():
            assert all(script and script[0].tool for script in options), f"every script of {key!r} opens with a call"
        self.scripts = scripts
        self.names = {
            key: [f"{index}x{n}" for n in range(len(options))] for index, (key, options) in enumerate(scripts.items())
        }  # script names in tool call ids
        self.handed_out = {key: 0 for key in scripts}
        self.requests: list[dict] = []
        self.app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])])
        self._server: ThreadServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return self._server.url + "/v1"

    def script_of(self, messages: list[dict]) -> tuple[str, int]:
        """(task key, script index) of a conversation, from its first tool call id."""
        for message in messages:
            for tool_call in message.get("tool_calls") or []:
                name = tool_call["id"].split("_")[1]
                for key, names in self.names.items():
                    if name in names:
                        return key, names.index(name)
        raise LookupError("no scripted tool call in this conversation")

    def _task(self, messages: list[dict]) -> str:
        opening = next(m["content"] for m in messages if m["role"] == "user")
        matches = [key for key in self.scripts if key in opening]
        assert len(matches) == 1, f"no single script for the task {opening!r}"
        return matches[0]

    async def _chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(body)
        messages = body["messages"]
        step = sum(1 for m in messages if m["role"] == "assistant")
        if step == 0:
            key = self._task(messages)
            index = self.handed_out[key] % len(self.scripts[key])
            self.handed_out[key] += 1
        else:
            key, index = self.script_of(messages)
        script = self.scripts[key][index]
        if step < len(script) and script[step].status:
            return JSONResponse(
                {
                    "error": {
                        "message": script[step].text,
                        "type": "invalid_request_error",
                        "param": "messages",
                        "code": "context_length_exceeded",
                    }
                },
                status_code=script[step].status,
            )
        if step >= len(script):
            message, finish = {"role": "assistant", "content": "(the script is over)"}, "stop"
        elif script[step].tool:
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{self.names[key][index]}_{step}",
                        "type": "function",
                        "function": {"name": script[step].tool, "arguments": json.dumps(script[step].arguments)},
                    }
                ],
            }
            finish = "tool_calls"
        else:
            message, finish = {"role": "assistant", "content": script[step].text}, "stop"
        return JSONResponse(
            {
                "id": f"chatcmpl-policy-{len(self.requests)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "policy"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            }
        )

    def __enter__(self) -> ScriptedPolicy:
        self._server = ThreadServer(self.app).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.__exit__(*exc)


def check_trajectory(url: str, record: dict, script: list[Step], tool_names: list[str]) -> dict:
    """The gateway recorded every call of the rollout: each request is the conversation so far, as the
    client sent it (tool calls, then their results), and the last request plus its answer is the whole."""
    session = httpx.get(f"{url}/v1/sessions/{record['session_id']}").json()
    calls = session["calls"]
    assert [c["status"] for c in calls] == ["ok"] * len(script)
    messages = record["messages"]
    for index, recorded in enumerate(calls):
        sent = recorded["request"]["messages"]
        assert sent == messages[: len(sent)]  # as the client sent it, in order
        answer = recorded["response"]["choices"][0]["message"]
        assert {k: answer.get(k) for k in ("content", "tool_calls")} == {
            k: messages[len(sent)].get(k) for k in ("content", "tool_calls")
        }
        assert [t["function"]["name"] for t in recorded["request"]["tools"]] == tool_names
        step = script[index]
        if step.tool:  # the scripted call, then its result from the example's tools
            (tool_call,) = answer["tool_calls"]
            assert (tool_call["function"]["name"], json.loads(tool_call["function"]["arguments"])) == (
                step.tool,
                step.arguments,
            )
            result = messages[len(sent) + 1]
            assert result["role"] == "tool" and result["tool_call_id"] == tool_call["id"]
            if index + 1 < len(calls):  # the next request carries the result
                assert calls[index + 1]["request"]["messages"][len(sent) + 1] == result
        else:
            assert answer["content"] == step.text
    assert calls[-1]["request"]["messages"] + [messages[-1]] == messages
    return session
