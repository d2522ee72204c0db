"""A real headless browser for the live page's tests: Debian's chromium and chromium-driver,
driven by selenium. The test command sets up what it needs, as it fetches the Qwen pair: when
chromium is absent it is installed once with apt (about 20 s; root only, and not when
LEVER_NO_FETCH=1); when that is impossible the browser's tests skip, saying why."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
DRIVER = "chromedriver"
_install_tried: list[str] = []


def _found() -> tuple[str | None, str | None]:
    browser = next((p for p in map(shutil.which, CHROMIUM) if p), None)
    return browser, shutil.which(DRIVER)


def _install() -> None:
    if _install_tried:
        return
    if os.environ.get("LEVER_NO_FETCH") == "1":
        _install_tried.append("LEVER_NO_FETCH=1")
        return
    if not shutil.which("apt-get") or os.geteuid() != 0:
        _install_tried.append("installing it needs apt-get as root")
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium", "chromium-driver"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode:  # the package lists may be stale or absent on a fresh machine
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=900, env=env)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    _install_tried.append(proc.stderr.strip().splitlines()[-1] if proc.returncode and proc.stderr else "")


def chrome(width: int = 1400, height: int = 1000):
    """A headless chromium under selenium (the caller quits it); skips, with the reason, when
    chromium cannot be found or installed."""
    browser, driver = _found()
    if browser is None or driver is None:
        _install()
        browser, driver = _found()
    if browser is None or driver is None:
        pytest.skip(f"chromium and chromedriver absent ({_install_tried[0] or 'apt-get install failed'})")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              f"--window-size={width},{height}"):
        opts.add_argument(a)
    opts.binary_location = browser
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=opts)


def severe_logs(driver) -> list[str]:
    """The page's console errors and failed loads."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
