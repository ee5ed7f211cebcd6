"""Two gateways on one host, each with its own key: signing in to one dashboard keeps the other
signed in. A browser keeps one cookie per name and host whatever the port (RFC 6265, 8.5), so
one cookie name for every gateway meant each sign-in replaced the other's cookie."""

from __future__ import annotations

import contextlib

import pytest

from tests.browser import find_or_install_chromium
from tests.helpers_upstream import openai_gateway

KEYS = ("sk-first-gateway-" + "3e9d0c41b2a7", "sk-second-gateway-" + "8a1f5b07c6d3")


@pytest.fixture(scope="module")
def browser():
    path, why = find_or_install_chromium()
    if path is None:
        pytest.skip(why)
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu"])
        yield chromium
        chromium.close()


def sign_in(page, url: str, key: str) -> None:
    page.goto(url + "/ui/steps")
    page.fill("input[name=key]", key)
    page.click("button[type=submit]")
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)


def test_signing_in_to_a_second_gateway_keeps_the_first_signed_in(upstream, tmp_path, browser):
    with contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(openai_gateway(upstream.url, tmp_path / str(i), api_key=key))[0].url
            for i, key in enumerate(KEYS)
        ]
        context = browser.new_context()
        page = context.new_page()
        for url, key in zip(urls, KEYS, strict=True):
            sign_in(page, url, key)
        for url in urls:  # both still open, without the form
            response = page.goto(url + "/ui/steps")
            assert response.status == 200, url
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            assert page.locator("input[name=key]").count() == 0
        assert len(context.cookies()) == 2  # one per gateway, both HttpOnly and SameSite=Strict
        assert all(c["httpOnly"] and c["sameSite"] == "Strict" for c in context.cookies())
        context.close()
