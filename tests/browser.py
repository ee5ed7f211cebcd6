"""Real programs from Debian for the tests: a headless Chromium (`chromium`, driven by
Playwright) for the dashboard and the cross-site tests, nginx for the deploy balancer, and a
word list (`wamerican`) for the demo's dictionary-word share.

Playwright's own browser download needs the internet; Debian's packages do not. When one is
missing and we are root with apt (a fresh machine of this project's kind, and CI), it is
installed here, once, so the README's test command needs no extra step.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CHROMIUM = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _find(names: tuple[str, ...], override_env: str) -> str | None:
    override = os.environ.get(override_env)
    if override and Path(override).exists():
        return override
    for name in names:
        if name.startswith("/"):  # a data file, not a program
            if Path(name).is_file():
                return name
            continue
        found = shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists() else None)
        if found:
            return found
    return None


def find_or_install(package: str, names: tuple[str, ...], override_env: str) -> tuple[str | None, str]:
    """(path to the program, "") or (None, why there is none)."""
    found = _find(names, override_env)
    if found:
        return found, ""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None, (
            f"no {package} found and cannot install one (needs root and apt-get): "
            f"`apt-get install {package}`, or set {override_env} to its binary"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    steps = (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package])
    for cmd in steps:
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0 and cmd[1] == "install":
            return None, f"`{' '.join(cmd)}` failed: {result.stderr[-500:]}"
    found = _find(names, override_env)
    return (found, "") if found else (None, f"apt-get installed {package} but no binary was found on PATH")


def find_or_install_chromium() -> tuple[str | None, str]:
    return find_or_install("chromium", CHROMIUM, "RLPROXY_CHROMIUM")


def find_or_install_nginx() -> tuple[str | None, str]:
    return find_or_install("nginx", ("nginx",), "RLPROXY_NGINX")


def find_or_install_word_list() -> tuple[str | None, str]:
    from gateway.demo.words import DICTIONARY

    return find_or_install("wamerican", (str(DICTIONARY),), "RLPROXY_WORD_LIST")
