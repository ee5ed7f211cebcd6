"""Importing rlproxy, and building the app, never imports (or tries to import) vllm or unsloth.

They are GPU-only packages: on a machine without one, importing unsloth fails and vllm
pulls a CUDA stack. A fresh interpreter records every attempt to import them (a meta-path
finder sees the attempt even when the package is not installed and the error is caught).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Whatever of these exists is imported; modules other engineers have not written yet are skipped.
MODULES = [
    "gateway",
    "gateway.app",
    "gateway.cli",
    "gateway.chat.service",
    "gateway.colocate",
    "gateway.engines.vllm.engine",
    "gateway.engines.openai",
    "trainer",
    "trainer.worker",
    "trainer.backends",
    "trainer.backends.base",
    "trainer.backends.unsloth",
    "sdk",
]

PROBE = r"""
import importlib, json, sys, tempfile

attempts = []

class Watch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "unsloth", "unsloth_zoo"):
            attempts.append(name)
        return None

sys.meta_path.insert(0, Watch())
imported, missing = [], []
for name in MODULES:
    try:
        importlib.import_module(name)
        imported.append(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        missing.append(name)

from gateway.app import create_app
from gateway.settings import Settings
from trainer.backends import get_backend

state = tempfile.mkdtemp()
create_app(Settings(engine="openai", upstream_url="http://127.0.0.1:9/v1", state_dir=state))
create_app(Settings(engine="vllm", vllm_url="http://127.0.0.1:9", base_model="Qwen/Qwen2.5-0.5B-Instruct",
                    gpu_mode="colocated", state_dir=state))
get_backend("unsloth")  # the class, not the library
print(json.dumps({"imported": imported, "missing": missing, "attempts": attempts,
                  "loaded": [m for m in sys.modules if m.split(".")[0] in ("vllm", "unsloth", "unsloth_zoo")]}))
"""


def test_importing_rlproxy_never_imports_vllm_or_unsloth():
    code = f"MODULES = {MODULES!r}\n" + PROBE
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"gateway.app", "gateway.cli", "gateway.engines.vllm.engine", "trainer.backends.unsloth"} <= set(
        report["imported"]
    )
    assert report["attempts"] == [] and report["loaded"] == []


def test_cli_help_does_not_import_them():
    code = (
        "import sys, runpy\nsys.argv = ['rlproxy', 'serve', '--help']\n"
        "try:\n    runpy.run_module('gateway.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print('HEAVY', [m for m in sys.modules if m.split('.')[0] in ('vllm', 'unsloth')])"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--vllm-url" in result.stdout and "HEAVY []" in result.stdout
