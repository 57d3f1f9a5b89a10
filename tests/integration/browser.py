"""A real Chromium (Debian's package) driven by Playwright, for the web page's tests."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# The screenshots the tests take, to look at once by eye; kept after the run.
SCREENSHOT_DIR = os.path.join(tempfile.gettempdir(), "hybridllm-web-screenshots")


def chromium_path() -> str:
    """Debian's chromium; CI installs it (.ci/run), elsewhere its absence skips with a reason."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        reason = "no chromium here: apt-get install chromium (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def launch_browser():
    """(playwright, browser); stop both with `close_browser`."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("playwright is not installed (make setup installs it)")
    executable = chromium_path()
    playwright = sync_playwright().start()
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
    browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
    return playwright, browser


def close_browser(playwright, browser) -> None:
    try:
        browser.close()
    finally:
        playwright.stop()


def screenshot(page, name: str) -> str:
    os.makedirs(SCREENSHOT_DIR, exist_ok=True)
    path = os.path.join(SCREENSHOT_DIR, f"{name}.png")
    page.screenshot(path=path, full_page=True)
    return path
