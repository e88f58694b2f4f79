"""Take the README's screenshots: the chat page with an answer and the Monitor with busy slots.

    python tools/screenshots.py [--model DIR] [--out docs/screenshots]

Starts `strata serve` (default: the tiny demo model) on a free port, drives the system's Chromium
(/usr/bin/chromium) with Playwright, and writes chat.png and monitor.png.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from playwright.sync_api import Page, expect, sync_playwright

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"]
TIMEOUT_MS = 180_000


@contextmanager
def serving(model: str | None) -> Iterator[str]:
    """A `strata serve` process with 4 slots; yields its URL once /health answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--parallel", "4"]
    if model:
        command += ["--model", model]
    process = subprocess.Popen(command, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("strata serve did not start")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def busy(url: str, count: int) -> Iterator[None]:
    """`count` long streamed chat requests; leaving the block closes them."""
    release = threading.Event()

    def run(index: int) -> None:
        body = {
            "messages": [{"role": "user", "content": f"Tell me story number {index}"}],
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
            for _ in response.iter_lines():
                if release.is_set():
                    return

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(count)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        release.set()
        for thread in threads:
            thread.join(timeout=60)


def chat_screenshot(page: Page, url: str, path: Path) -> None:
    """Two questions answered, with their timings."""
    page.goto(url + "/")
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    page.get_by_label("Max tokens").fill("60")
    for question in ("Hello! What can you do?", "Write a haiku about GPUs."):
        page.get_by_label("Message").fill(question)
        page.get_by_label("Message").press("Enter")
        answer = page.locator("article.assistant").last
        expect(answer).to_have_attribute("data-status", "done", timeout=TIMEOUT_MS)
    page.screenshot(path=path)


def monitor_screenshot(page: Page, url: str, path: Path) -> None:
    """Three busy slots, a throughput curve and the expert grid."""
    with busy(url, 3):
        page.goto(url + "/monitor")
        expect(page.locator("#slots li.slot[data-state='decode']")).to_have_count(3, timeout=TIMEOUT_MS)
        expect(page.locator("#experts")).to_be_visible(timeout=TIMEOUT_MS)
        page.wait_for_timeout(20_000)  # let the chart gather some points
        page.screenshot(path=path, full_page=True)


def main() -> None:
    """Parse the options and take both screenshots."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the tiny demo model)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with serving(args.model) as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        chat_screenshot(page, url, args.out / "chat.png")
        monitor_screenshot(page, url, args.out / "monitor.png")
        browser.close()
    print(f"wrote {args.out / 'chat.png'} and {args.out / 'monitor.png'}")


if __name__ == "__main__":
    main()
