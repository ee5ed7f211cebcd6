"""The dashboard's first page shows each vLLM replica's state, load and step (a real headless
Chromium against a gateway with two stand-in vLLMs; in a module of its own, as the browser's
module-scoped fixture asks)."""

from __future__ import annotations

import httpx

from gateway.app import create_app
from tests.helpers import ThreadServer
from tests.helpers_vllm import fake_vllm_thread, vllm_settings, wait_until
from tests.test_dashboard import Page, browser, chromium  # noqa: F401 - the dashboard's browser fixtures

KEY = "replicas-dashboard-key-0123456789"


def test_the_first_page_shows_each_replica_and_why_one_is_down(tmp_path, browser):  # noqa: F811
    with fake_vllm_thread() as (a, _), fake_vllm_thread() as (b, _):
        settings = vllm_settings(tmp_path, vllm_url=[a.url, b.url], api_key=KEY)
        with ThreadServer(create_app(settings)) as server:
            headers = {"Authorization": f"Bearer {KEY}"}
            for i in range(6):
                reply = httpx.post(
                    server.url + "/v1/chat/completions",
                    headers={**headers, "X-Session-Id": f"s-{i}"},
                    json={"model": "agent", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2},
                    timeout=30,
                )
                assert reply.status_code == 200, reply.text
            b.server.should_exit = True  # replica 1 goes away
            b.thread.join(timeout=60)
            wait_until(
                lambda: httpx.get(server.url + "/healthz", timeout=10).json()["replicas"][1]["state"] == "down",
                what="replica 1 seen down",
            )
            page = Page(browser, server.url)
            try:
                page.page.goto(server.url + "/ui")
                page.page.fill("input[name=key]", KEY)
                page.page.click("button[type=submit]")
                page.page.wait_for_selector("#replicas-table", timeout=30_000)
                rows = page.page.locator("#replicas-table tbody tr")
                texts = [rows.nth(i).inner_text().split("\t") for i in range(rows.count())]
                assert [t[:2] for t in texts] == [["0", "ready"], ["1", "down"]]
                assert sum(int(t[3]) for t in texts) == 6  # every call counted on the replica that answered it
                assert "does not answer" in texts[1][5]  # why replica 1 is out
            finally:
                page.close()
