"""`create_app()`: the litestar application, with the engine started in its lifespan."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar, MediaType, Response, get
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig

from app.engine.client import AsyncEngineClient
from webui.engine_link import EngineLink
from webui.errors import EXCEPTION_HANDLERS, openai_error
from webui.live import LIVE_ROUTES
from webui.metrics import ServerMetrics, http_metrics_middleware, metrics_route
from webui.monitor import MonitorFeed
from webui.openai import ROUTES as OPENAI_ROUTES
from webui.pages import PAGE_ROUTES, template_config
from webui.settings import ServerSettings
from webui.system import SystemProbe, SystemSampler


@get("/health", media_type=MediaType.JSON, summary="Liveness: 200 while the engine runs, 503 once it is gone")
async def health(link: EngineLink) -> Response:
    """Open to everyone (no API key)."""
    if link.dead:
        return openai_error(503, f"the engine is not running: {link.dead}", "service_unavailable")
    return Response({"status": "ok", "model": link.model_name})


def _link(state: State) -> EngineLink:
    return state.link


def create_app(settings: ServerSettings, announce: bool = False) -> Litestar:
    """The server: starts the engine process on startup (startup fails if it cannot), stops it at the end."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        client = await AsyncEngineClient.start(settings.engine)
        name = settings.model_name or client.ready.model
        metrics = ServerMetrics(name, client.ready, per_expert=settings.metrics_per_expert)
        app.state.metrics = metrics
        app.state.link = EngineLink(client, name, metrics)
        system = SystemSampler(SystemProbe(getattr(client, "pid", None)))
        metrics.system = system
        app.state.monitor = MonitorFeed(app.state.link, metrics, system)
        sampling = asyncio.create_task(system.run())
        supervising = asyncio.create_task(
            app.state.link.supervise(
                lambda: AsyncEngineClient.start(settings.engine),
                lambda client: system.probe.follow(getattr(client, "pid", None)),
            )
        )
        if announce:
            print(f"Strata serves {name} at http://{settings.host}:{settings.port}", flush=True)
        try:
            yield
        finally:
            sampling.cancel()
            supervising.cancel()
            await app.state.link.shutdown()

    return Litestar(
        route_handlers=[health, metrics_route, *OPENAI_ROUTES, *PAGE_ROUTES, *LIVE_ROUTES],
        dependencies={"link": Provide(_link, sync_to_thread=False)},
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=[http_metrics_middleware],
        lifespan=[lifespan],
        state=State({"settings": settings}),
        openapi_config=OpenAPIConfig(title="Strata", version="0.1.0", path="/schema"),
        template_config=template_config(),
    )
