"""The server while its engine loads the model: what is loaded so far, /health's answer, the loading page.

The server listens as soon as it starts; the engine process loads in the background and reports its progress
(`Loading` messages, app/engine/protocol.py). Until it is ready, `/` and `/monitor` show a loading page that
polls /health and becomes the page asked for once the engine serves; the API answers 503 with an OpenAI-style
error saying how far loading is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from litestar import MediaType, Response

from app.engine.protocol import Loading
from webui.errors import ApiError

RETRY_AFTER_S = "1"


@dataclass
class LoadState:
    """The engine's load as the server knows it: bytes (or steps) done of total, or why it failed."""

    model: str  # what is being loaded (the model's name or path)
    done: int = 0
    total: int = 0
    label: str = "starting the engine"
    stage: str | None = None  # what the engine does once the weights are loaded (a Loading with no total)
    failed: str | None = None
    started: float = field(default_factory=time.monotonic)

    def update(self, message: Loading) -> None:
        """Take a Loading message (from the engine client's thread)."""
        if message.total:
            self.done, self.total, self.label = message.done, message.total, message.label
        else:
            self.stage = message.label

    @property
    def share(self) -> float:
        """How much is loaded, 0 to 1 (0 before the first report)."""
        return min(1.0, self.done / self.total) if self.total else 0.0

    def describe(self) -> str:
        """One line: `loading 42% (12.6 of 30.0 GB)`, what the engine does after loading, or why it
        failed."""
        if self.failed is not None:
            return f"the engine did not start: {self.failed}"
        if self.stage is not None:
            loaded = f" ({self.total / 1e9:.1f} GB of weights loaded)" if self.total else ""
            return f"{self.stage}{loaded}"
        if not self.total:
            return self.label
        return f"{self.label} {100 * self.share:.0f}% ({self.done / 1e9:.1f} of {self.total / 1e9:.1f} GB)"

    def as_json(self) -> dict[str, Any]:
        """/health's body while loading."""
        return {
            "status": "failed" if self.failed is not None else "loading",
            "model": self.model,
            "loaded_bytes": self.done,
            "total_bytes": self.total,
            "share": round(self.share, 4),
            "message": self.describe(),
            "elapsed_s": round(time.monotonic() - self.started, 1),
        }


def loading_health(state: LoadState) -> Response:
    """503 with the load's state (the browser's loading page and scripts poll it)."""
    return Response(
        state.as_json(), status_code=503, media_type=MediaType.JSON, headers={"retry-after": RETRY_AFTER_S}
    )


def not_loaded(state: LoadState) -> ApiError:
    """What an API route raises before the engine serves."""
    return ApiError(503, f"the model is not ready: {state.describe()}", "service_unavailable")
