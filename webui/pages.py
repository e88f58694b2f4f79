"""The browser pages: chat at `/`, the Monitor at `/monitor`, their CSS and JS modules under `/static`.

The pages are open (they hold no data); what they show comes over the WebSockets of `webui/live.py`,
which check the API key. Templates and static files live in the repository's `templates/` and `static/`; an
installed package carries copies of them inside `webui/` (setup.py puts them there when it builds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Request, get
from litestar.datastructures import CacheControlHeader
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Template
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig


def _files(name: str) -> Path:
    """The directory of the pages' `name` files: inside the installed package, else the source tree's."""
    here = Path(__file__).resolve().parent
    return here / name if (here / name).is_dir() else here.parent / name


TEMPLATES_DIR = _files("templates")
STATIC_DIR = _files("static")

# Everything comes from this server: no inline scripts, no other origin (WebSockets included).
PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; img-src 'self' data:; connect-src 'self'; object-src 'none'; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def template_config() -> TemplateConfig:
    """Jinja2 templates from the repository's `templates/` (autoescaped)."""
    return TemplateConfig(directory=TEMPLATES_DIR, engine=JinjaTemplateEngine)


def _page(request: Request, template: str, page: str) -> Template:
    """The page, or while the engine loads the loading page, which becomes it once the engine serves."""
    state = request.app.state
    link = getattr(state, "link", None)
    context: dict[str, Any] = {"page": page, "auth_required": state.settings.api_key is not None}
    if link is None:
        loading = state.loading
        context |= {
            "page": "loading",
            "wanted": page,
            "model_name": loading.model,
            "message": loading.describe(),
            "percent": round(100 * loading.share),
        }
        return Template("loading.html", context=context, headers=PAGE_HEADERS)
    context["model_name"] = link.model_name
    return Template(template, context=context, headers=PAGE_HEADERS)


@get("/", include_in_schema=False, sync_to_thread=False)
def chat_page(request: Request) -> Template:
    """The chat page."""
    return _page(request, "chat.html", "chat")


@get("/monitor", include_in_schema=False, sync_to_thread=False)
def monitor_page(request: Request) -> Template:
    """The Monitor page."""
    return _page(request, "monitor.html", "monitor")


static_files = create_static_files_router(
    path="/static",
    directories=[STATIC_DIR],
    cache_control=CacheControlHeader(no_cache=True),
    include_in_schema=False,
)

PAGE_ROUTES = [chat_page, monitor_page, static_files]
