"""Debian's Chromium driven by Playwright for the console's tests: one browser per test session, no download.

The browser is the system's (``/usr/bin/chromium``, installed by ``make test``); Playwright's wheel brings
only its driver. Screenshots go to LORAPLEX_SCREENSHOTS when it is set (``docs/screenshots`` refreshes the
docs' pictures), else to a folder of the test session's temporary directory.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.sync_api import BrowserContext, Page, sync_playwright

CHROMIUM = os.environ.get("LORAPLEX_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}
WIDTHS = {"phone": PHONE, "desktop": DESKTOP}


@contextmanager
def chromium(user_data_dir: Path) -> Iterator[BrowserContext]:
    """A headless Chromium with a fresh profile; pytest fails (not skips) when the browser is missing."""
    if shutil.which(CHROMIUM) is None:
        pytest.fail(
            f"the console's browser tests need Chromium at {CHROMIUM}: run make test, or apt-get install chromium"
        )
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(user_data_dir),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport=DESKTOP,
            accept_downloads=True,
        )
        try:
            yield context
        finally:
            context.close()


def screenshot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("LORAPLEX_SCREENSHOTS")
    if configured:
        folder = Path(configured)
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    return tmp_path_factory.mktemp("console-screenshots")


def shoot(page: Page, folder: Path, name: str) -> list[Path]:
    """The page at phone and desktop width, full length: ``<name>-phone.png`` and ``<name>-desktop.png``."""
    paths = []
    for width_name, size in WIDTHS.items():
        page.set_viewport_size(size)
        page.reload()
        page.wait_for_load_state("networkidle")
        path = folder / f"{name}-{width_name}.png"
        page.screenshot(path=str(path), full_page=True)
        paths.append(path)
    page.set_viewport_size(DESKTOP)
    return paths
