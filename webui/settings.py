"""Server settings, chosen once at start (CLI options map onto these fields)."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.engine.config import EngineConfig


@dataclass(frozen=True)
class ServerSettings:
    """Where the server listens, who may use it, and the engine it starts.

    `model_name` is the id clients send as `model` (default: the model directory's name); `api_key` None
    leaves the API open; `metrics_per_expert` adds a series per (MoE layer, expert) to `/metrics`.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    metrics_per_expert: bool = False
