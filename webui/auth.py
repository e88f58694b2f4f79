"""API-key check: `Authorization: Bearer KEY` on the routes that need it, compared in constant time."""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler


def key_accepted(key: str | None, offered: str | None) -> bool:
    """True when the server has no key (`key` None) or `offered` equals it, compared in constant time.

    Every route and WebSocket checks a key here.
    """
    if key is None:
        return True
    return offered is not None and hmac.compare_digest(offered.encode(), key.encode())


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Litestar guard: pass when no key is set or the bearer token equals it; else 401."""
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    offered = token.strip() if scheme.lower() == "bearer" else None
    if not key_accepted(connection.app.state.settings.api_key, offered):
        raise NotAuthorizedException("invalid or missing API key: send 'Authorization: Bearer <key>'")
