"""The dashboard's steps page shows each step's promotion state, its decision, and why training is paused
(a real headless Chromium; in a module of its own, as the browser's module-scoped fixture asks)."""

from __future__ import annotations

import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.helpers import ThreadServer
from tests.test_dashboard import Page, browser, chromium  # noqa: F401 - the dashboard's browser fixtures
from tests.test_promotion import API_KEY, Publisher

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*tie_word_embeddings"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing"),
]


def test_the_steps_page_shows_each_state_its_decision_and_why_training_paused(tmp_path, browser):  # noqa: F811
    settings = Settings(
        engine="local", state_dir=tmp_path, poll_interval=30, api_key=API_KEY, promote="manual", max_rejections=1
    )
    publisher = Publisher(settings)
    publisher.publish(0, state="promoted")
    publisher.publish(1)
    publisher.publish(2)
    publisher.store.decide_step("agent", 1, "promoted", {"by": "api", "reason": "looked fine"})
    publisher.store.decide_step("agent", 2, "rejected", {"by": "api", "reason": "said rude things"})
    with ThreadServer(create_app(settings)) as server:
        page = Page(browser, server.url)
        try:
            page.page.goto(server.url + "/ui")
            page.page.fill("input[name=key]", API_KEY)
            page.page.click("button[type=submit]")
            page.page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            page.errors.clear()  # the login page's own 401
            page.open("/ui/steps")
            head, rows = page.page.inner_text("#steps-table thead"), page.page.locator("#steps-table tbody tr")
            assert "state" in head and "parent" in head and "decision" in head
            texts = [rows.nth(i).inner_text() for i in range(rows.count())]
            assert [t.split("\t")[2] for t in texts] == ["superseded", "promoted", "rejected"]
            assert "API: said rude things" in texts[2] and "always" in texts[0]
            assert "training is paused: 1 steps in a row" in page.page.inner_text("#training-paused")
            assert page.errors == []
        finally:
            page.close()
