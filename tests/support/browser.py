"""A headless Chromium driven through Selenium and chromedriver, for nsqadmin's pages.

``.ci/run`` installs Debian's ``chromium`` and ``chromium-driver``; Selenium comes with
the ``test`` extra. Without them the tests that need a browser skip (fail in strict
mode, tests/support/programs.py).
"""
from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.support.broker import wait_until
from tests.support.programs import require_module, require_program

# Chromium on a machine without a network or a session bus: no background connections
# (refused, many at a time, on a closed network), no GPU, no sandbox (run as root)
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                  "--window-size=1280,1024")

# every table of the page: rows of cell texts, as the user sees them
TABLES_JS = ("return Array.from(document.querySelectorAll('table')).map(t => "
             "Array.from(t.rows).map(r => Array.from(r.cells).map(c => c.innerText.trim())))")
# the error boxes nsqadmin shows (an API call that failed), with their text; its
# warnings ("No clients connected to this channel") are not errors
ERRORS_JS = ("return Array.from(document.querySelectorAll('.alert-danger'))"
             ".filter(a => a.offsetParent !== null && a.innerText.trim())"
             ".map(a => a.innerText.trim())")

Table = list[list[str]]


@contextmanager
def chromium() -> Iterator[Any]:
    """A Selenium WebDriver on a fresh headless Chromium profile, quit after."""
    binary = require_program("chromium", "to render nsqadmin's pages in a browser")
    driver_path = require_program("chromedriver", "to drive Chromium")
    webdriver = require_module("selenium.webdriver", "to drive Chromium")
    service_mod = require_module("selenium.webdriver.chrome.service", "to drive Chromium")
    with tempfile.TemporaryDirectory(prefix="pb-chromium-") as profile:
        opts = webdriver.ChromeOptions()
        opts.binary_location = binary
        for flag in CHROMIUM_FLAGS:
            opts.add_argument(flag)
        opts.add_argument(f"--user-data-dir={profile}")
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(service=service_mod.Service(driver_path), options=opts)
        try:
            driver.set_page_load_timeout(30)
            yield driver
        finally:
            driver.quit()


def tables(driver: Any) -> list[Table]:
    return list(driver.execute_script(TABLES_JS))


def shown_errors(driver: Any) -> list[str]:
    return list(driver.execute_script(ERRORS_JS))


def console_errors(driver: Any) -> list[str]:
    """The browser's SEVERE log lines since the last call (JS errors, failed loads)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def open_page(driver: Any, url: str, ready: str, timeout_s: float = 15.0) -> list[Table]:
    """Load ``url`` and wait until some table cell reads ``ready`` (the page's data came
    in); returns the tables."""
    driver.get(url)

    def rendered() -> list[Table] | None:
        found = tables(driver)
        return found if any(ready in row for t in found for row in t) else None

    return wait_until(rendered, timeout_s, 0.05,  # type: ignore[return-value]
                      what=f"{url} to show {ready!r}")


# nsqadmin renders its views again as data comes in: an element found in one call may be
# gone by the next, so buttons are found, read and clicked inside the page's own JS
BUTTONS_JS = ("return Array.from(document.querySelectorAll('button'))"
              ".filter(b => b.offsetParent !== null).map(b => b.innerText.trim())")
CLICK_JS = ("const b = Array.from(document.querySelectorAll(arguments[0]))"
            ".find(b => b.offsetParent !== null && b.innerText.trim() === arguments[1]);"
            "if (b) { b.click(); return true; } return false;")


def buttons(driver: Any) -> list[str]:
    """The labels of the page's visible buttons."""
    return list(driver.execute_script(BUTTONS_JS))


def click_confirmed(driver: Any, label: str) -> None:
    """Click the button reading ``label`` and OK nsqadmin's confirmation dialog."""
    wait_until(lambda: driver.execute_script(CLICK_JS, "button", label), 15, 0.05,
               what=f"a {label!r} button to click")
    wait_until(lambda: driver.execute_script(CLICK_JS, ".bootbox-accept", "OK"), 10, 0.05,
               what=f"the confirmation of {label!r}")
