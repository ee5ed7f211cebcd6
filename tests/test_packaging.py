"""The wheel holds the whole tree: built from this checkout, installed into a folder of its own,
every module of gateway/, trainer/ and sdk/ imports from it (not from the checkout), and the
dashboard's static files are there. A package the build leaves out fails here, not on a
user's machine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "trainer", "sdk")


def _modules_in_tree() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            names.append(dotted.removesuffix(".__init__"))
    return names


def test_the_wheel_installs_every_module_and_the_dashboard_files(tmp_path):
    # Built from a copy: setuptools leaves build/ and *.egg-info behind in the tree it builds.
    source = tmp_path / "source"
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("rlproxy-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert "gateway/ui/static/dashboard.js" in names and "gateway/ui/static/uPlot.iife.min.js" in names
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)  # what pip would put in site-packages, without the editable checkout

    modules = _modules_in_tree()
    probe = (
        "import importlib, json, sys\n"
        f"sys.path.insert(0, {str(site)!r})\n"
        "where = {}\n"
        "for name in json.loads(sys.argv[1]):\n"
        "    where[name] = importlib.import_module(name).__file__\n"
        "print(json.dumps(where))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(modules)],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the checkout: its packages must not be found by accident
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    where = json.loads(run.stdout.strip().splitlines()[-1])
    outside = {name: path for name, path in where.items() if not Path(path).is_relative_to(site)}
    assert outside == {}, "imported from outside the wheel"
    assert len(where) == len(modules) > 80
