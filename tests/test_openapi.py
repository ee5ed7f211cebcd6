"""`/openapi.json` documents the whole API, chat completions included, and schemathesis
fuzzes every operation of it against a running gateway (seeded, a bounded number of cases):
no server error, and no status, content type or body outside what the document says."""

from __future__ import annotations

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis import checks

from tests.helpers_upstream import openai_gateway

CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    with openai_gateway(upstream.url, tmp_path_factory.mktemp("openapi")) as (server, services):
        # Something to find for the GET routes: a session in a group, with a reward.
        httpx.post(
            server.url + "/v1/chat/completions",
            headers={"X-Session-Id": "s1", "X-Group-Id": "g1"},
            json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
        ).raise_for_status()
        httpx.post(server.url + "/v1/sessions/s1/reward", json={"reward": 1.0}).raise_for_status()
        yield server


@pytest.fixture(scope="module")
def api_schema(gateway):
    return schemathesis.openapi.from_url(gateway.url + "/openapi.json")


def test_chat_completions_is_documented_with_its_request_schema(gateway):
    spec = httpx.get(gateway.url + "/openapi.json").json()
    operation = spec["paths"]["/v1/chat/completions"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    request = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "model"} <= set(request["required"])
    assert {"stream", "n", "tools", "logprobs", "temperature"} <= set(request["properties"])
    assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"400", "413", "503", "507"} <= set(operation["responses"])
    # The other routes' bodies too, and OpenAI's error shape instead of FastAPI's 422.
    reward = spec["paths"]["/v1/sessions/{session_id}/reward"]["post"]
    assert reward["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/RewardRequest")
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            assert "422" not in op["responses"], (method, path)
            assert any(status.startswith("2") for status in op["responses"]), (method, path)


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.mark.timeout(600)
@schema.parametrize()
@hypothesis.settings(
    max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(hypothesis.HealthCheck)
)
def test_api_conforms_to_its_schema(case):
    case.call_and_validate(checks=CHECKS, timeout=60)
