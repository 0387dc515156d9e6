"""Helpers for the browser tests: Debian's Chromium driven by Playwright, a watch on the page's
console, and screenshots under artifacts/screenshots/.

Playwright's own browser download is not used: `make chromium` installs Debian's `chromium`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from playwright.sync_api import BrowserContext, ConsoleMessage, Error, Page

from shop.processes.servers import PROJECT_DIR

CHROMIUM = os.environ.get("FLASHSALE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOTS = PROJECT_DIR / "artifacts" / "screenshots"


def chromium_missing_reason() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is missing: run `make chromium` (as root) to install Debian's chromium"
    return None


@dataclass
class ConsoleWatch:
    """Every console error and uncaught exception of the pages of one browser context."""

    errors: list[str] = field(default_factory=list)

    def attach(self, context: BrowserContext) -> None:
        context.on("page", self.watch)
        for page in context.pages:
            self.watch(page)

    def watch(self, page: Page) -> None:
        page.on("console", self._on_console)
        page.on("pageerror", self._on_page_error)

    def _on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            location = message.location or {}
            self.errors.append(f"console error at {location.get('url', '?')}: {message.text}")

    def _on_page_error(self, error: Error) -> None:
        self.errors.append(f"uncaught {error.name}: {error.message}")


def screenshot(page: Page, name: str) -> Path:
    """Save the whole page as artifacts/screenshots/<name>.png."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{re.sub(r'[^a-z0-9_-]+', '-', name.lower())}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
