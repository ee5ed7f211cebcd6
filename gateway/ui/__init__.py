"""The dashboard: `/ui` pages over the documented JSON API, no build step, no CDN.

Each page is the same small HTML shell naming its page; `static/dashboard.js` fetches the
JSON (`/v1/dashboard`, `/v1/sessions`, `/v1/groups`, ...) and builds the page with DOM
calls and `textContent` only, so nothing from the store is ever parsed as HTML. Charts are
uPlot (MIT), vendored in `static/`. Auth: `gateway.ui.auth`.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from gateway.chat.identity import check_id

STATIC = Path(__file__).parent / "static"
# Scripts only from this gateway (a stored string can never run as a script, even if a bug
# let one into the page); styles inline too, which uPlot's legend uses.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
_NAV = (("/ui", "Overview"), ("/ui/steps", "Steps"), ("/ui/groups", "Groups"), ("/ui/sessions", "Sessions"))

router = APIRouter(include_in_schema=False)


def shell(page: str, title: str, **data: str) -> HTMLResponse:
    attrs = "".join(f' data-{escape(k.replace("_", "-"))}="{escape(v)}"' for k, v in data.items())
    nav = "".join(f'<a href="{href}">{label}</a>' for href, label in _NAV)
    body = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)} · rlproxy</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="/ui/static/favicon.svg" type="image/svg+xml">
<link rel="stylesheet" href="/ui/static/uPlot.min.css"><link rel="stylesheet" href="/ui/static/dashboard.css">
</head><body data-page="{escape(page)}"{attrs}>
<header><span class="brand">rlproxy</span><nav>{nav}</nav><span id="status" class="status"></span></header>
<main id="main"><h1 id="title">{escape(title)}</h1><div id="content" aria-live="polite"></div></main>
<script src="/ui/static/uPlot.iife.min.js"></script><script src="/ui/static/dashboard.js"></script>
</body></html>"""
    return HTMLResponse(
        body,
        headers={
            "content-security-policy": _CSP,
            "cache-control": "no-store",
            "x-content-type-options": "nosniff",
            "referrer-policy": "no-referrer",
        },
    )


@router.get("/ui")
async def overview() -> HTMLResponse:
    return shell("overview", "Overview")


@router.get("/ui/")
async def overview_slash() -> RedirectResponse:
    return RedirectResponse("/ui", status_code=308)


@router.get("/ui/steps")
async def steps() -> HTMLResponse:
    return shell("steps", "Training steps")


@router.get("/ui/groups")
async def groups() -> HTMLResponse:
    return shell("groups", "Groups")


@router.get("/ui/sessions")
async def sessions() -> HTMLResponse:
    return shell("sessions", "Sessions")


@router.get("/ui/groups/{group_id}")
async def group(group_id: str) -> HTMLResponse:
    return shell("group", f"Group {check_id(group_id, 'group_id')}", id=group_id)


@router.get("/ui/sessions/{session_id}")
async def session(session_id: str) -> HTMLResponse:
    return shell("session", f"Session {check_id(session_id, 'session_id')}", id=session_id)


def install(app: FastAPI) -> None:
    """Add the pages and the vendored assets to the app."""
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")
