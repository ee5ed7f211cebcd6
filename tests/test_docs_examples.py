"""The commands and examples of docs/serving.md and docs/export.md run as written.

Against `rlproxy serve` (a child process, `--engine openai` in front of the fake upstream, no
trainer): serving.md's reward and close `curl`s, its sessions-in-the-base-URL clients,
`rlproxy forget` (its commands, the output it shows, its refusals), export.md's
`rlproxy export` lines, the status and code of each limit in serving.md's table and
ruler.md's refusal of a judge the gateway was not started with. Each command is taken from
the doc and changed only where it must be (the port, the state dir), so a renamed flag, route,
field or error code fails here before a reader finds it. Commands that need a GPU or a model hub
cannot run here; every `rlproxy ...` line of every doc's bash blocks is at least parsed by the
CLI's own parser, every example agent's flag looked up in its --help, every `METHOD /path`
the docs name looked up in /openapi.json, and every `RLPROXY_*` variable among those rlproxy reads.
The README's SDK, RULER and three-line examples: tests/test_readme_examples.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
from anthropic import Anthropic
from openai import OpenAI

from gateway.cli import build_parser
from gateway.settings_env import unknown_variables
from tests.fake_upstream import FakeUpstream
from tests.helpers import gateway_process
from tests.test_readme_examples import README, ROOT, code_blocks

SERVING = ROOT / "docs" / "serving.md"
EXPORT = ROOT / "docs" / "export.md"
RULER = ROOT / "docs" / "ruler.md"
DOC_PORT = "localhost:8000"
EVERY_DOC = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
EVERY_DOC += sorted((ROOT / "examples").glob("*/README.md"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`rlproxy serve`: yields (gateway URL, its state dir)."""
    state_dir = tmp_path_factory.mktemp("docs-state")
    with FakeUpstream() as upstream:
        args = ["--engine", "openai", "--upstream-url", upstream.url, "--trainer", "off", "--state-dir", str(state_dir)]
        args += ["--max-n", "4", "--max-messages", "16", "--max-body-mb", "1"]  # limits a test can pass cheaply
        with gateway_process(args, env={"LANGFUSE_PUBLIC_KEY": "", "LANGFUSE_SECRET_KEY": ""}) as (_, url):
            yield url, state_dir


def _at(url: str, text: str) -> str:
    """The doc's text with its `localhost:8000` pointed at the test's gateway (still `localhost`)."""
    assert DOC_PORT in text
    return text.replace(DOC_PORT, "localhost:" + url.rsplit(":", 1)[1])


def _one_block(path: Path, language: str, marker: str) -> str:
    matches = [block for block in code_blocks(path, language) if marker in block]
    assert len(matches) == 1, f"expected one {language} block of {path.name} with {marker!r}, found {len(matches)}"
    return matches[0]


def _commands(block: str, program: str) -> list[str]:
    """The block's lines that run `program`, their comments cut off."""
    return [line.split(" #")[0].strip() for line in block.splitlines() if line.startswith(program + " ")]


def _cli(command: str, state_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    """Runs one documented `rlproxy ...` line as `python -m gateway.cli ...`, its `.rlproxy` the test's store."""
    argv = shlex.split(command)
    assert argv[0] == "rlproxy"
    argv = [str(state_dir) if arg == ".rlproxy" else arg for arg in argv[1:]]
    if "--state-dir" not in argv:
        argv += ["--state-dir", str(state_dir)]
    # PYTHONPATH: the checkout's gateway, even where an editable install points at another (cwd is not ROOT).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def _rewarded_session(url: str, group: str, reward: float) -> str:
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "agent", "messages": [{"role": "user", "content": "hello"}]},
        headers={"X-Group-Id": group},
    )
    reply.raise_for_status()
    session = reply.headers["X-Session-Id"]
    httpx.post(f"{url}/v1/sessions/{session}/reward", json={"reward": reward}).raise_for_status()
    return session


