"""Debian's Chromium driven by Selenium through Debian's chromedriver (nothing downloaded)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# Without the background-networking flags Chromium keeps dialling Google's hosts, which this
# loopback-only machine refuses (docs: /work/.library/env/machines/python.md).
FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
    "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-extensions", "--disable-default-apps", "--window-size=1440,1400",
)


def available() -> str | None:
    """Why the browser can't run here, or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not shutil.which(path):
            return f"{path} missing (scripts/setup.sh installs Debian's chromium and chromium-driver)"
    return None


def chromium(work_dir: Path) -> webdriver.Chrome:
    options = Options()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={work_dir / 'chromium-profile'}")  # fresh per test
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not try to download a driver
    service = Service(executable_path=CHROMEDRIVER, log_output=str(work_dir / "chromedriver.log"))
    return webdriver.Chrome(options=options, service=service)


def console_errors(driver: webdriver.Chrome) -> list[dict[str, object]]:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
