"""API-key check: `Authorization: Bearer KEY` on the routes that need it, compared in constant time."""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Litestar guard: pass when no key is set or the bearer token equals it; else 401."""
    key: str | None = connection.app.state.settings.api_key
    if key is None:
        return
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise NotAuthorizedException("invalid or missing API key: send 'Authorization: Bearer <key>'")