def test_serving_md_repeats_the_readme_as_it_is():
    """serving.md is the README section's full reference: the commands they share stay one text."""
    serve = _one_block(README, "bash", "rlproxy serve --base-model")
    assert serve in code_blocks(SERVING, "bash")
    curls = _one_block(README, "bash", "$SESSION/reward")
    assert curls == _one_block(SERVING, "bash", "$SESSION/reward")
    readme_urls = _one_block(README, "python", "/groups/task-7/sessions/rollout-3")
    serving_urls = _one_block(SERVING, "python", "/groups/task-7/sessions/rollout-3").splitlines()
    assert all(line in serving_urls for line in readme_urls.splitlines())


@pytest.mark.skipif(shutil.which("curl") is None, reason="the doc's commands are curl's")
def test_reward_and_close_curls_run_as_written(served):
    url, _ = served
    session = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "agent", "messages": [{"role": "user", "content": "hello"}]},
        headers={"X-Group-Id": "docs-curl"},
    ).headers["X-Session-Id"]
    block = _at(url, _one_block(SERVING, "bash", "$SESSION/reward"))
    curl = shutil.which("curl")
    assert curl is not None
    env = {"PATH": str(Path(curl).parent), "SESSION": session, "GROUP": "docs-curl"}
    bash = shutil.which("bash") or "/bin/bash"
    done = subprocess.run([bash, "-ec", block], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line) for line in done.stdout.replace("}{", "}\n{").splitlines()]
    assert [answer.get("error") for answer in answers] == [None, None], answers
    recorded = httpx.get(f"{url}/v1/sessions/{session}").json()
    assert recorded["reward"] == 1.0 and recorded["metrics"] == {"steps": 3.0}
    group = httpx.get(f"{url}/v1/groups/docs-curl").json()
    assert group["closed"] is True and group["ready"] is True


def test_sessions_in_the_base_url_as_written(served):
    """Each client of the doc, made by its line as written, lands its call in the session it names."""
    url, _ = served
    block = _at(url, _one_block(SERVING, "python", "/groups/task-7/sessions/rollout-3"))
    lines = [line.split("  #")[0] for line in block.splitlines() if line.strip()]
    assert len(lines) == 3
    for line in lines:
        client = eval(line, {"OpenAI": OpenAI, "Anthropic": Anthropic, "KEY": "none"})  # noqa: S307 (the doc's own line)
        if isinstance(client, Anthropic):
            client.messages.create(model="agent", max_tokens=16, messages=[{"role": "user", "content": "hello"}])
        else:
            client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "hello"}])
    rollout = httpx.get(f"{url}/v1/sessions/rollout-3").json()
    assert rollout["group_id"] == "task-7" and rollout["n_calls"] == 2
    assert sorted(call["protocol"] for call in rollout["calls"]) == ["chat", "messages"]
    ticket = httpx.get(f"{url}/v1/sessions/ticket-1234").json()
    assert ticket["task_key"] == "refunds" and ticket["group_id"] is None and ticket["n_calls"] == 1


def _shape(doc_line: str) -> re.Pattern:
    """A line of the doc's sample output as a pattern: its numbers any numbers, its `...` anything."""
    pattern = re.escape(doc_line).replace(re.escape("..."), ".*")
    return re.compile(re.sub(r"\d+", r"\\d+", pattern) + "$")


