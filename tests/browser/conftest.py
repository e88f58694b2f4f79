"""Browser tests: Debian's Chromium driven by Playwright against a real `strata serve` on a tiny model.

Chromium is the system's (`/usr/bin/chromium`, which CI installs with apt-get); Playwright never downloads
a browser. Without that binary the browser tests skip; the WebSocket tests need no browser.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from checkpoints import write_checkpoint
from playwright.sync_api import Browser, Error, Page, sync_playwright
from serving import API_KEY, Server, start_server, stop_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_next checkpoint with a tokenizer and chat template."""
    return write_checkpoint(tmp_path_factory.mktemp("browser"), "qwen3_next", max_position_embeddings=4096)


@pytest.fixture(scope="session")
def live_server(model_dir: Path) -> Iterator[Server]:
    """An open server with 4 slots, its KV blocks beyond the first four in host RAM (outputs unchanged)."""
    running = start_server(model_dir, "--parallel", "4", "--kv-resident", "64")
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def keyed_live_server(model_dir: Path) -> Iterator[Server]:
    """A server that requires API_KEY."""
    running = start_server(model_dir, "--parallel", "2", api_key=API_KEY)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless Chromium (the system's binary); skips when there is none.

    Module-scoped: Playwright's sync API runs an event loop in this thread while it is open, which would
    stop later tests from calling asyncio.run.
    """
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: install Debian's chromium (apt-get install chromium)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh page (own local storage, clipboard allowed); the test fails on any uncaught script error."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    context.set_default_timeout(60_000)
    errors: list[str] = []
    opened = context.new_page()
    opened.on("pageerror", lambda error: errors.append(str(error)))
    yield opened
    with contextlib.suppress(Error):  # the test may have closed it
        context.close()
    assert not errors, f"script errors on the page: {errors}"
