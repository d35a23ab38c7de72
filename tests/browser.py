"""A real JupyterLab on 127.0.0.1 and a headless Chromium driving it, for tests of what a person sees.

    with jupyter_lab(folder) as lab, chromium(folder / "chrome") as page:
        page.get(lab.url("explorer.ipynb"))

JupyterLab runs from this environment (the project's test extras) with its own settings, data and runtime folders
under the test's folder: no news feed, no update check, nothing of the user's. Chromium runs with background
networking off and a new profile; ``requests_outside`` lists every address the page asked for that is not
127.0.0.1, from Chromium's own network log.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None. CI installs Debian's chromium and chromium-driver."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            return f"{path} is missing: apt-get install chromium chromium-driver (as .ci/run does)"
    for module in ("selenium", "jupyterlab"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is missing: pip install -e '.[test]'"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    def __init__(self, port: int, token: str):
        self.port, self.token = port, token

    def url(self, notebook: str) -> str:
        return f"http://127.0.0.1:{self.port}/lab/tree/{notebook}?token={self.token}"


# JupyterLab's own settings, as a user would set them: no news, no update check, widgets' state not saved.
_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
    "@jupyterlab/extensionmanager-extension/plugin.jupyterlab-settings": {"enabled": False},
}


@contextlib.contextmanager
def jupyter_lab(folder: Path, env: dict | None = None, *, startup_s: float = 120):
    """JupyterLab serving ``folder`` on 127.0.0.1 (a free port, a random token); stopped on exit."""
    settings = folder / ".lab-settings"
    for name, value in _SETTINGS.items():
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(value))
    port, token = _free_port(), secrets.token_hex(16)
    environment = {**os.environ, **(env or {}), "JUPYTERLAB_SETTINGS_DIR": str(settings),
                   "JUPYTER_CONFIG_DIR": str(folder / ".jupyter-config"),
                   "JUPYTER_RUNTIME_DIR": str(folder / ".jupyter-runtime"),
                   "JUPYTERLAB_WORKSPACES_DIR": str(folder / ".lab-workspaces")}
    log = open(folder / "jupyter-lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={folder}",
         "--LabApp.news_url=", "--LabApp.extension_manager=readonly",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=folder, env=environment, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start; its log:\n{(folder / 'jupyter-lab.log').read_text()}")
                time.sleep(0.5)
        yield Lab(port, token)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@contextlib.contextmanager
def chromium(profile: Path, *, width: int = 1000, height: int = 1400):
    """A headless Chromium (Selenium's ChromeDriver), ``width`` px wide, logging the console and the network."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_AVOID_STATS", "true")  # Selenium's own usage statistics: never sent
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-default-apps", "--disable-extensions", "--metrics-recording-only",
                 f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def requests_outside(driver) -> list[str]:
    """The addresses the page asked for that are not on 127.0.0.1 (data: and blob: URLs are the page's own)."""
    outside = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") != "Network.requestWillBeSent":
            continue
        url = message["params"]["request"]["url"]
        if url.startswith(("data:", "blob:", "about:")) or url.startswith("http://127.0.0.1:"):
            continue
        if url.startswith("ws://127.0.0.1:"):
            continue
        outside.append(url)
    return outside


def wait_for(condition, *, timeout: float, what: str, every: float = 0.25):
    """Poll ``condition()`` until it returns something true; that value. On timeout, an AssertionError naming
    ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}")
        time.sleep(every)
