"""A real headless Chromium for the dashboard tests: Debian's `chromium`, driven by Playwright.

Playwright's own browser download needs the internet; the system's Chromium does not. When
it is missing and we are root with apt (a fresh machine of this project's kind, and CI),
it is installed here, once, so the README's test command needs no extra step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _find() -> str | None:
    override = os.environ.get("RLPROXY_CHROMIUM")
    if override and Path(override).exists():
        return override
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def find_or_install_chromium() -> tuple[str | None, str]:
    """(path to a Chromium, "") or (None, why there is none)."""
    found = _find()
    if found:
        return found, ""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None, (
            "no Chromium found and cannot install one (needs root and apt-get): "
            "`apt-get install chromium`, or set RLPROXY_CHROMIUM to a Chromium binary"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    steps = (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"])
    for cmd in steps:
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0 and cmd[1] == "install":
            return None, f"`{' '.join(cmd)}` failed: {result.stderr[-500:]}"
    found = _find()
    return (found, "") if found else (None, "apt-get installed chromium but no binary was found on PATH")
