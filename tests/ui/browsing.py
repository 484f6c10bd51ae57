"""Driving Debian's Chromium with Playwright: the launch flags these machines need, and a signed-in browser
context that records whatever a page must never do."""

from __future__ import annotations

import os
from typing import Any

CHROMIUM = os.environ.get("AOTC_TEST_CHROMIUM", "/usr/bin/chromium")
# As root the browser's own sandbox cannot start; nothing the tests load needs the network beyond loopback.
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# What a page must never do: open a dialog (alert, confirm), log an error, or trip the CSP. An init script records
# CSP violations in the page itself (Playwright injects it outside the page's CSP).
WATCH_CSP = """
window.__violations = [];
document.addEventListener("securitypolicyviolation",
  (e) => window.__violations.push(e.violatedDirective + " " + e.blockedURI));
"""



class Watched:
    """A browser context signed in with one key, whose pages report every dialog, page error, console error and
    CSP violation."""

    def __init__(self, browser: Any, base: str) -> None:
        self.base = base
        self.context = browser.new_context(viewport={"width": 1360, "height": 900})
        self.context.add_init_script(WATCH_CSP)
        self.problems: list[str] = []
        self.page = self.new_page()

    def new_page(self) -> Any:
        page = self.context.new_page()

        def dialog(d: Any) -> None:
            self.problems.append(f"dialog {d.type}: {d.message}")
            d.dismiss()

        page.on("dialog", dialog)
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        page.on("console", lambda m: self.problems.append(f"console {m.type}: {m.text}")
                if m.type == "error" and "404" not in m.text else None)
        return page

    def sign_in(self, key: str) -> None:
        self.page.goto(self.base + "/ui/login")
        self.page.fill("#key", key)
        self.page.click("button[type=submit]")
        self.page.wait_for_load_state()

    def violations(self, page: Any = None) -> list[str]:
        return list((page or self.page).evaluate("window.__violations || []"))

    def close(self) -> None:
        self.context.close()
