"""The loading page: shows the engine's load, then becomes the chat once the engine serves."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from playwright.sync_api import Page, expect
from serving import free_port, gated_start, loading_settings

from app.engine.client import AsyncEngineClient
from webui.app import create_app


def test_the_loading_page_shows_the_load_then_becomes_the_chat(
    page: Page, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    monkeypatch.setattr(AsyncEngineClient, "start", gated_start(gate))
    port = free_port()
    app = create_app(loading_settings(model_dir, port))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        page.goto(f"http://127.0.0.1:{port}/")
        expect(page.get_by_role("heading", level=1)).to_have_text(f"Loading {model_dir.name}")
        expect(page.locator("#load-message")).to_have_text("loading 38% (3.0 of 8.0 GB)")
        expect(page.get_by_role("progressbar", name="Model loaded")).to_have_attribute("aria-valuenow", "38")
        expect(page.locator("#connection")).to_have_text("Loading…")
        gate.set()
        expect(page).to_have_title(re.compile(r"^Chat"), timeout=120_000)
        expect(page.locator("#connection")).to_have_attribute("data-state", "open")
        expect(page.get_by_label("Message")).to_be_visible()
    finally:
        gate.set()
        server.should_exit = True
        thread.join(60)
