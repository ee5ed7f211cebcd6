"""`/openapi.json`: the whole API, request bodies and responses included.

The routes read their bodies themselves (so the messages of errors are ours, and chat
completions is a bare ASGI fast path FastAPI never sees), so FastAPI's own schema knows
neither their request bodies nor their answers. `install_openapi` adds them from the same
pydantic models the routes validate with, documents every error status the gateway answers
with in OpenAI's error shape (400 where FastAPI would say 422), and is what API fuzzers and
client generators read (tests/test_openapi.py runs schemathesis against it).

Routes this table does not know (added later) still get the error responses; their own
request and response schemas come from their FastAPI signature or `openapi_extra`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from gateway.protocols.chat import (
    ChatCompletionRequest,
    DiscardRequest,
    GroupCloseRequest,
    RewardRequest,
    RulerRequest,
    StepDecisionRequest,
    TriggerRequest,
)
from gateway.protocols.completions.wire import CompletionRequest
from gateway.protocols.messages.wire import CountTokensRequest, MessagesRequest
from gateway.protocols.responses.wire import ResponsesRequest

_REF = "#/components/schemas/{model}"
_NUMBER = {"type": "number"}
_STRING = {"type": "string"}
_NULLABLE_STRING = {"type": ["string", "null"]}
_NULLABLE_INT = {"type": ["integer", "null"]}


def _object(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict:
    return {"type": "object", "required": list(required), "properties": {**required, **(optional or {})}}


def _ref(name: str) -> dict:
    return {"$ref": _REF.format(model=name)}


# Shapes of what the routes answer: the keys a client can count on (more may come).
RESPONSE_SCHEMAS: dict[str, dict] = {
    "Error": _object(
        {"error": _object({"message": _STRING, "type": _STRING}, {"param": _NULLABLE_STRING, "code": _NULLABLE_STRING})}
    ),
    # One event of the Responses, Messages or legacy completions stream: `event` names it (Responses
    # and Messages), `data` is its JSON as the protocol documents it.
    "ServerSentEvent": {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    },
    # /v1/messages answers errors as Anthropic documents them
    "AnthropicError": _object({"type": {"const": "error"}, "error": _object({"type": _STRING, "message": _STRING})}),
    "MessageTokensCount": _object({"input_tokens": {"type": "integer"}}),
    "ChatCompletion": _object(
        {
            "id": _STRING,
            "object": {"const": "chat.completion"},
            "created": {"type": "integer"},
            "model": _STRING,
            "choices": {
                "type": "array",
                "items": _object(
                    {"index": {"type": "integer"}, "message": {"type": "object"}}, {"finish_reason": _NULLABLE_STRING}
                ),
            },
        },
        {"usage": {"type": ["object", "null"]}},
    ),
    # One server-sent event: `data` is a chat.completion.chunk as JSON, then `[DONE]` once the
    # call is recorded; an error after the first chunk comes as `{"error": {...}}` (and no `[DONE]`).
    "ChatCompletionStream": {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
        "description": "server-sent events: `data: {chat.completion.chunk}` lines, then "
        "`data: [DONE]` once the call is recorded",
    },
    "Model": _object(
        {"id": _STRING, "object": {"const": "model"}}, {"created": {"type": "integer"}, "owned_by": _STRING}
    ),
    "ModelList": _object(
        {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": _object(
                    {"id": _STRING, "object": {"const": "model"}}, {"created": {"type": "integer"}, "owned_by": _STRING}
                ),
            },
        }
    ),
    "Call": _object(
        {
            "id": _STRING,
            "session_id": _STRING,
            "status": _STRING,
            "http_status": {"type": "integer"},
            "request": {"type": "object"},
        },
        {
            "response": {"type": ["object", "null"]},
            "step": _NULLABLE_INT,
            "prompt_ids": {"type": ["array", "null"]},
            "completion_ids": {"type": ["array", "null"]},
            "behaviour_logprobs": {"type": ["array", "null"]},
            "sampling": {"type": ["object", "null"]},
            "protocol": _STRING,
        },
    ),
    "Session": _object(
        {
            "id": _STRING,
            "split": _STRING,
            "model": _STRING,
            "n_calls": {"type": "integer"},
            "discarded": {"type": "boolean"},
            "metrics": {"type": "object"},
        },
        {
            "group_id": _NULLABLE_STRING,
            "reward": {"type": ["number", "null"]},
            "calls": {"type": "array", "items": _ref("Call")},
        },
    ),
    "Group": _object(
        {
            "id": _STRING,
            "model": _STRING,
            "split": _STRING,
            "closed": {"type": "boolean"},
            "ready": {"type": "boolean"},
            "n_sessions": {"type": "integer"},
            "n_rewarded": {"type": "integer"},
            "sessions": {"type": "array", "items": _ref("Session")},
            "judgements": {"type": "array"},
        },
        {
            "expected_sessions": _NULLABLE_INT,
            "trained_step": _NULLABLE_INT,
            "skipped": _NULLABLE_STRING,
            "ruler_status": _NULLABLE_STRING,
        },
    ),
    "RewardResult": _object({"session_id": _STRING, "reward": _NUMBER, "metrics": {"type": "object"}}),
    "StepList": _object(
        {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": _object(
                    {
                        "model": _STRING,
                        "step": {"type": "integer"},
                        "metrics": {"type": "object"},
                        "groups": {"type": "array"},
                        "state": {"enum": ["candidate", "promoted", "superseded", "rejected", "rolled_back"]},
                        "parent": _NULLABLE_INT,
                        "decision": {"type": ["object", "null"]},
                    }
                ),
            },
        }
    ),
    "StepDecision": _object(
        {"model": _STRING, "step": {"type": "integer"}, "state": _STRING, "decision": {"type": "object"}}
    ),
    "Resumed": _object({"model": _STRING, "status": {"const": "resumed"}, "cleared": {"type": "integer"}}),
    "TriggerResult": _object({"model": _STRING, "trigger_id": {"type": "integer"}, "status": {"const": "requested"}}),
    "RulerResult": _object(
        {
            "group_id": _STRING,
            "judge_model": _STRING,
            "status": _STRING,
            "scores": {
                "type": "array",
                "items": _object({"session_id": _STRING, "score": _NUMBER}, {"explanation": _NULLABLE_STRING}),
            },
        }
    ),
    "Health": _object(
        {"status": {"enum": ["ok", "degraded", "loading"]}, "engine": _STRING, "model": _STRING},
        {"step": _NULLABLE_INT, "reason": _STRING, "store": {"type": "object"}},
    ),
}

_ERRORS = {
    "400": "the request is not valid: the message says what to fix",
    "401": "missing or wrong API key (when the gateway runs with --api-key)",
    "403": "sent by a web page whose Origin is neither the gateway's own nor one of --cors-origin",
    "404": "no such session, group, model or adapter (count_tokens: an engine with no tokenizer)",
    "405": "DELETE /v1/responses/{id}: a response of this gateway is a session's training data, not deleted",
    "409": "the request conflicts with the state (e.g. discarding a trained session)",
    "413": "the body is over --max-body-mb",
    "415": "a write whose Content-Type is not application/json (an empty body included)",
    "502": "the model upstream failed",
    "503": "the store cannot record (read-only, locked, unavailable) or the engine is not ready; retry later",
    "504": "the model upstream timed out",
    "507": "the disk holding the store is full",
}

# (method, path) -> (request body model or None, body required, {status: (description, media, schema name)})
_JSON = "application/json"
ROUTES: dict[tuple[str, str], tuple[type[BaseModel] | None, bool, dict[str, tuple[str, str, str]]]] = {
    ("post", "/v1/chat/completions"): (
        ChatCompletionRequest,
        True,
        {"200": ("the completion (a stream of server-sent events when `stream` is true)", _JSON, "ChatCompletion")},
    ),
    # The other protocols: their 200 as FastAPI documents it (the protocol's own object).
    ("post", "/v1/responses"): (ResponsesRequest, True, {}),
    ("post", "/v1/messages"): (MessagesRequest, True, {}),
    ("post", "/v1/messages/count_tokens"): (
        CountTokensRequest,
        True,
        {"200": ("its input tokens", _JSON, "MessageTokensCount")},
    ),
    ("post", "/v1/completions"): (CompletionRequest, True, {}),
    ("get", "/v1/models"): (None, False, {"200": ("the models served", _JSON, "ModelList")}),
    ("get", "/v1/models/{model}"): (None, False, {"200": ("one of the models served", _JSON, "Model")}),
    ("post", "/v1/sessions/{session_id}/reward"): (
        RewardRequest,
        True,
        {"200": ("the session's reward and merged metrics", _JSON, "RewardResult")},
    ),
    ("post", "/v1/sessions/{session_id}/discard"): (
        DiscardRequest,
        False,
        {"200": ("the session, now discarded", _JSON, "Session")},
    ),
    ("get", "/v1/sessions/{session_id}"): (None, False, {"200": ("the recorded trajectory", _JSON, "Session")}),
    ("post", "/v1/groups/{group_id}/close"): (GroupCloseRequest, False, {"200": ("the group", _JSON, "Group")}),
    ("get", "/v1/groups/{group_id}"): (None, False, {"200": ("the group", _JSON, "Group")}),
    ("post", "/v1/groups/{group_id}/ruler"): (
        RulerRequest,
        True,
        {"200": ("the judge's scores, now the sessions' rewards", _JSON, "RulerResult")},
    ),
    ("get", "/v1/training/steps"): (None, False, {"200": ("the training steps", _JSON, "StepList")}),
    ("post", "/v1/training/steps/{step}/promote"): (
        StepDecisionRequest,
        True,
        {"200": ("the step, promoted: NAME serves it (admin; 409 if decided already)", _JSON, "StepDecision")},
    ),
    ("post", "/v1/training/steps/{step}/reject"): (
        StepDecisionRequest,
        True,
        {"200": ("the step, rejected: NAME keeps its step (admin; 409 if decided already)", _JSON, "StepDecision")},
    ),
    ("post", "/v1/training/resume"): (None, False, {"200": ("paused training goes on (admin)", _JSON, "Resumed")}),
    ("post", "/v1/training/trigger"): (
        TriggerRequest,
        False,
        {"202": ("a step was asked for", _JSON, "TriggerResult")},
    ),
    ("get", "/healthz"): (
        None,
        False,
        {
            "200": ("serving", _JSON, "Health"),
            "503": (
                "degraded: the store cannot record or the engine cannot serve; loading: NAME waits for its "
                "--init-from step 0 (see `reason`)",
                _JSON,
                "Health",
            ),
        },
    ),
    ("get", "/metrics"): (None, False, {"200": ("Prometheus metrics", "text/plain", "")}),
}
# Statuses each route may answer beyond its own (the request id, auth and body-limit stack
# answers 401 and 413 everywhere).
_ROUTE_ERRORS = {
    ("post", "/v1/chat/completions"): ("400", "401", "404", "413", "502", "503", "504", "507"),
    ("get", "/healthz"): ("413",),
    ("post", "/v1/messages/count_tokens"): ("400", "401", "404", "413", "502", "503", "504"),
    ("delete", "/v1/responses/{response_id}"): ("401", "404", "405", "413", "502", "503", "504"),
}
_MODEL_CALL_ERRORS = ("400", "401", "404", "409", "413", "502", "503", "504", "507")
for _protocol_path in ("/v1/responses", "/v1/messages", "/v1/completions"):
    _ROUTE_ERRORS[("post", _protocol_path)] = _MODEL_CALL_ERRORS
# The routes that answer a server-sent event stream when the body says `stream: true`.
_STREAMING_PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions")
_DEFAULT_ERRORS = ("400", "401", "404", "409", "413", "503", "507")
_PATH_ID = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"}
# What the models' validators check beyond their fields' types, said in JSON Schema so that
# generated clients and fuzzers know it too.
_CONSTRAINTS = {
    "ChatMessage": {
        "allOf": [
            {
                "if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
                "then": {
                    "required": ["tool_call_id"],
                    "properties": {"tool_call_id": {"type": "string", "minLength": 1}},
                },
            },
            {
                "if": {"properties": {"role": {"enum": ["system", "developer", "user"]}}, "required": ["role"]},
                "then": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
            },
        ]
    },
    "ChatCompletionRequest": {
        "allOf": [
            {
                "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}}, "required": ["top_logprobs"]},
                "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
            },
        ]
    },
}


def _model_schema(model: type[BaseModel], components: dict) -> dict:
    schema = model.model_json_schema(ref_template=_REF, mode="validation")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    for name, extra in _CONSTRAINTS.items():
        if name in components:
            components[name].update(extra)
    return _ref(model.__name__)


def build_openapi(app: FastAPI) -> dict:
    spec = get_openapi(
        title=app.title,
        version=app.version,
        routes=app.routes,
        description="OpenAI-compatible gateway that records agent traffic and trains the model it "
        'serves. Errors use OpenAI\'s shape `{"error": {message, type, param, code}}`.',
    )
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components.update(RESPONSE_SCHEMAS)
    paths = spec.setdefault("paths", {})
    paths.setdefault("/v1/chat/completions", {})["post"] = {
        "summary": "Chat Completions",
        "operationId": "chat_completions",
        "description": "OpenAI's chat completions; every call is recorded. Session, group, task and split "
        "from the `X-Session-Id`, `X-Group-Id`, `X-Task-Id`, `X-Split` headers or the body's `metadata` "
        "(`session_id`, `group_id`, `task_id`, `split`). A session without a group is recorded under a "
        "task key (`X-Task-Id`, else one derived from its system prompt) that live groups are formed by.",
    }
    for path, operations in paths.items():
        for method, operation in operations.items():
            model, required, answers = ROUTES.get((method, path), (None, False, {}))
            if model is not None:
                operation["requestBody"] = {
                    "required": required,
                    "content": {_JSON: {"schema": _model_schema(model, components)}},
                }
            for parameter in operation.get("parameters", []):
                if parameter.get("in") == "path" and parameter["name"].endswith("_id"):
                    parameter["schema"] = dict(_PATH_ID)
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if answers:
                for status in [s for s in responses if s.startswith("2")]:
                    responses.pop(status)
            for status, (description, media, schema_name) in answers.items():
                content = {media: {"schema": _ref(schema_name) if schema_name else {"type": "string"}}}
                responses[status] = {"description": description, "content": content}
            if method == "post" and path in _STREAMING_PATHS:
                for status in [s for s in responses if s.startswith("2")]:
                    responses[status].setdefault("content", {})["text/event-stream"] = {
                        "schema": _ref("ChatCompletionStream")
                        if path == "/v1/chat/completions"
                        else _ref("ServerSentEvent")
                    }
            error_schema = _ref("AnthropicError") if path.startswith("/v1/messages") else _ref("Error")
            # What the browser guard (gateway/http/browsers.py) answers in front of every route.
            edge = ("403", "415") if method == "post" else ("403",)
            for status in (*_ROUTE_ERRORS.get((method, path), _DEFAULT_ERRORS), *edge):
                responses.setdefault(
                    status, {"description": _ERRORS[status], "content": {_JSON: {"schema": error_schema}}}
                )
    return spec


def install_openapi(app: FastAPI) -> None:
    """Serve `build_openapi(app)` at /openapi.json (built once, on first request)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi
