"""Fixtures of the HTTP tests: a real `strata serve` on a tiny checkpoint, open and with an API key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from checkpoints import write_checkpoint
from serving import API_KEY, Server, start_server, stop_server


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_next checkpoint with a tokenizer and chat template."""
    return write_checkpoint(tmp_path_factory.mktemp("served"), "qwen3_next", max_position_embeddings=4096)


@pytest.fixture(scope="session")
def server(model_dir: Path) -> Iterator[Server]:
    """An open server (no API key), 4 slots."""
    running = start_server(model_dir, "--parallel", "4")
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def keyed_server(model_dir: Path) -> Iterator[Server]:
    """A server that requires API_KEY."""
    running = start_server(model_dir, api_key=API_KEY)
    yield running
    stop_server(running)
