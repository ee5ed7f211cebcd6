"""The deploy files agree with the CLI: every `rlproxy <command> --flag` they use exists.

Commands are found in the shell scripts, the Dockerfile's ENTRYPOINT/CMD/RUN, the SkyPilot
task's setup/run and the bash blocks of deploy/README.md, and checked against
`rlproxy <command> --help`. Values given to `--vllm-arg` must be flags `vllm serve` documents.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SCRIPTS = ("single-gpu.sh", "gpu-smoke.sh")

# `vllm serve` flags the deploy files pass through --vllm-arg (vLLM's engine arguments, documented
# under docs.vllm.ai "Engine Arguments"); a typo here would only surface on a GPU.
VLLM_SERVE_FLAGS = {
    "--gpu-memory-utilization",
    "--max-model-len",
    "--max-num-seqs",
    "--enforce-eager",
    "--enable-prefix-caching",
    "--dtype",
    "--quantization",
    "--tensor-parallel-size",
}


@functools.cache
def cli_commands() -> frozenset[str]:
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    block = out.split("positional arguments:")[1].split("options:")[0]
    return frozenset(re.findall(r"^\s{4}(\w[\w-]*)\s", block, re.M))


@functools.cache
def cli_flags(command: str) -> frozenset[str]:
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return frozenset(re.findall(r"(--[a-z0-9][a-z0-9-]*)", out))


def _logical_lines(text: str) -> list[str]:
    """Shell text with backslash-newline continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


_COMMAND_PREFIXES = {"exec", "&&", "||", ";", "|", "then", "do", "else", "time", "sudo"}


def rlproxy_invocations(tokens: list[str]) -> list[tuple[str, list[str]]]:
    """(command, its arguments) for every `rlproxy COMMAND ...` in a token list."""
    found = []
    for i, token in enumerate(tokens):
        # at command position only (not `command -v rlproxy`): first, after an operator or
        # `exec`, or after environment assignments
        before = tokens[i - 1] if i else None
        at_command = before is None or before in _COMMAND_PREFIXES or re.match(r"^[A-Z_][A-Z0-9_]*=", before)
        if token == "rlproxy" and at_command and i + 1 < len(tokens):
            args = []
            for arg in tokens[i + 2 :]:
                if arg in ("&&", "||", "|", ";", "&") or arg.startswith((">", "2>")):
                    break
                args.append(arg)
            found.append((tokens[i + 1], args))
    return found


def shell_invocations(text: str) -> list[tuple[str, list[str]]]:
    found = []
    for line in _logical_lines(text):
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue  # a line shlex cannot split (heredoc body, unbalanced quote inside $(...)) has no rlproxy
        found += rlproxy_invocations(tokens)
    return found


def dockerfile_invocations(text: str) -> list[tuple[str, list[str]]]:
    instructions = re.sub(r"\\\n", " ", text)
    entrypoint, cmd, found = [], [], []
    for line in instructions.splitlines():
        keyword, _, rest = line.strip().partition(" ")
        if keyword == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif keyword == "CMD":
            cmd = json.loads(rest)
        elif keyword == "RUN":
            found += shell_invocations(rest)
    assert entrypoint == ["rlproxy"], "the image's entrypoint is the rlproxy CLI"
    found += rlproxy_invocations([*entrypoint, *cmd])
    return found


def readme_invocations(text: str) -> list[tuple[str, list[str]]]:
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [inv for block in blocks for inv in shell_invocations(block)]


def all_invocations() -> dict[str, list[tuple[str, list[str]]]]:
    task = yaml.safe_load((DEPLOY / "skypilot.yaml").read_text())
    found = {name: shell_invocations((DEPLOY / name).read_text()) for name in SCRIPTS}
    found["Dockerfile"] = dockerfile_invocations((DEPLOY / "Dockerfile").read_text())
    found["skypilot.yaml"] = shell_invocations(task["setup"]) + shell_invocations(task["run"])
    found["README.md"] = readme_invocations((DEPLOY / "README.md").read_text())
    return found


def test_every_rlproxy_flag_in_deploy_files_exists():
    checked = 0
    for source, invocations in all_invocations().items():
        assert invocations, f"{source} runs no rlproxy command"
        for command, args in invocations:
            assert command in cli_commands(), f"{source}: `rlproxy {command}` is not a command"
            known = cli_flags(command)
            for arg in args:
                if not arg.startswith("--"):
                    continue
                flag = arg.split("=", 1)[0]
                assert flag in known, f"{source}: `rlproxy {command} {flag}` is not in `rlproxy {command} --help`"
                checked += 1
                if flag == "--vllm-arg":
                    value = arg.split("=", 1)[1] if "=" in arg else None
                    assert value is not None, f"{source}: write --vllm-arg=--x=y (the value starts with --)"
                    assert value.split("=", 1)[0] in VLLM_SERVE_FLAGS, f"{source}: unknown vLLM flag {value}"
    assert checked > 50


def test_every_deploy_file_serves_vllm_colocated_with_unsloth():
    for source, invocations in all_invocations().items():
        serves = [args for command, args in invocations if command == "serve" and "--help" not in args]
        if source == "README.md" or not serves:
            continue
        for args in serves:
            given = dict(zip(args, args[1:], strict=False))
            assert given.get("--engine") == "vllm" and given.get("--backend") == "unsloth", source
            assert given.get("--gpu-mode") == "colocated" and given.get("--trainer") == "auto", source
            assert given.get("--device") == "cuda", source


def test_skypilot_task_and_dockerfile_are_complete():
    task = yaml.safe_load((DEPLOY / "skypilot.yaml").read_text())
    resources = task["resources"]
    assert resources["ports"] == 8000
    assert all(choice["accelerators"].endswith(":1") for choice in resources["any_of"])
    assert "RLPROXY_API_KEY" in task["secrets"]  # required at launch: the port is public
    assert ".[gateway,train,gpu]" in task["setup"] and task["workdir"] == "."
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM vllm/vllm-openai:v0\.([1-9][0-9]|10\.[2-9])", dockerfile, re.M)
    for path in re.findall(r"^COPY (\S+)", dockerfile, re.M):
        assert (ROOT / path).exists() or path in ("README.md",), f"Dockerfile copies missing {path}"
    assert re.search(r'"--host", "0\.0\.0\.0"', dockerfile)


@pytest.mark.parametrize("script", SCRIPTS)
def test_shell_scripts_parse_and_are_executable(script):
    path = DEPLOY / script
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    assert path.stat().st_mode & 0o111, f"{script} is not executable"
    assert path.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in path.read_text()


def test_single_gpu_presets_cover_the_documented_cards():
    text = (DEPLOY / "single-gpu.sh").read_text()
    readme = (DEPLOY / "README.md").read_text()
    for card in ("24 GB", "48 GB", "80 GB"):
        assert card in readme
    for util, length, rank in (("0.55", "8192", "16"), ("0.60", "16384", "32"), ("0.70", "32768", "64")):
        assert f"UTIL={util} MAX_LEN={length} RANK={rank}" in text
        assert re.search(rf"\| {util} \| {length} \| {rank} \({rank}\)", readme), (util, length, rank)