def test_forget_runs_as_written_and_prints_what_the_doc_shows(served, tmp_path):
    url, state_dir = served
    _rewarded_session(url, "docs-forget", 0.5)
    commands = _commands(_one_block(SERVING, "bash", "rlproxy forget"), "rlproxy")
    assert len(commands) == 3
    outputs = {}
    for command in commands:
        done = _cli(command, state_dir, tmp_path)
        assert done.returncode == 0, f"{command}:\n{done.stderr}"
        outputs[command] = done.stdout.splitlines()
    (sample,) = re.findall(r"^```\n(cutoff: .*?)^```", SERVING.read_text(), re.DOTALL | re.MULTILINE)
    printed = outputs["rlproxy forget --older-than 30d"]  # the run the sample shows (not the dry run)
    shown = sample.splitlines()
    # The last line only comes once the file has free pages, which a young store lacks.
    assert len(printed) in (len(shown) - 1, len(shown)), printed
    for doc_line, line in zip(shown, printed, strict=False):
        assert _shape(doc_line).match(line), f"the doc shows {doc_line!r}, forget printed {line!r}"
    assert httpx.get(f"{url}/v1/groups/docs-forget").status_code == 200  # a young session stays


@pytest.mark.parametrize("flags", [["--older-than", "30x"], ["--before", "2999-01-01"]])
def test_forget_refuses_in_one_line_with_exit_2(served, tmp_path, flags):
    """serving.md: 'a duration it cannot read (30x ...) or a --before in the future is refused in one line, exit 2'."""
    _, state_dir = served
    done = _cli(shlex.join(["rlproxy", "forget", *flags]), state_dir, tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


def _doc_parquet_columns() -> list[str]:
    (row,) = [line for line in EXPORT.read_text().splitlines() if line.startswith("| `parquet` |")]
    return re.findall(r"`(\w+)`", row.split("|")[3])


def test_export_lines_run_as_written(served, tmp_path):
    url, state_dir = served
    session = _rewarded_session(url, "docs-export", 1.0)
    commands = _commands(_one_block(EXPORT, "bash", "--format parquet"), "rlproxy")
    assert len(commands) == 3
    assert set(_commands(_one_block(README, "bash", "rlproxy export "), "rlproxy export")) <= set(commands)
    for command in commands:
        done = _cli(command, state_dir, tmp_path)
        assert done.returncode == 0, f"{command}:\n{done.stderr}"
    sessions = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    (exported,) = [row for row in sessions if row["id"] == session]
    assert exported.keys() == httpx.get(f"{url}/v1/sessions/{session}").json().keys()  # as GET returns it
    assert (tmp_path / "sft.jsonl").exists()  # nothing trained since step 30: empty, but written
    columns = pq.read_table(tmp_path / "samples.parquet").column_names
    documented = _doc_parquet_columns()
    assert len(documented) >= 10 and set(documented) <= set(columns), set(documented) - set(columns)


_USER = {"role": "user", "content": "hello"}
PAST_THE_LIMITS = {  # the served gateway's --max-n 4, --max-messages 16, --max-body-mb 1, each passed
    "n_too_large": ("/v1/chat/completions", {"model": "agent", "messages": [_USER], "n": 5}),
    "too_many_messages": ("/v1/chat/completions", {"model": "agent", "messages": [_USER] * 17}),
    "too_many_prompts": ("/v1/completions", {"model": "agent", "prompt": ["hello"] * 5}),
    "request_too_large": (
        "/v1/chat/completions",
        {"model": "agent", "messages": [{"role": "user", "content": "x" * (1 << 20)}]},
    ),
}


def test_limits_answer_with_the_status_and_code_of_serving_md_table(served):
    url, _ = served
    table = dict((code, int(status)) for status, code in re.findall(r"\| (\d{3}) `(\w+)`", SERVING.read_text()))
    assert set(PAST_THE_LIMITS) <= set(table), set(PAST_THE_LIMITS) - set(table)
    for code, (path, body) in PAST_THE_LIMITS.items():
        answer = httpx.post(url + path, json=body)
        assert (answer.status_code, answer.json()["error"]["code"]) == (table[code], code), answer.text


def test_a_judge_the_gateway_was_not_started_with_is_refused_as_ruler_md_says(served):
    url, _ = served
    assert "(`judge_not_allowed`, `param: judge_model`)" in RULER.read_text()
    _rewarded_session(url, "docs-ruler", 1.0)
    answer = httpx.post(f"{url}/v1/groups/docs-ruler/ruler", json={"judge_model": "openai/o3"})
    error = answer.json()["error"]
    assert answer.status_code == 400 and (error["code"], error["param"]) == ("judge_not_allowed", "judge_model")
    assert "--judge-model openai/o3" in error["message"]  # it says which flag to add


def _shell_commands(path: Path) -> list[list[str]]:
    """Each simple command of the file's bash blocks, as argv (env assignments dropped)."""
    commands: list[list[str]] = []
    for block in code_blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            command: list[str] = []
            for token in [*lexer, ";"]:
                if token not in {"&&", "||", ";", "|", "&", ">", "2>", "("}:
                    command.append(token)
                    continue
                while command and re.match(r"^[A-Z_]+=", command[0]):
                    command.pop(0)
                if command:
                    commands.append(command)
                command = []
    return commands


def test_every_documented_rlproxy_command_parses():
    """Each `rlproxy ...` line of a bash block, GPU and hub ones too, is accepted by the CLI's own parser."""
    found = 0
    for path in EVERY_DOC:
        for argv in _shell_commands(path):
            if argv[0] != "rlproxy" or "..." in argv:  # `rlproxy serve ... --init-from`: a sketch, not a command
                continue
            found += 1
            stderr = io.StringIO()
            try:
                with contextlib.redirect_stderr(stderr):
                    build_parser().parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{path.relative_to(ROOT)}: {shlex.join(argv)}\n{stderr.getvalue()}")
    assert found >= 40


def test_every_documented_example_agent_flag_exists():
    """`python examples/NAME/agent.py --flag ...` lines: each flag is one the agent's --help lists."""
    flags_by_agent: dict[str, set[str]] = {}
    for path in EVERY_DOC:
        for argv in _shell_commands(path):
            if argv[0] == "python" and len(argv) > 1 and re.fullmatch(r"examples/\w+/agent\.py", argv[1]):
                flags_by_agent.setdefault(argv[1], set()).update(
                    a.split("=")[0] for a in argv[2:] if a.startswith("--")
                )
    assert len(flags_by_agent) >= 4
    for agent, flags in flags_by_agent.items():
        shown = subprocess.run(
            [sys.executable, agent, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
        ).stdout
        assert not flags - set(re.findall(r"--[a-z][a-z-]*", shown)), f"{agent}: {flags} vs --help:\n{shown}"


def test_every_documented_route_is_served(served):
    """`METHOD /path` in the docs' text names a route of /openapi.json (the pages under /ui aside)."""
    url, _ = served
    routes = [
        (re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(path)) + "$"), {m.upper() for m in methods})
        for path, methods in httpx.get(f"{url}/openapi.json").json()["paths"].items()
    ]
    wrong = []
    for doc in EVERY_DOC:
        mentions = re.findall(r"\b(GET|POST|DELETE|PUT|PATCH) (/[\w{}./-]*)", doc.read_text())
        for method, path in mentions:
            path = path.rstrip(".")
            if path == "/openapi.json" or path.startswith("/ui"):
                continue
            served_methods = [methods for pattern, methods in routes if pattern.match(path)]
            if not served_methods or method not in served_methods[0]:
                wrong.append(f"{doc.relative_to(ROOT)}: {method} {path}")
    assert not wrong, wrong


def test_every_documented_variable_is_read():
    """An `RLPROXY_*` the docs tell a user to set is one rlproxy reads (a misspelt one is ignored, with a warning)."""
    named = {name for doc in EVERY_DOC for name in re.findall(r"\bRLPROXY_[A-Z0-9_]*[A-Z0-9]", doc.read_text())}
    assert len(named) >= 10
    assert not unknown_variables(dict.fromkeys(named, "")), unknown_variables(dict.fromkeys(named, ""))
