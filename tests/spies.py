"""A function wrapped so that each call first records a name: the order in which a test's code called them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def recorded(calls: list[str], name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, appending `name` to `calls` at each call before it runs."""

    def run(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return function(*args, **kwargs)

    return run
