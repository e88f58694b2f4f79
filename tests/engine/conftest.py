"""Fixtures of the engine tests: a tiny checkpoint of each architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoints import write_checkpoint

ARCHS = ["qwen3_moe", "qwen3_next"]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random checkpoint of each architecture (4,096-token context), one per test module."""
    return write_checkpoint(
        tmp_path_factory.mktemp(request.param), request.param, max_position_embeddings=4096
    )
