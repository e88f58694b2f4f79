"""`create_app()`: the litestar application; its lifespan starts the engine, which loads in the background."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import anyio
from litestar import Litestar, MediaType, Request, Response, get
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig

from app.default_model import DEMO_MODEL_DIR
from app.engine.client import AsyncEngineClient
from webui.engine_link import EngineLink
from webui.errors import EXCEPTION_HANDLERS, openai_error
from webui.live import LIVE_ROUTES
from webui.loading import LoadState, loading_health, not_loaded
from webui.metrics import ServerMetrics, http_metrics_middleware, metrics_route
from webui.monitor import MonitorFeed
from webui.openai import ROUTES as OPENAI_ROUTES
from webui.pages import PAGE_ROUTES, template_config
from webui.settings import ServerSettings
from webui.system import SystemProbe, SystemSampler

log = logging.getLogger("strata.server")


@get(
    "/health",
    media_type=MediaType.JSON,
    summary="Liveness: 200 while the engine serves, 503 while it loads (with its progress) or once gone",
)
async def health(request: Request) -> Response:
    """Open to everyone (no API key)."""
    link: EngineLink | None = getattr(request.app.state, "link", None)
    if link is None:
        return loading_health(request.app.state.loading)
    if link.dead:
        return openai_error(503, f"the engine is not running: {link.dead}", "service_unavailable")
    return Response({"status": "ok", "model": link.model_name})


def _link(state: State) -> EngineLink:
    link = getattr(state, "link", None)
    if link is None:
        raise not_loaded(state.loading)
    return link


def create_app(
    settings: ServerSettings, announce: bool = False, on_failed: Callable[[str], None] | None = None
) -> Litestar:
    """The server: listens at once while the engine process loads the model (`app.state.loading` says how
    far it is; the pages show it, the API answers 503), then serves; stops the engine at the end. When the
    engine cannot start, `on_failed` is called with why (`strata serve` then stops the server and exits
    with that message); the server answers 503 with it meanwhile."""

    async def bring_up(app: Litestar, loading: LoadState, cancel: threading.Event) -> None:
        try:
            client = await AsyncEngineClient.start(settings.engine, on_loading=loading.update, cancel=cancel)
        except Exception as e:
            if cancel.is_set():  # the server stops while the engine loads
                return
            loading.failed = str(e)
            log.error("the engine did not start: %s", e)
            if on_failed is not None:
                on_failed(str(e))
            return
        name = settings.model_name or client.ready.model
        metrics = ServerMetrics(name, client.ready, per_expert=settings.metrics_per_expert)
        system = SystemSampler(SystemProbe(getattr(client, "pid", None)))
        metrics.system = system
        link = EngineLink(client, name, metrics)
        app.state.metrics = metrics
        app.state.monitor = MonitorFeed(link, metrics, system)
        app.state.link = link
        app.state.tasks += [
            asyncio.create_task(system.run()),
            asyncio.create_task(
                link.supervise(
                    lambda: AsyncEngineClient.start(settings.engine),
                    lambda client: system.probe.follow(getattr(client, "pid", None)),
                )
            ),
        ]
        if announce:
            print(f"Strata serves {name} at http://{settings.host}:{settings.port}", flush=True)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        model = Path(settings.engine.model) if settings.engine.model else DEMO_MODEL_DIR
        loading = LoadState(settings.model_name or model.name)
        app.state.loading = loading
        cancel = threading.Event()
        app.state.tasks = []
        starting = asyncio.create_task(bring_up(app, loading, cancel))
        if announce:
            print(
                f"Strata is loading {loading.model}; the chat at http://{settings.host}:{settings.port}/ "
                "shows the progress",
                file=sys.stderr,
                flush=True,
            )
        try:
            yield
        except asyncio.CancelledError:
            pass  # Ctrl+C may cancel the lifespan while it waits for the end: it cleans up all the same
        finally:
            cancel.set()
            with anyio.CancelScope(shield=True):  # the engine is stopped even while the lifespan is cancelled
                with suppress(asyncio.CancelledError):
                    await starting
                for task in app.state.tasks:
                    task.cancel()
                await asyncio.gather(*app.state.tasks, return_exceptions=True)
                link = getattr(app.state, "link", None)
                if link is not None:
                    await link.shutdown()

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
