"""The dashboard's browser login: cookie for reads only, no open redirect, no header injection."""

from __future__ import annotations

from starlette.testclient import TestClient

from gateway.ui.auth import DashboardAuthMiddleware, cookie_name, cookie_token

KEY = "ui-auth-key-6c1e0f3a9d"


async def hello(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def client() -> TestClient:
    return TestClient(DashboardAuthMiddleware(hello, api_key=KEY), follow_redirects=False)


def test_login_sets_a_cookie_that_is_not_the_key():
    response = client().post("/ui/login", data={"key": KEY, "next": "/ui/steps"})
    assert response.status_code == 303 and response.headers["location"] == "/ui/steps"
    cookie = response.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and KEY not in cookie
    assert cookie_token(KEY) in cookie


def test_cookie_reads_but_never_writes():
    c = client()
    c.cookies.set(cookie_name(KEY), cookie_token(KEY))
    assert c.get("/ui").status_code == 200 and c.get("/v1/sessions").status_code == 200
    assert c.post("/v1/sessions/s/reward").status_code == 401
    c.cookies.set(cookie_name(KEY), cookie_token("another-key"))
    assert c.get("/ui").status_code == 401


def test_a_key_in_the_url_signs_nobody_in():
    # URLs end up in access logs: only the form (a POST body) takes the key.
    response = client().get(f"/ui/groups?key={KEY}&split=val")
    assert response.status_code == 401 and "set-cookie" not in response.headers
    assert KEY not in response.text and "/ui/groups?split=val" in response.text  # the form's next page


def test_no_open_redirect_and_no_header_injection():
    response = client().post("/ui/login", data={"key": KEY, "next": "//evil.example/ui"})
    assert response.headers["location"] == "/ui"
    response = client().post("/ui/login", data={"key": KEY, "next": "/ui/x\r\nSet-Cookie: a=b"})
    assert response.status_code == 303 and "\r" not in response.headers["location"]
    assert response.headers.get_list("set-cookie") == [response.headers["set-cookie"]]


def test_bearer_key_still_works_and_healthz_is_open():
    c = client()
    assert c.get("/ui", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert c.get("/v1/groups").status_code == 401
    assert c.get("/healthz").status_code == 200
    assert c.get("/ui/static/dashboard.js").status_code == 200  # the page's own assets hold no data
