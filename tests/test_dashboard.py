"""The dashboard in a real headless Chromium, against a gateway holding real recorded data:
a short `rlproxy demo` run (its trainer reporting to wandb offline) plus a tool-using
session recorded through the gateway.

Set RLPROXY_UPDATE_SCREENSHOT=1 to rewrite docs/dashboard.png (the README's picture)."""

from __future__ import annotations

import asyncio
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gateway.store import CallRecord, LiveRule
from gateway.store.sqlite import SQLiteStore
from gateway.ui.auth import cookie_name
from tests.browser import find_or_install_chromium
from tests.fake_upstream import FakeUpstream
from tests.helpers import gateway_process
from tests.helpers_vllm import wait_until
from tests.test_demo import run_demo
from tests.wandb_records import history
from trainer.data import NO_SAMPLE, too_few

ROOT = Path(__file__).resolve().parents[1]
KEY = "dashboard-test-key-0123456789"
XSS = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'
# The README's picture is taken on a longer run (RLPROXY_UPDATE_SCREENSHOT=1) than CI's.
STEPS = 6 if os.environ.get("RLPROXY_UPDATE_SCREENSHOT") else 2


@pytest.fixture(scope="module")
def chromium() -> str:
    path, why = find_or_install_chromium()
    if path is None:
        pytest.skip(why)
    return path


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    """A short demo run's store, plus one tool-using session and one with markup in it."""
    tmp = tmp_path_factory.mktemp("dashboard")
    out = tmp / "demo"
    env_before = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_DIR", "WANDB_SILENT")}
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(tmp), WANDB_SILENT="true")
    try:
        result = run_demo(
            out,
            "--steps",
            str(STEPS),
            "--rollouts",
            "4",
            "--groups-per-step",
            "2",
            "--eval-groups",
            "1",
            "--max-tokens",
            "4",
            "--seed",
            "1",
            "--report-to",
            "wandb",
        )
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert result.returncode == 0, result.stderr[-3000:]
    state = out / "state"

    # The tool-using session: an upstream that answers with a tool call, recorded into the same store.
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    headers = {"X-Session-Id": "tool-session", "X-Group-Id": "tool-group", "X-Split": "train"}
    with (
        FakeUpstream() as upstream,
        gateway_process(
            ["--state-dir", str(state), "--engine", "openai", "--upstream-url", upstream.url, "--trainer", "off"]
        ) as (_, url),
    ):
        with httpx.Client(base_url=url, timeout=30) as http:
            messages = [
                {"role": "system", "content": "You answer with the weather."},
                {"role": "user", "content": "Weather in Paris? [[tool_call]]"},
            ]
            first = http.post(
                "/v1/chat/completions", headers=headers, json={"model": "agent", "messages": messages, "tools": tools}
            )
            first.raise_for_status()
            reply = first.json()["choices"][0]["message"]
            assert reply["tool_calls"], reply
            call_id = reply["tool_calls"][0]["id"]
            messages += [
                {"role": "assistant", "content": reply.get("content"), "tool_calls": reply["tool_calls"]},
                {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21 degrees in Paris"},
            ]
            http.post(
                "/v1/chat/completions", headers=headers, json={"model": "agent", "messages": messages, "tools": tools}
            ).raise_for_status()
            http.post(
                "/v1/sessions/tool-session/reward", json={"reward": 0.75, "metrics": {"tool_calls": 1.0}}
            ).raise_for_status()
            http.post("/v1/groups/tool-group/close", json={}).raise_for_status()
            xss_headers = {"X-Session-Id": "markup-session", "X-Group-Id": "tool-group"}
            http.post(
                "/v1/chat/completions",
                headers=xss_headers,
                json={"model": "agent", "messages": [{"role": "user", "content": XSS}]},
            ).raise_for_status()
            http.post("/v1/sessions/markup-session/reward", json={"reward": 0.0}).raise_for_status()
    # As a trainer sets a group aside when one of its two sessions has nothing to train on.
    store = SQLiteStore(state / "rlproxy.db")
    store.mark_skipped(["tool-group"], too_few(1, 2), {"markup-session": NO_SAMPLE})
    asyncio.run(store.close())
    return {"state": state, "tool_call_id": call_id, "wandb_dir": tmp / "wandb"}


@pytest.fixture(scope="module")
def dashboard(recorded):
    with gateway_process(["--state-dir", str(recorded["state"]), "--api-key", KEY, "--trainer", "off"]) as (_, url):
        yield url


@pytest.fixture(scope="module")
def browser(chromium):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        yield browser
        browser.close()


class Page:
    """A signed-in page that records console errors and uncaught exceptions."""

    def __init__(self, browser, url: str):
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.url = url

    def open(self, path: str):
        response = self.page.goto(self.url + path)
        self.page.wait_for_selector("body[data-ready='1']", timeout=30_000)
        return response

    def wait_until(self, expression: str, timeout_s: float = 30.0) -> None:
        """Poll a JS expression until it holds. Not Playwright's wait_for_function: that one
        evaluates its string with eval() inside the page, which our CSP (script-src 'self')
        forbids once the first check fails and it starts polling."""
        wait_until(lambda: self._holds(expression), timeout=timeout_s, what=expression)

    def _holds(self, expression: str) -> bool:
        from playwright.sync_api import Error

        try:
            return bool(self.page.evaluate(expression))
        except Error as e:  # a form submit navigated away mid-evaluation: ask again
            if "context was destroyed" not in str(e):
                raise
            return False

    def close(self) -> None:
        self.context.close()


def api(url: str, path: str) -> dict:
    response = httpx.get(url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    response.raise_for_status()
    return response.json()


def test_without_the_key_the_pages_and_their_json_are_refused(dashboard, browser):
    page = Page(browser, dashboard)
    try:
        for path in ("/ui", "/ui/steps", "/ui/groups/tool-group", "/ui/sessions/tool-session"):
            response = page.page.goto(dashboard + path)
            assert response.status == 401, path
            assert page.page.locator("input[name=key]").count() == 1  # the login form instead
            assert "Sunny" not in page.page.content() and "tool-session" not in page.page.inner_text("body")
        for path in ("/v1/dashboard", "/v1/sessions", "/v1/groups", "/v1/sessions/tool-session/tokens"):
            assert httpx.get(dashboard + path).status_code == 401, path
        # A wrong key is refused, and not echoed.
        page.page.goto(dashboard + "/ui")
        page.page.fill("input[name=key]", "wrong-key-123")
        page.page.click("button[type=submit]")
        assert "does not match" in page.page.inner_text("body")
        assert "wrong-key-123" not in page.page.content()
        # The cookie never authorizes a write: a posted reward still needs the bearer key.
        cookie = cookie_name(KEY)
        token = httpx.post(dashboard + "/ui/login", data={"key": KEY, "next": "/ui"}).cookies.get(cookie)
        assert token and KEY not in token
        response = httpx.post(
            dashboard + "/v1/sessions/tool-session/reward", json={"reward": 0.0}, cookies={cookie: token}
        )
        assert response.status_code == 401
        assert httpx.get(dashboard + "/v1/sessions", cookies={cookie: token}).status_code == 200
    finally:
        page.close()


def sign_in(browser, url: str) -> Page:
    page = Page(browser, url)
    page.page.goto(url + "/ui")
    page.page.fill("input[name=key]", KEY)
    page.page.click("button[type=submit]")
    page.page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    [cookie] = page.context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and KEY not in cookie["value"]
    assert KEY not in page.page.url and KEY not in page.page.content()
    page.errors.clear()  # the refused page before signing in logs its 401
    return page


def test_overview_curve_has_one_point_per_step(dashboard, browser):
    page = sign_in(browser, dashboard)
    try:
        steps = [s["step"] for s in api(dashboard, "/v1/training/steps")["data"]]
        assert steps == list(range(STEPS + 1))
        page.wait_until("window.rlproxy?.charts?.reward !== undefined")
        xs = page.page.evaluate("window.rlproxy.charts.reward.data[0]")
        assert xs == steps
        train = page.page.evaluate("window.rlproxy.charts.reward.data[1]")
        val = page.page.evaluate("window.rlproxy.charts.reward.data[2]")
        curve = api(dashboard, "/v1/dashboard")["reward_curve"]
        for split, series in (("train", train), ("val", val)):
            expected = {r["step"]: r["mean"] for r in curve if r["split"] == split}
            assert expected, split
            assert {s: v for s, v in zip(xs, series, strict=False) if v is not None} == pytest.approx(expected)
        assert 0 in {r["step"] for r in curve if r["split"] == "val"}  # the demo's baseline evaluation
        assert page.page.locator("#curve-data tbody tr").count() == len(steps)
        text = page.page.inner_text("#cards")
        assert "agent" in text and "local" in text and str(STEPS) in text
        assert page.page.locator("#metric-loss canvas").count() == 1  # training metrics beside the curve
        page.page.locator("#curve-data").evaluate("d => d.open = false")
        shot = page.page.screenshot(full_page=False)
        assert shot[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("RLPROXY_UPDATE_SCREENSHOT"):
            (ROOT / "docs").mkdir(exist_ok=True)
            (ROOT / "docs" / "dashboard.png").write_bytes(shot)
        assert page.errors == []
    finally:
        page.close()


def test_the_kl_to_the_base_is_shown_at_every_step(dashboard, browser):
    """Issue 39: the demo trains with no KL penalty (beta 0) and the KL to the base is measured at
    every step all the same: in the JSON the dashboard reads, its curve and the curve data's column."""
    kl = {s["step"]: s["metrics"]["kl"] for s in api(dashboard, "/v1/dashboard")["steps"] if s["step"] > 0}
    assert list(kl) == list(range(1, STEPS + 1)) and all(isinstance(v, float) and v >= 0 for v in kl.values())
    assert kl[STEPS] > 0  # step 1 moved the adapter off the base
    listed = {s["step"]: s["metrics"].get("kl") for s in api(dashboard, "/v1/training/steps")["data"]}
    assert {step: listed[step] for step in kl} == kl
    page = sign_in(browser, dashboard)
    try:
        page.wait_until("window.rlproxy?.charts?.kl !== undefined")
        xs, ys = page.page.evaluate("window.rlproxy.charts.kl.data")
        assert {x: y for x, y in zip(xs, ys, strict=True) if y is not None} == pytest.approx(kl)
        headers = page.page.locator("#curve-data thead th").all_text_contents()  # the table is folded
        cells = page.page.locator(f"#curve-data tbody tr:nth-child({STEPS + 1}) td").all_text_contents()
        assert float(cells[headers.index("KL")]) == pytest.approx(kl[STEPS], rel=1e-2)
        assert page.errors == []
    finally:
        page.close()


def test_steps_page_lists_every_step_with_its_groups(dashboard, browser):
    page = sign_in(browser, dashboard)
    try:
        page.open("/ui/steps")
        steps = api(dashboard, "/v1/training/steps")["data"]
        rows = page.page.locator("#steps-table tbody tr")
        assert "objective" in page.page.inner_text("#steps-table thead")
        assert "grpo" in page.page.inner_text("#steps-table")
        assert rows.count() == len(steps) == STEPS + 1
        trained = [g for s in steps for g in s["groups"]]
        assert trained and page.page.locator("#steps-table a").count() == len(trained)
        page.page.click(f"#steps-table a:text-is('{trained[0]}')")
        page.page.wait_for_selector("body[data-ready='1']")
        assert page.page.url.endswith(f"/ui/groups/{trained[0]}")
        group = api(dashboard, f"/v1/groups/{trained[0]}")
        cards = page.page.locator("#sessions .session")
        assert cards.count() == len(group["sessions"]) == 4
        for session in group["sessions"]:
            assert session["id"] in page.page.inner_text("#sessions")
        assert f"trained at step {group['trained_step']}" in page.page.inner_text("#content")
        # each session trained with its advantage, over exactly the group's sessions: they sum to zero
        advantages = [session["advantage"] for session in group["sessions"]]
        assert None not in advantages and sum(advantages) == pytest.approx(0.0, abs=1e-6)
        assert page.page.inner_text("#sessions").count("advantage ") == 4
        assert page.errors == []
    finally:
        page.close()


def test_a_skipped_group_says_why_and_which_session_left_it(dashboard, browser):
    page = sign_in(browser, dashboard)
    try:
        page.open("/ui/groups/tool-group")
        assert page.page.inner_text("#skipped") == "Skipped: " + too_few(1, 2)
        assert "left out: " + NO_SAMPLE in page.page.inner_text("#sessions")
        page.open("/ui/sessions/markup-session")
        assert NO_SAMPLE in page.page.inner_text("#content")
        assert api(dashboard, "/v1/groups/tool-group")["skipped"] == too_few(1, 2)
        assert page.errors == []
    finally:
        page.close()


def test_session_page_shows_the_tool_call_its_result_and_the_reward(dashboard, browser, recorded):
    page = sign_in(browser, dashboard)
    try:
        page.open("/ui/sessions/tool-session")
        conversation = page.page.inner_text("#conversation")
        assert "You answer with the weather." in conversation  # system
        assert "Weather in Paris?" in conversation  # user
        assert "tool call get_weather" in conversation and recorded["tool_call_id"] in conversation
        assert "Sunny, 21 degrees in Paris" in conversation  # the tool's result
        # the second call's history is not repeated (its reply, from the stand-in, echoes the question)
        assert conversation.count("USER\nWeather in Paris?") == 1
        assert "0.750" in page.page.inner_text("#content") and "tool_calls" in page.page.inner_text("#content")
        assert page.errors == []
    finally:
        page.close()


def test_token_view_marks_trained_tokens_with_their_logprobs(dashboard, browser):
    page = sign_in(browser, dashboard)
    try:
        steps = api(dashboard, "/v1/training/steps")["data"]
        group = api(dashboard, f"/v1/groups/{steps[1]['groups'][0]}")
        session_id = group["sessions"][0]["id"]
        tokens = api(dashboard, f"/v1/sessions/{session_id}/tokens")
        [call] = tokens["calls"]
        recorded = api(dashboard, f"/v1/sessions/{session_id}")["calls"][0]
        assert [t["id"] for t in call["tokens"]] == recorded["completion_ids"][0]
        assert [t["logprob"] for t in call["tokens"]] == pytest.approx(recorded["behaviour_logprobs"][0])
        assert call["trained"] and all(t["text"] is not None for t in call["tokens"])
        page.open(f"/ui/sessions/{session_id}")
        assert page.page.locator("#tokens .tok.trained").count() == len(call["tokens"]) > 0
        title = page.page.locator("#tokens .tok").first.get_attribute("title")
        assert f"{call['tokens'][0]['logprob']:.4f}" in title
        assert page.errors == []
    finally:
        page.close()


def test_stored_markup_is_shown_as_text_never_run(dashboard, browser):
    page = sign_in(browser, dashboard)
    try:
        page.open("/ui/sessions/markup-session")
        assert XSS in page.page.inner_text("#conversation")
        page.open("/ui/sessions")
        assert page.page.evaluate("window.__xss") is None
        assert page.page.locator("#conversation img").count() == 0
        assert page.errors == []
    finally:
        page.close()


def test_lists_page_and_filter(dashboard, browser):
    everything = api(dashboard, "/v1/sessions?limit=500")["data"]
    assert len(everything) >= 4 * (1 + 2 * STEPS + 1)
    seen, cursor = [], None
    while True:  # keyset paging walks every session once
        page_data = api(dashboard, "/v1/sessions?limit=5" + (f"&cursor={cursor}" if cursor else ""))
        seen += [s["id"] for s in page_data["data"]]
        cursor = page_data["next_cursor"]
        if not page_data["has_more"]:
            break
    assert seen == [s["id"] for s in everything] and len(set(seen)) == len(seen)
    val = [s["id"] for s in everything if s["split"] == "val"]
    high = api(dashboard, "/v1/sessions?limit=500&min_reward=0.5")["data"]
    assert all(s["reward"] >= 0.5 for s in high)
    assert api(dashboard, "/v1/groups?limit=500&state=trained")["data"]
    bad = httpx.get(dashboard + "/v1/sessions?split=test", headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400 and "split" in bad.json()["error"]["message"]

    page = sign_in(browser, dashboard)
    try:
        page.open("/ui/sessions?split=val")
        page.page.wait_for_selector("#list tbody tr")
        links = page.page.locator("#list tbody tr td:first-child a").all_inner_texts()
        assert sorted(links) == sorted(val)
        page.open("/ui/groups")
        page.page.select_option("select[name=state]", "trained")
        page.page.click("#filters button[type=submit]")
        trained = api(dashboard, "/v1/groups?limit=500&state=trained")["data"]
        page.wait_until(f"document.querySelectorAll('#list tbody tr').length === {len(trained)}")
        assert "state=trained" in page.page.url
        assert sorted(page.page.locator("#list tbody tr td:first-child a").all_inner_texts()) == sorted(
            g["id"] for g in trained
        )
        assert page.errors == []
    finally:
        page.close()


def live_call(session: str, group: str | None, step: int | None, **fields) -> CallRecord:
    return CallRecord(
        id=f"{session}-0",
        session_id=session,
        group_id=group,
        split="train",
        model="agent",
        served=None,
        step=step,
        engine="local",
        stream=False,
        status="ok",
        request={"messages": [{"role": "user", "content": f"question of {session}"}]},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": f"answer of {session}"}}]},
        latency_ms=1.0,
        **fields,
    )


@pytest.fixture(scope="module")
def live_dashboard(tmp_path_factory):
    """A store with a harness group, a live group its rewards formed, a shadow group of one live
    call, and a reward too stale to train; served by a gateway with the dashboard."""
    state = tmp_path_factory.mktemp("live-dashboard")

    async def record() -> tuple[dict, str]:
        store = SQLiteStore(state / "rlproxy.db")
        store.record_call_sync(live_call("harness-s", "harness-g", None))
        store.insert_step("agent", 3, "/ckpt/3", {}, [])  # the newest step: 3
        for session, step in (("live-1", 3), ("live-2", 3), ("live-old", 0)):
            store.record_call_sync(live_call(session, None, step, task_key="billing"))
        rule = LiveRule(group_size=2, max_staleness=1)
        stale = await store.set_reward("live-old", 0.9, None, rule)
        live_id = (await store.set_reward("live-1", 1.0, None, rule))["group_id"]
        assert (await store.set_reward("live-2", 0.0, None, rule))["group_id"] == live_id
        shadows = [live_call(f"shadow-{i}", "shadow-g", 3, task_key="billing", shadow_of="live-1-0") for i in range(3)]
        await store.record_shadow_group(shadows, origin="shadow")
        await store.close()
        return stale, live_id

    # In a thread of its own: Playwright's sync API may already run an event loop in this one.
    with ThreadPoolExecutor(1) as pool:
        stale, live_id = pool.submit(asyncio.run, record()).result()
    assert stale["trainable"] is False
    with (
        FakeUpstream() as upstream,
        gateway_process(
            ["--state-dir", str(state), "--api-key", KEY, "--trainer", "off"]
            + ["--engine", "openai", "--upstream-url", upstream.url]
        ) as (_, url),
    ):
        yield {"url": url, "live_id": live_id, "stale_reason": stale["reason"]}


def test_live_and_shadow_groups_show_their_origin_task_and_stale_rewards(live_dashboard, browser):
    url, live_id = live_dashboard["url"], live_dashboard["live_id"]
    assert live_dashboard["stale_reason"].startswith("stale: answered by step 0")
    live_traffic = api(url, "/v1/dashboard")["live_traffic"]
    assert live_traffic == {
        "groups": {
            "harness": {"total": 1, "trained": 0},
            "live": {"total": 1, "trained": 0},
            "shadow": {"total": 1, "trained": 0},
        },
        "stale_sessions": 1,
        "shadow_samples": None,  # this gateway samples no shadows (an openai engine has no policy of ours)
    }
    assert [g["id"] for g in api(url, "/v1/groups?origin=shadow")["data"]] == ["shadow-g"]
    bad = httpx.get(url + "/v1/groups?origin=upstream", headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error" and "origin" in bad.json()["error"]["message"]

    page = sign_in(browser, url)
    try:
        # the overview's live-traffic panel
        rows = page.page.locator("#live-groups tbody tr").all_inner_texts()
        assert [r.split() for r in rows] == [["harness", "1", "0"], ["live", "1", "0"], ["shadow", "1", "0"]]
        assert page.page.inner_text("#stale-sessions").endswith(": 1")
        # the groups list: origin and task columns, and the origin filter
        page.open("/ui/groups?origin=live")
        page.page.wait_for_selector("#list tbody tr")
        [row] = page.page.locator("#list tbody tr").all()
        cells = row.locator("td").all_inner_texts()
        assert cells[:3] == [live_id, "live", "billing"]
        page.open("/ui/groups")
        page.wait_until("document.querySelectorAll('#list tbody tr').length === 3")
        assert sorted(page.page.locator("#list tbody tr td:nth-child(2)").all_inner_texts()) == [
            "harness",
            "live",
            "shadow",
        ]
        page.page.select_option("select[name=origin]", "shadow")
        page.page.click("#filters button[type=submit]")
        page.wait_until("document.querySelectorAll('#list tbody tr').length === 1")
        assert "origin=shadow" in page.page.url
        assert page.page.locator("#list tbody tr td:first-child a").all_inner_texts() == ["shadow-g"]
        # the group pages
        page.open(f"/ui/groups/{live_id}")
        assert page.page.inner_text("#origin").split() == ["origin", "live"]
        assert "billing" in page.page.inner_text("#task-key")
        assert page.page.locator("#sessions .session").count() == 2
        page.open("/ui/groups/shadow-g")
        assert "shadow" in page.page.inner_text("#origin") and "billing" in page.page.inner_text("#task-key")
        page.open("/ui/groups/harness-g")
        assert "harness" in page.page.inner_text("#origin")
        # a shadow sample's session: its task and the live call it shadows, linked to that call's session
        page.open("/ui/sessions/shadow-1")
        assert "billing" in page.page.inner_text("#task-key")
        shadow_of = page.page.locator("#shadow-of a")
        assert shadow_of.inner_text() == "live-1-0"
        assert shadow_of.get_attribute("href") == "/ui/sessions/live-1"
        # a stale reward: kept, never trained, and the session page says why
        page.open("/ui/sessions/live-old")
        assert live_dashboard["stale_reason"] in page.page.inner_text("#untrained-reason")
        assert "billing" in page.page.inner_text("#task-key")
        assert page.page.locator("#shadow-of").count() == 0
        assert page.errors == []
    finally:
        page.close()


def test_the_demo_trainer_reported_every_step_to_wandb(recorded):
    [run_file] = list(recorded["wandb_dir"].glob("offline-run-*/run-*.wandb"))
    rows = history(run_file)
    assert [r["_step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert {
            "train/loss",
            "train/grad_norm",
            "train/tokens",
            "train/seconds",
            "train/reward_mean",
            "train/reward_std",
        } <= set(row)
    assert "val/sampled_reward_mean" in rows[0]  # the baseline evaluation, sampled by step 0
    shutil.rmtree(recorded["wandb_dir"], ignore_errors=True)
