"""The README's SDK, RULER and three-line examples run as written against `rlproxy serve`.

The gateway is a child process (`--engine openai` in front of the fake upstream, no
trainer); the examples run as child processes too, with `RLPROXY_URL` pointing at it.
The RULER example's `openai/o3` judge reaches the loopback judge through the gateway's
`OPENAI_BASE_URL`, which litellm reads, so not a character of the example changes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.fake_upstream import FakeUpstream
from tests.helpers import gateway_process
from tests.helpers_judge import FakeJudge

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def code_blocks(path: Path, language: str) -> list[str]:
    """Fenced blocks of one language, in order."""
    return [body for lang, body in _FENCE.findall(path.read_text()) if lang == language]


def after_diff(diff: str) -> str:
    """The program a ```diff block turns into: context and added lines, markers removed."""
    return "\n".join(line[1:] for line in diff.splitlines() if not line.startswith("-"))


def sdk_examples(path: Path) -> list[str]:
    """The runnable examples: Python blocks that use the SDK, and the conversion diff."""
    blocks = [b for b in code_blocks(path, "python") if "from sdk import" in b]
    blocks += [after_diff(d) for d in code_blocks(path, "diff") if "X-Session-Id" in d]
    return blocks


def examples_file() -> Path:
    return README


def _example(marker: str) -> str:
    matches = [block for block in sdk_examples(examples_file()) if marker in block]
    assert len(matches) == 1, f"expected one example containing {marker!r}, found {len(matches)}"
    return matches[0]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`rlproxy serve` with a fake upstream and a loopback judge; yields (gateway URL, judge)."""
    state_dir = tmp_path_factory.mktemp("readme-state")
    with FakeUpstream() as upstream, FakeJudge() as judge:
        env = {
            "OPENAI_BASE_URL": judge.url,
            "OPENAI_API_KEY": "sk-readme-test-judge-key",
            "LANGFUSE_PUBLIC_KEY": "",
            "LANGFUSE_SECRET_KEY": "",
            "LANGFUSE_HOST": "",
        }
        args = ["--engine", "openai", "--upstream-url", upstream.url, "--trainer", "off", "--state-dir", str(state_dir)]
        args += ["--judge-model", "openai/o3"]  # as the README says to start it for its RULER example
        args += ["--live-group-size", "8"]  # and for live groups
        with gateway_process(args, env=env) as (_, url):
            yield url, judge


def _run(code: str, url: str, tmp_path: Path, openai_key: bool = True) -> str:
    script = tmp_path / "example.py"
    script.write_text(code)
    # PYTHONPATH: the checkout's packages, even where an editable install predates one of them.
    env = {
        **os.environ,
        "RLPROXY_URL": url + "/v1",
        "OPENAI_API_KEY": "sk-readme-test-key",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("OPENAI_BASE_URL", None)
    if not openai_key:  # a newcomer's shell: the official client must not need one to reach the gateway
        env.pop("OPENAI_API_KEY")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"example failed:\n{code}\n--- stderr ---\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_examples_are_found():
    assert len(sdk_examples(examples_file())) == 3


def test_three_line_conversion_runs(served, tmp_path):
    url, _ = served
    code = _example("X-Session-Id")
    changed = [line for line in code_blocks(examples_file(), "diff")[0].splitlines() if line[:1] in "+-"]
    assert len([line for line in changed if line.startswith("+")]) <= 3
    _run(code, url, tmp_path, openai_key=False)
    group = httpx.get(f"{url}/v1/groups/two-plus-two").json()
    assert group["n_sessions"] == 4 and group["n_rewarded"] == 4


def test_sdk_example_runs(served, tmp_path):
    url, _ = served
    out = _run(_example("group.run(rollout, n=8"), url, tmp_path)
    assert out.startswith("8 rollouts, 0 failed, rewards [")


def test_live_traffic_example_runs_and_its_reward_answers_as_shown(served, tmp_path):
    url, _ = served
    (code,) = [block for block in code_blocks(examples_file(), "python") if "X-Task-Id" in block]
    assert code.count("http://localhost:8000/v1") == 1
    # A newcomer's shell has no OPENAI_API_KEY: the client must not need one to reach the gateway.
    _run(code.replace("http://localhost:8000/v1", url + "/v1"), url, tmp_path, openai_key=False)
    (curl,) = [block for block in code_blocks(examples_file(), "bash") if "ticket-1234/reward" in block]
    assert "curl --json '{\"reward\": 1.0}' localhost:8000/v1/sessions/ticket-1234/reward" in curl
    answer = httpx.post(f"{url}/v1/sessions/ticket-1234/reward", json={"reward": 1.0}).json()
    assert answer["session_id"] == "ticket-1234" and answer["reward"] == 1.0 and answer["trainable"] is True
    assert answer["group_id"].startswith("live-")
    assert httpx.get(f"{url}/v1/sessions/ticket-1234").json()["task_key"] == "refund-request"


def test_ruler_example_runs(served, tmp_path):
    url, judge = served
    before = len(judge.requests)
    out = _run(_example('group.ruler("openai/o3")'), url, tmp_path)
    lines = out.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("sess_") for line in lines)
    (request,) = judge.requests[before:]
    assert request["body"]["model"] == "o3"
    assert "You write haiku about the sea." in request["body"]["messages"][1]["content"]
