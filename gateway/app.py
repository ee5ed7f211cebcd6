"""The ASGI app: services built once in `create_app` and handed to thin routes."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from gateway.adapters import AdapterRegistry
from gateway.chat.gate import RequestGate
from gateway.chat.service import ChatService
from gateway.engines.base import Engine
from gateway.errors import ConfigError, RLProxyError
from gateway.http import session_url
from gateway.http.browsers import BrowserGuardMiddleware, JsonWritesMiddleware
from gateway.http.errors import install_error_handlers
from gateway.http.limits import BodyLimitMiddleware, Limits
from gateway.http.logs import log_call
from gateway.http.middleware import BearerAuthMiddleware, HeadMiddleware, RequestIdMiddleware
from gateway.http.security import cors_middleware, refuse_if_exposed
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.store import Store
from gateway.store.open import open_store
from gateway.store.private import private_state_dir
from gateway.ui.auth import DashboardAuthMiddleware
from gateway.upkeep import StoreUpkeep

log = logging.getLogger("rlproxy")


@dataclass
class Services:
    """Everything a route may use; built once per app."""

    settings: Settings
    engine: Engine
    store: Store
    registry: AdapterRegistry
    gate: RequestGate
    chat: ChatService
    metrics: Metrics
    tracer: Any = None
    extras: dict = field(default_factory=dict)  # per-feature services (RULER judge, engine supervisor, ...)
    # This gateway among those on one store: its heartbeat row, the judgements it runs (gateway/ruler/watch.py).
    gateway_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def build_engine(settings: Settings) -> Engine:
    """The engine the settings ask for; heavy imports happen only here."""
    _check_engine_urls(settings)
    if settings.engine == "openai":
        from gateway.engines.openai import OpenAIEngine

        return OpenAIEngine.from_settings(settings)
    if settings.engine == "vllm":
        from gateway.engines.vllm.build import build_vllm

        return build_vllm(settings)
    from gateway.engines.local.engine import LocalEngine
    from gateway.models.registry import resolve_base_model

    return LocalEngine(
        resolve_base_model(settings.base_model, settings.state_dir),
        served_base_id=settings.base_model,
        device=settings.device,
        max_batch_size=settings.max_batch_size,
        default_max_tokens=settings.default_max_tokens,
        chat_template=settings.chat_template,
    )


def _check_engine_urls(settings: Settings) -> None:
    """Where completions come from is --engine's to say: `rlproxy serve --upstream-url https://api.openai.com/v1`
    without `--engine openai` served the built-in model (gibberish) on the local engine, the URL ignored."""
    for flag, value, engine in (
        ("--upstream-url", settings.upstream_url, "openai"),
        ("--vllm-url", settings.vllm_url, "vllm"),
    ):
        if value and settings.engine != engine:
            variable = "RLPROXY_" + flag[2:].replace("-", "_").upper()
            raise ConfigError(
                f"{flag} is for --engine {engine}; with --engine {settings.engine} it would be ignored and the "
                f"{settings.engine} engine would answer instead: add --engine {engine}, or drop {flag} (or {variable})"
            )


class GatewayApp(FastAPI):
    """FastAPI, with POST /v1/chat/completions sent straight to its ASGI endpoint (behind the
    request-id and auth middleware only): FastAPI's own stack (error middleware, router,
    dependency solving) cost a third of the gateway's CPU per call in the bench's profile.
    Middleware added with `add_middleware` does not see chat completions; wrap
    `chat_fast_path` for that."""

    chat_fast_path: Any = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope = session_url.rewrite(scope)  # /sessions/{sid}/v1/... -> /v1/... with X-Session-Id
        if (
            self.chat_fast_path is not None
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] == "/v1/chat/completions"
        ):
            scope["app"] = self
            await self.chat_fast_path(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


async def _colocate(services: Services):
    """One GPU for vLLM and the trainer: lend it while a step trains (gateway/colocate.py); None
    where the engine has a GPU of its own or none."""
    settings, registry = services.settings, services.registry
    if services.engine.kind != "vllm" or settings.gpu_mode != "colocated":
        return None
    from gateway.colocate import Colocator, activate_step

    colocator = Colocator(
        services.engine,
        services.gate,
        services.store,
        settings.model_name,
        lambda step: activate_step(registry, settings.model_name, step),
        poll_interval=min(settings.poll_interval, 0.5),
    )
    await colocator.start()
    services.extras["colocator"] = colocator
    return colocator


def create_app(
    settings: Settings, *, engine: Engine | None = None, store: Store | None = None, tracer: Any = None
) -> FastAPI:
    refuse_if_exposed(settings)  # before anything is started or written
    private_state_dir(settings.state_dir)  # before the engine writes its model or socket there
    engine = engine or build_engine(settings)
    store = store or open_store(settings)
    gate = RequestGate()
    registry = AdapterRegistry(engine, store, settings)
    if settings.promote == "canary" and engine.supports_adapters:
        from gateway.promotion.canary import Canary

        registry.canary = Canary(registry, store, settings)
    metrics = Metrics()
    if tracer is None:
        from gateway.tracing import build_tracer

        tracer = build_tracer(settings)
    observers = [
        lambda record: metrics.observe_call(record.status, record.stream, record.latency_ms, record.untrainable),
        log_call,  # the session and request id of each call, in the log
    ]
    if tracer is not None:
        observers.append(tracer.on_call)
    services = Services(
        settings=settings,
        engine=engine,
        store=store,
        registry=registry,
        gate=gate,
        chat=ChatService(engine, store, registry, gate, observers, limits=Limits.from_settings(settings)),
        metrics=metrics,
        tracer=tracer,
    )

    if settings.upstream_protocol:
        if engine.kind != "openai":
            from gateway.errors import ConfigError

            raise ConfigError("--upstream-protocol needs --engine openai: only an upstream can speak a protocol itself")
        from gateway.chat.passthrough import PassThrough

        services.extras["passthrough"] = PassThrough(services.chat, settings.upstream_protocol)
    if settings.shadow_samples:
        if engine.kind == "openai":
            from gateway.errors import ConfigError

            raise ConfigError("--shadow-samples needs a policy of ours to sample: use --engine local or vllm")
        from gateway.shadow.sampler import ShadowSampler

        shadows = ShadowSampler(services, settings, metrics)
        services.chat.observers.append(shadows)  # sees every committed call; schedules, never blocks
        services.extras["shadow"] = shadows

    from gateway.ruler.watch import JudgementWatch

    watch = JudgementWatch(store, services.gateway_id)
    upkeep = StoreUpkeep(store, settings)
    services.extras["upkeep"] = upkeep

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        colocator = None
        started = False
        try:
            await store.start()
            await watch.start()  # before any judgement names this gateway: its row is there to expire
            await engine.start()
            await registry.start()
            await upkeep.start()
            if registry.canary is not None:
                await registry.canary.start()
            colocator = await _colocate(services)
            if "shadow" in services.extras:  # the shadow groups a shutdown left unjudged, judged again
                await services.extras["shadow"].start()
            if tracer is not None:
                tracer.start()
            log.info("rlproxy serving %s on the %s engine", settings.model_name, engine.kind)
            started = True
            yield
        except RLProxyError as error:
            if not started:
                # A vLLM that does not answer, a model that cannot load: `rlproxy serve` says why in
                # one line (run_gateway), not in the ASGI server's 40-line traceback of the lifespan.
                app.state.startup_error = error
            raise
        finally:  # also after a failed start: what did start is stopped (a vLLM child, aiohttp sessions)
            store.stopping()  # a write the store never answers no longer holds the shutdown for ever
            if "shadow" in services.extras:
                await services.extras["shadow"].stop()
            if "ruler" in services.extras:  # judgements whose client left: marked failed, not "running"
                await services.extras["ruler"].stop()
            await upkeep.close()
            await watch.stop()  # after the judgements were marked: what is left is handed on
            if colocator is not None:
                await colocator.close()
            if registry.canary is not None:
                await registry.canary.close()
            await registry.close()
            await engine.close()
            if tracer is not None:
                tracer.close()
            await store.close()

    app = GatewayApp(title="rlproxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.services = services
    # `serve --trainer auto`'s child, set by the CLI once the app is built: /healthz shows it, and
    # NAME's refusal before an --init-from step 0 says why that step will never come once it failed.
    app.state.trainer = None
    registry.trainer_child = lambda: app.state.trainer

    install_error_handlers(app)

    from gateway import ui
    from gateway.routes import lists as list_routes
    from gateway.routes import openai as openai_routes
    from gateway.routes import promotion as promotion_routes
    from gateway.routes import protocols as protocol_routes
    from gateway.routes import rl as rl_routes
    from gateway.routes import ruler as ruler_routes

    app.include_router(openai_routes.router)
    app.include_router(protocol_routes.router)
    app.include_router(rl_routes.router)
    app.include_router(promotion_routes.router)
    app.include_router(ruler_routes.router)
    app.include_router(list_routes.router)
    ui.install(app)  # the dashboard's pages; its cookie login is DashboardAuthMiddleware's

    from gateway.openapi import install_openapi

    install_openapi(app)
    # The same stack, innermost first, in front of FastAPI's routes and the chat fast path:
    # body limit, JSON writes only, bearer key, CORS (only with --cors-origin), Host and Origin
    # (gateway/http/browsers.py), request id. FastAPI's routes also get HEAD as GET, innermost.
    guard = {
        "cors_origins": settings.cors_origin,
        "allowed_hosts": settings.allowed_host,
        "check_host": settings.api_key is None or bool(settings.allowed_host),
    }
    admin_key = settings.admin_key.get_secret_value() if settings.admin_key is not None else None
    app.add_middleware(HeadMiddleware)
    app.add_middleware(BodyLimitMiddleware, limit_mb=settings.max_body_mb)
    app.add_middleware(JsonWritesMiddleware)
    if settings.api_key is not None:
        app.add_middleware(DashboardAuthMiddleware, api_key=settings.api_key.get_secret_value(), admin_key=admin_key)
    if settings.cors_origin:
        app.add_middleware(cors_middleware, origins=settings.cors_origin)
    app.add_middleware(BrowserGuardMiddleware, **guard)
    app.add_middleware(RequestIdMiddleware)
    chat_endpoint = JsonWritesMiddleware(
        BodyLimitMiddleware(openai_routes.chat_completions, limit_mb=settings.max_body_mb)
    )
    if settings.api_key is not None:
        api_key = settings.api_key.get_secret_value()
        chat_endpoint = BearerAuthMiddleware(chat_endpoint, api_key=api_key, admin_key=admin_key)
    if settings.cors_origin:
        chat_endpoint = cors_middleware(chat_endpoint, origins=settings.cors_origin)
    app.chat_fast_path = RequestIdMiddleware(BrowserGuardMiddleware(chat_endpoint, **guard))
    return app
