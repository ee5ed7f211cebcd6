"""Langfuse tracing: the real langfuse SDK against a loopback receiver, and a dead one.

The receiver accepts what the SDK posts (OTLP protobuf spans at
/api/public/otel/v1/traces, JSON scores at /api/public/scores) and decodes it, so
the tests check what Langfuse would see: one trace per session carrying the
session id, a generation per call, a score per reward and per RULER judgement.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import statistics
import threading
import time
import uuid

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.settings import Settings
from gateway.store import CallRecord
from gateway.tracing import LangfuseTracer, build_tracer, generation_fields
from tests.helpers import ThreadServer, free_port
from tests.helpers_judge import FakeJudge, judge_url
from tests.helpers_upstream import openai_gateway

SECRET = "sk-lf-" + "5ec7e7-never-log-me"


# ---------------------------------------------------------------- the receiver


def _any_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class _Receiver:
    """What a Langfuse server would receive."""

    def __init__(self):
        self.spans: list[dict] = []
        self.scores: list[dict] = []
        self.paths: list[str] = []
        self.auth: set[str] = set()
        self.changed = threading.Condition()
        self.app = Starlette(routes=[Route("/{path:path}", self._any, methods=["GET", "POST"])])

    async def _any(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        self.paths.append(path)
        self.auth.add(request.headers.get("authorization", ""))
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        if path == "/api/public/otel/v1/traces":
            export = ExportTraceServiceRequest()
            export.ParseFromString(body)
            spans = [
                {
                    "name": span.name,
                    "trace_id": span.trace_id.hex(),
                    "start": span.start_time_unix_nano,
                    "end": span.end_time_unix_nano,
                    "attributes": {a.key: _any_value(a.value) for a in span.attributes},
                }
                for resource in export.resource_spans
                for scope in resource.scope_spans
                for span in scope.spans
            ]
            with self.changed:
                self.spans.extend(spans)
                self.changed.notify_all()
            return Response(b"", media_type="application/x-protobuf")
        if path == "/api/public/scores":
            with self.changed:
                self.scores.extend(json.loads(body))
                self.changed.notify_all()
            return JSONResponse({"message": "Accepted"}, status_code=202)
        return JSONResponse({}, status_code=200)

    def wait_for(self, predicate, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate():
                left = deadline - time.monotonic()
                assert left > 0, f"not received in time; spans={len(self.spans)} scores={self.scores}"
                self.changed.wait(left)

    def generations(self, session_id: str) -> list[dict]:
        return [s for s in self.spans if s["attributes"].get("session.id") == session_id]


@pytest.fixture
def receiver():
    received = _Receiver()
    with ThreadServer(received.app) as server:
        received.url = server.url
        yield received


def _env(monkeypatch, host: str) -> None:
    # A fresh public key per test: the langfuse SDK keeps one client per key per process.
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", f"pk-lf-{uuid.uuid4().hex[:12]}")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", SECRET)
    monkeypatch.setenv("LANGFUSE_HOST", host)
    monkeypatch.setenv("LANGFUSE_FLUSH_INTERVAL", "0.2")


# ---------------------------------------------------------------- configuration


def test_no_tracer_without_the_three_variables(monkeypatch, caplog):
    for name in ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY", "LANGFUSE_HOST"):
        monkeypatch.delenv(name, raising=False)
    assert build_tracer(Settings()) is None
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", SECRET)
    assert build_tracer(Settings()) is None
    assert "LANGFUSE_PUBLIC_KEY, LANGFUSE_HOST not set" in caplog.text
    assert SECRET not in caplog.text


def _call(latency_ms: float) -> CallRecord:
    return CallRecord(
        id="req_1",
        session_id="s1",
        group_id="g1",
        split="train",
        model="agent",
        served="agent@3",
        step=3,
        engine="local",
        stream=False,
        status="ok",
        latency_ms=latency_ms,
        request={"model": "agent", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7},
        response={
            "choices": [{"message": {"role": "assistant", "content": "hello"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        },
    )


def test_a_call_becomes_a_generation_with_model_step_usage_and_latency():
    fields = generation_fields(_call(12.5))
    assert fields["input"] == [{"role": "user", "content": "hi"}]
    assert fields["output"] == {"role": "assistant", "content": "hello"}
    assert fields["model"] == "agent@3"
    assert fields["model_parameters"] == {"temperature": 0.7}
    assert fields["usage_details"] == {"input": 3, "output": 2, "total": 5}
    assert fields["metadata"]["step"] == 3 and fields["metadata"]["latency_ms"] == 12.5
    assert "level" not in fields


def test_a_generation_ends_its_latency_after_it_starts_however_slow_the_sdk():
    class Generation:
        def __init__(self) -> None:
            self.start_ns = time.time_ns()
            self.end_ns: int | None = None

        def end(self, end_time: int) -> None:
            self.end_ns = end_time

    class SlowSDK:
        """Langfuse's client as the tracer uses it, taking 5 ms to start an observation (the
        real one takes ~1 ms) and starting the span at its own clock, as the real one does."""

        generations: list[Generation] = []

        def create_trace_id(self, seed: str) -> str:
            return seed

        def start_observation(self, **fields) -> Generation:
            time.sleep(0.005)
            self.generations.append(Generation())
            return self.generations[-1]

    tracer = LangfuseTracer(public_key="pk-lf-x", secret_key=SECRET, host="http://127.0.0.1:9")
    tracer._langfuse = SlowSDK()
    tracer._send_call(_call(0.4))
    generation = SlowSDK.generations[0]
    assert generation.end_ns - generation.start_ns >= 400_000  # the measured 0.4 ms, not less, never negative


# ---------------------------------------------------------------- end to end


def test_sessions_calls_rewards_and_judgements_reach_langfuse(monkeypatch, receiver, upstream, tmp_path, caplog):
    _env(monkeypatch, receiver.url)
    port = free_port()
    judges = {"judge_model": ["openai/judge"], "judge_api_base": [judge_url(port)]}  # the judges RULER may call
    with FakeJudge(port=port) as judge, openai_gateway(upstream.url, tmp_path, **judges) as (server, services):
        assert isinstance(services.tracer, LangfuseTracer)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        sessions = ["trace-a", "trace-b"]
        for session_id in sessions:
            for turn in range(2):
                client.chat.completions.create(
                    model="fake-model",
                    messages=[{"role": "user", "content": f"{session_id} turn {turn}"}],
                    temperature=0.5,
                    extra_headers={"X-Session-Id": session_id, "X-Group-Id": "g-trace"},
                )
        httpx.post(f"{server.url}/v1/sessions/trace-a/reward", json={"reward": 0.25, "metrics": {"steps": 2}})
        ruler = httpx.post(
            f"{server.url}/v1/groups/g-trace/ruler",
            json={"judge_model": "openai/judge", "judge_api_base": judge.url},
            timeout=120,
        )
        assert ruler.status_code == 200, ruler.text

        receiver.wait_for(lambda: all(len(receiver.generations(s)) == 2 for s in sessions))
        receiver.wait_for(lambda: len(receiver.scores) == 3)

    # One trace per session: its calls share a trace id; the two sessions do not.
    trace_ids = {s: {g["trace_id"] for g in receiver.generations(s)} for s in sessions}
    assert all(len(ids) == 1 for ids in trace_ids.values())
    assert trace_ids["trace-a"] != trace_ids["trace-b"]
    generation = receiver.generations("trace-a")[0]
    attributes = generation["attributes"]
    assert attributes["langfuse.observation.type"] == "generation"
    assert attributes["langfuse.observation.model.name"] == "fake-model"
    assert json.loads(attributes["langfuse.observation.input"])[0]["content"].startswith("trace-a turn")
    assert json.loads(attributes["langfuse.observation.output"])["role"] == "assistant"
    assert json.loads(attributes["langfuse.observation.usage_details"])["input"] >= 1
    assert json.loads(attributes["langfuse.observation.model.parameters"])["temperature"] == 0.5
    assert "langfuse.observation.metadata.latency_ms" in attributes
    assert json.loads(attributes["langfuse.observation.metadata.group_id"]) == "g-trace"
    assert attributes["session.id"] == "trace-a"
    assert generation["end"] > generation["start"]

    (trace_a,) = trace_ids["trace-a"]
    (trace_b,) = trace_ids["trace-b"]
    reward = next(s for s in receiver.scores if s["name"] == "reward")
    assert reward["traceId"] == trace_a and reward["value"] == 0.25 and reward["metadata"] == {"steps": 2}
    ruler_scores = {s["traceId"]: s for s in receiver.scores if s["name"] == "ruler"}
    assert set(ruler_scores) == {trace_a, trace_b}
    assert ruler_scores[trace_a]["comment"].startswith("trajectory")
    assert ruler_scores[trace_a]["metadata"]["group_id"] == "g-trace"

    # The keys go to Langfuse (basic auth), nowhere else.
    assert any(auth.startswith("Basic ") for auth in receiver.auth)
    assert SECRET not in caplog.text


# ---------------------------------------------------------------- Langfuse down or slow


def _latencies(server_url: str, n: int, session_id: str) -> list[float]:
    client = openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)
    latencies = []
    for i in range(n):
        started = time.perf_counter()
        client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": f"ping {i}"}],
            extra_headers={"X-Session-Id": session_id},
        )
        latencies.append(time.perf_counter() - started)
    client.close()
    return latencies


def test_a_dead_langfuse_neither_fails_nor_delays_requests(monkeypatch, upstream, tmp_path):
    for name in ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY", "LANGFUSE_HOST"):
        monkeypatch.delenv(name, raising=False)
    with openai_gateway(upstream.url, tmp_path / "plain") as (server, services):
        assert services.tracer is None
        _latencies(server.url, 5, "warm-up")
        baseline = statistics.median(_latencies(server.url, 30, "plain"))

    _env(monkeypatch, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with openai_gateway(upstream.url, tmp_path / "dead") as (server, services):
        _latencies(server.url, 5, "warm-up")
        dead = statistics.median(_latencies(server.url, 30, "dead"))
        httpx.post(f"{server.url}/v1/sessions/dead/reward", json={"reward": 1.0}).raise_for_status()
        tracer = services.tracer
        # Every event was handed over: the tracer took them and the SDK swallowed the failures.
        deadline = time.monotonic() + 30
        while tracer.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tracer.pending() == 0 and tracer.dropped == 0
    print(f"median latency: no tracing {baseline * 1000:.2f} ms, Langfuse down {dead * 1000:.2f} ms")
    # Generous on purpose (2 shared CPUs): catches a request that waits on Langfuse, not noise.
    assert dead < 3 * baseline + 0.05


def test_a_stalled_langfuse_holds_no_request(monkeypatch, upstream, tmp_path):
    """Langfuse accepts the connection and never answers: requests go on regardless."""

    stalled = threading.Event()
    released = threading.Event()

    async def hang(request: Request) -> Response:
        stalled.set()
        while not released.is_set():
            await asyncio.sleep(0.05)
        return JSONResponse({}, status_code=503)

    app = Starlette(routes=[Route("/{path:path}", hang, methods=["GET", "POST"])])
    with ThreadServer(app) as langfuse:
        _env(monkeypatch, langfuse.url)
        with openai_gateway(upstream.url, tmp_path) as (server, services):
            _latencies(server.url, 1, "first")  # its span is exported and the export hangs
            assert stalled.wait(30)
            assert len(_latencies(server.url, 20, "while-stalled")) == 20
            httpx.post(f"{server.url}/v1/sessions/while-stalled/reward", json={"reward": 1.0}).raise_for_status()
            assert not released.is_set()  # all of that happened while Langfuse still held its request
            langfuse.server.should_exit = True  # let the gateway's shutdown find it gone
            released.set()
