"""/metrics as docs/dashboard.md lists it, and its series bounded whatever clients send."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import Metrics
from tests.helpers_upstream import openai_gateway

DOCS = Path(__file__).resolve().parent.parent / "docs" / "dashboard.md"
ROW = re.compile(r"^\| `(rlproxy_\w+)` \| (\w+) \|([^|]*)\|")


def documented() -> dict[str, tuple[str, set[str]]]:
    """The table's rows: exposed name -> (type, label names)."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        found = ROW.match(line)
        if found:
            name, kind, labels = found.groups()
            # A label is written `name`, its values after it in brackets.
            rows[name] = (kind, set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", labels))))
    return rows


def exported() -> dict[str, tuple[str, set[str]]]:
    """Every metric of a gateway's registry: exposed name -> (type, label names)."""
    metrics = Metrics()
    rows = {}
    for collector in list(metrics.registry._collector_to_names):
        kind = collector._type
        name = collector._name + ("_total" if kind == "counter" else "")
        rows[name] = (kind, set(collector._labelnames))
    return rows


def test_every_exported_metric_is_documented_with_its_type_and_labels():
    # The docs listed 12 of the 22 metrics, without labels; the others were found only by scraping.
    assert documented() == exported()


def test_every_metric_the_docs_name_is_exported():
    named = {name for doc in DOCS.parent.glob("*.md") for name in re.findall(r"\brlproxy_[a-z_]+", doc.read_text())}
    assert len(named) >= 20 and named <= set(exported())


def test_random_model_names_do_not_grow_the_metrics(upstream, tmp_path):
    # No label takes a value from a request: 200 distinct model names add no series, and each
    # call is counted once.
    def scrape(http: httpx.Client) -> tuple[int, float]:
        families = list(text_string_to_metric_families(http.get("/metrics").text))
        calls = [f for f in families if f.name == "rlproxy_chat_requests"]
        counted = sum(s.value for f in calls for s in f.samples if s.name == "rlproxy_chat_requests_total")
        return sum(len(f.samples) for f in families), counted

    with openai_gateway(upstream.url, tmp_path / "state") as (server, _), httpx.Client(base_url=server.url) as http:
        ask = {"model": "random-0", "messages": [{"role": "user", "content": "hi"}]}
        assert http.post("/v1/chat/completions", json=ask).status_code == 200  # the upstream answers any name
        series, counted = scrape(http)
        for i in range(1, 200):
            assert http.post("/v1/chat/completions", json={**ask, "model": f"random-{i}"}).status_code == 200
        assert scrape(http) == (series, counted + 199)


def test_each_call_is_counted_once_in_its_series(upstream, tmp_path):
    # An answer, an upstream 503 (retried or not), a stream the upstream cut and one the client
    # left: one count each, by outcome and stream.
    def counted(http: httpx.Client) -> dict[tuple[str, str], float]:
        families = text_string_to_metric_families(http.get("/metrics").text)
        return {
            (s.labels["status"], s.labels["stream"]): s.value
            for f in families
            if f.name == "rlproxy_chat_requests"
            for s in f.samples
            if s.name == "rlproxy_chat_requests_total"
        }

    def ask(text: str, stream: bool = False) -> dict:
        return {"model": "fake-model", "stream": stream, "messages": [{"role": "user", "content": text}]}

    with openai_gateway(upstream.url, tmp_path / "state") as (server, services):
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.post("/v1/chat/completions", json=ask("hello")).status_code == 200
            assert http.post("/v1/chat/completions", json=ask("down [[status=503]]")).status_code >= 500
            with http.stream("POST", "/v1/chat/completions", json=ask("cut [[truncate]]", True)) as reply:
                list(reply.iter_lines())  # the gateway ends the stream with an error event
            with http.stream("POST", "/v1/chat/completions", json=ask("wait [[hold]]", True)) as reply:
                assert next(reply.iter_lines()).startswith("data: ")
            expected = {("ok", "false"): 1.0, ("error", "false"): 1.0, ("error", "true"): 2.0}
            deadline = time.monotonic() + 30  # the left stream is counted once the gateway sees it gone
            while sum(counted(http).values()) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            upstream.release()
            assert counted(http) == expected


def test_a_call_refused_before_its_row_is_counted_once_by_status(upstream, tmp_path):
    # A bad body, too many choices, a bad body on another protocol: no call row, so
    # rlproxy_chat_requests_total never saw them; an upstream's 503 has its row and stays there.
    def refused(http: httpx.Client) -> dict[str, float]:
        families = text_string_to_metric_families(http.get("/metrics").text)
        return {
            s.labels["status"]: s.value
            for f in families
            if f.name == "rlproxy_chat_refused"
            for s in f.samples
            if s.name == "rlproxy_chat_refused_total"
        }

    with openai_gateway(upstream.url, tmp_path / "state") as (server, _), httpx.Client(base_url=server.url) as http:
        hello = [{"role": "user", "content": "hello"}]
        assert http.post("/v1/chat/completions", json={"model": "fake-model"}).status_code == 400
        too_many = {"model": "fake-model", "messages": hello, "n": 1000}
        assert http.post("/v1/chat/completions", json=too_many).status_code == 400
        assert http.post("/v1/responses", json={"model": "fake-model", "input": 5}).status_code == 400
        down = [{"role": "user", "content": "down [[status=503]]"}]
        assert http.post("/v1/chat/completions", json={"model": "fake-model", "messages": down}).status_code >= 500
        assert http.post("/v1/sessions/nobody/reward", json={"reward": 1.0}).status_code == 404  # no model call
        assert refused(http) == {"400": 3.0}
