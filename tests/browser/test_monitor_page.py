"""The Monitor page: slots going busy and idle, queue, GPU and host panels, the expert grid, the API key."""

from __future__ import annotations

import json
import re
import shutil

from playwright.sync_api import Page, expect
from serving import Server, streaming_requests

BUSY_TIMEOUT_MS = 180_000


def test_monitor_shows_busy_slots_then_idle(page: Page, live_server: Server) -> None:
    config = json.loads((live_server.model_dir / "config.json").read_text())
    slots = page.locator("#slots li.slot")
    busy = page.locator("#slots li.slot[data-busy='true']")
    with streaming_requests(live_server.url, 3):
        page.goto(live_server.url + "/monitor")
        expect(page.locator("#connection")).to_have_attribute("data-state", "open")
        expect(slots).to_have_count(4)
        expect(busy).to_have_count(3, timeout=BUSY_TIMEOUT_MS)
        expect(page.locator("#running")).to_have_text("3 / 4")
        expect(page.locator("#waiting")).to_have_text("0")
        expect(page.locator("#slots li.slot[data-state='decode']")).to_have_count(3, timeout=BUSY_TIMEOUT_MS)
        expect(busy.first.locator(".badge")).to_have_text("decoding")
        decoding = page.locator("#slots li.slot[data-state='decode']").first
        expect(decoding.locator(".slot-figures dd").nth(2)).to_have_text("1.00")  # tok/window, no drafts

        grid = page.locator("#experts")
        expect(grid).to_be_visible(timeout=BUSY_TIMEOUT_MS)
        expect(grid).to_have_attribute("data-layers", str(config["num_hidden_layers"]))
        expect(grid).to_have_attribute("data-experts", str(config["num_experts"]))
        shape = f"{config['num_hidden_layers']} layers × {config['num_experts']} experts"
        expect(grid).to_have_attribute("aria-label", re.compile(re.escape(shape)))
        grid.focus()
        grid.press("ArrowRight")
        expect(page.locator("#expert-readout")).to_contain_text("expert 1: in ")

    expect(busy).to_have_count(0, timeout=BUSY_TIMEOUT_MS)
    expect(slots.first.locator(".badge")).to_have_text("idle")
    expect(page.locator("#running")).to_have_text("0 / 4")
    expect(page.locator("#prefix-cache")).to_contain_text("prompt tokens reused")
    expect(page.locator("#kv-text")).to_contain_text(re.compile(r"\d+\.\d % of block reads from VRAM"))
    expect(page.locator("#parked")).to_contain_text(re.compile(r"[1-9]\d* in RAM"))
    expect(page.locator("#host")).to_contain_text("CPU")
    expect(page.locator("#host")).to_contain_text("RAM")
    if shutil.which("nvidia-smi") is None:
        expect(page.locator("#gpus")).to_contain_text("No NVIDIA GPU found")


def test_monitor_asks_for_the_api_key(page: Page, keyed_live_server: Server) -> None:
    page.goto(keyed_live_server.url + "/monitor")
    dialog = page.locator("#key-dialog")
    expect(dialog).to_be_visible()
    page.get_by_role("textbox", name="Key").fill("wrong-key")
    page.get_by_role("button", name="Save").click()
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text("refused")
    page.get_by_role("textbox", name="Key").fill(keyed_live_server.api_key)
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    expect(page.locator("#slots li.slot")).to_have_count(2)
    assert page.evaluate("() => localStorage.getItem('strata.apiKey')") == keyed_live_server.api_key
