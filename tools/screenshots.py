"""Take the README's screenshots: the chat page with an answer and the Monitor with busy slots.

    python tools/screenshots.py [--model DIR] [--out docs/screenshots]

Starts `strata serve` (default: the demo model, docs/DEMO_MODEL.md) on a free port with the tests' helpers
(tests/serving.py), drives the system's Chromium (/usr/bin/chromium) with Playwright, and writes chat.png and
monitor.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from playwright.sync_api import Page, expect, sync_playwright

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from serving import start_server, stop_server, streaming_requests  # noqa: E402

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


def main() -> None:
    """Parse the options and take both screenshots."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the demo model)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    server = start_server(Path(args.model) if args.model else None, "--parallel", "4")
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            chat_screenshot(page, server.url, args.out / "chat.png")
            monitor_screenshot(page, server.url, args.out / "monitor.png")
            browser.close()
    finally:
        stop_server(server)
    print(f"wrote {args.out / 'chat.png'} and {args.out / 'monitor.png'}")


if __name__ == "__main__":
    main()
