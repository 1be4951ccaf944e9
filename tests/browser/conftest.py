"""Headless Chromium for the browser tests, driven by Playwright; each test module that asks for it is skipped, with
the reason, where Playwright or Chromium is missing (Debian: ``apt-get install chromium``; another binary:
``MEMKIT_CHROMIUM=/path``)."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _chromium() -> str | None:
    for path in (os.environ.get("MEMKIT_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser")):
        if path and os.access(path, os.X_OK):
            return path
    return None


@pytest.fixture(scope="module")
def chromium():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    path = _chromium()
    if path is None:
        pytest.skip("no Chromium found (Debian: apt-get install chromium; or set MEMKIT_CHROMIUM)")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()
