"""A headless Chromium with a server's /dashboard open (and polling), for tests and for
`backfill bench serve --dashboard`, which measures what an open page costs the engine.

Debian's `chromium` and `chromium-driver` packages (the Makefile installs them), driven by
selenium through the driver binary named here: selenium-manager never runs, nothing is
downloaded. The flags keep Chromium off the network except for the page's own server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING
from urllib.parse import quote

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,1000")
PAGE_LOAD_TIMEOUT_S = 60
FIRST_POLL_TIMEOUT_S = 60.0


def browser_available() -> str | None:
    """None if a dashboard can be opened here, else why not."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


def dashboard_url(base_url: str, api_key: str | None = None) -> str:
    """The page's address: under --api-key the key rides in the query (`?key=`)."""
    url = base_url.rstrip("/") + "/dashboard"
    return url if api_key is None else f"{url}?key={quote(api_key, safe='')}"


def num_polls(driver: WebDriver) -> int:
    """How many times the page has read its feed successfully."""
    return int(driver.find_element("id", "status").get_attribute("data-polls") or 0)


@contextlib.contextmanager
def open_dashboard(base_url: str, api_key: str | None = None) -> Iterator[WebDriver]:
    """A headless Chromium showing the dashboard until the block ends (its profile is a fresh
    temporary folder, removed after), live: it has read its feed once. Raises RuntimeError if
    no browser is available or the page did not read its feed within FIRST_POLL_TIMEOUT_S."""
    why = browser_available()
    if why is not None:
        raise RuntimeError(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="backfill-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    # NOTE: an explicit driver path: selenium-manager (which would download one) never runs.
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(PAGE_LOAD_TIMEOUT_S)
        driver.get(dashboard_url(base_url, api_key))
        deadline = time.monotonic() + FIRST_POLL_TIMEOUT_S
        while num_polls(driver) < 1:
            if time.monotonic() > deadline:
                status = driver.find_element("id", "status").text
                raise RuntimeError(f"the dashboard did not read its feed within {FIRST_POLL_TIMEOUT_S} s: {status}")
            time.sleep(0.1)
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
