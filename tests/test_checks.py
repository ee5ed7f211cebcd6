"""The checks CI runs before the tests (ruff, ruff format, mypy) are the project's configured
ones, run in that order, and each fails on what it is there to catch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} is not installed: it is in the dev extra"
    return found


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, timeout=300)


def test_ci_lints_and_type_checks_before_the_tests():
    script = (ROOT / ".ci" / "run").read_text()
    order = [script.index(step) for step in ("ruff check .", "ruff format --check .", "mypy", "python -m pytest")]
    assert order == sorted(order)
    hooks = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"]
    assert [hook["entry"].split()[0] for hook in hooks] == ["ruff", "ruff", "mypy"]


def test_ruff_fails_on_a_finding_and_on_a_formatting_difference(tmp_path):
    (tmp_path / "finding.py").write_text("import os\n")  # F401: imported, never used
    (tmp_path / "unformatted.py").write_text("x = {'a':1}\n")
    check = _run(_tool("ruff"), "check", "--config", str(PYPROJECT), "finding.py", cwd=tmp_path)
    assert check.returncode == 1 and "F401" in check.stdout
    fmt = _run(_tool("ruff"), "format", "--check", "--config", str(PYPROJECT), "unformatted.py", cwd=tmp_path)
    assert fmt.returncode == 1 and "unformatted.py" in fmt.stdout


def test_mypy_fails_on_an_untyped_function_and_on_a_type_error(tmp_path):
    (tmp_path / "untyped.py").write_text("def double(x):\n    return 2 * x\n")
    (tmp_path / "wrong.py").write_text("def name() -> str:\n    return 1\n")
    run = _run(
        _tool("mypy"), "--config-file", str(PYPROJECT), "--no-incremental", "untyped.py", "wrong.py", cwd=tmp_path
    )
    assert run.returncode == 1
    assert "untyped.py:1: error: Function is missing a type annotation" in run.stdout
    assert 'wrong.py:2: error: Incompatible return value type (got "int", expected "str")' in run.stdout
