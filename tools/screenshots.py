"""Take the README's screenshots: the loading page, the chat page with an answer, the Monitor with busy slots.

    python tools/screenshots.py [--model DIR] [--loading-model DIR] [--out docs/screenshots]

Starts `strata serve` (default: the demo model, docs/DEMO_MODEL.md) on a free port with the tests' helpers
(tests/serving.py), drives the system's Chromium (/usr/bin/chromium) with Playwright, and writes chat.png and
monitor.png. With `--loading-model` (a checkpoint large enough to take seconds to load, such as
`benchmarks/random_checkpoint.py --layers 1`'s), also starts `strata serve` on it on the CPU and writes
loading.png while it loads.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from playwright.sync_api import Page, expect, sync_playwright

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from serving import free_port, start_server, stop_server, streaming_requests  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"]
TIMEOUT_MS = 180_000


def chat_screenshot(page: Page, url: str, path: Path) -> None:
    """Two requests of the kind the demo model was trained on (docs/DEMO_MODEL.md), answered, with timings."""
    page.goto(url + "/")
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    page.get_by_label("Max tokens").fill("80")
    questions = ("Return the sum of a list of numbers.", "Write a Python function: Split a path in parts.")
    for question in questions:
        page.get_by_label("Message").fill(question)
        page.get_by_label("Message").press("Enter")
        answer = page.locator("article.assistant").last
        expect(answer).to_have_attribute("data-status", "done", timeout=TIMEOUT_MS)
    page.screenshot(path=path)


def monitor_screenshot(page: Page, url: str, path: Path) -> None:
    """Three busy slots, a throughput curve and the expert grid."""
    with streaming_requests(url, 3):
        page.goto(url + "/monitor")
        expect(page.locator("#slots li.slot[data-state='decode']")).to_have_count(3, timeout=TIMEOUT_MS)
        expect(page.locator("#experts")).to_be_visible(timeout=TIMEOUT_MS)
        page.wait_for_timeout(20_000)  # let the chart gather some points
        page.screenshot(path=path, full_page=True)


def loading_screenshot(page: Page, model: Path, path: Path) -> None:
    """The loading page of a `strata serve` on `model` (CPU, fp32) once a share of the load is reported."""
    port = free_port()
    command = [sys.executable, "-m", "app.cli", "serve", "--model", str(model), "--port", str(port)]
    command += ["--device", "cpu", "--dtype", "float32", "--kv-memory", "64MiB"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "health", timeout=1).json().get("share", 0) > 0.2:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        page.goto(url)
        expect(page.locator("#load-message")).to_contain_text("%")
        page.screenshot(path=path)
        expect(page).to_have_title(re.compile("^Chat"), timeout=TIMEOUT_MS)  # it becomes the chat
    finally:
        process.terminate()
        process.wait(60)


def main() -> None:
    """Parse the options and take both screenshots."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the demo model)")
    parser.add_argument("--loading-model", type=Path, help="also shoot the loading page of this model")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    server = start_server(Path(args.model) if args.model else None, "--parallel", "4")
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            if args.loading_model is not None:
                loading_screenshot(page, args.loading_model, args.out / "loading.png")
            chat_screenshot(page, server.url, args.out / "chat.png")
            monitor_screenshot(page, server.url, args.out / "monitor.png")
            browser.close()
    finally:
        stop_server(server)
    print(f"wrote {args.out / 'chat.png'} and {args.out / 'monitor.png'}")


if __name__ == "__main__":
    main()
