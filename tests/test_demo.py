"""`rlproxy demo` end to end, on a small budget: gateway, `rlproxy train` child, the SHOUT
agent over HTTP, summary.json and the reward curve. Whether it learns is
tests/test_learning.py's job (and docs/demo.md's runs'); here, that the whole loop runs and
reports what it promises."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.demo.words import DICTIONARY, dictionary_share
from gateway.store.sqlite import SQLiteStore
from tests.browser import find_or_install_word_list

ROOT = Path(__file__).resolve().parents[1]


def run_demo(out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gateway.cli", "demo", "--out", str(out), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer child dies with it (PR_SET_PDEATHSIG)
        stdout, stderr = proc.communicate()
        pytest.fail(f"rlproxy demo did not finish in {timeout} s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_demo_runs_the_loop_and_writes_summary_and_curve(tmp_path):
    out = tmp_path / "demo"
    result = run_demo(
        out,
        "--steps",
        "2",
        "--rollouts",
        "4",
        "--groups-per-step",
        "2",
        "--eval-groups",
        "1",
        "--max-tokens",
        "4",
        "--eval-temperature",
        "0",
        "--seed",
        "1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "baseline reward" in result.stdout

    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "baseline_reward",
        "final_reward",
        "reward_by_step",
        "seconds",
        "final_step",
        "aim",
        "settings",
        "demo",
        "task",
        "stopped_because",
    ):
        assert key in summary, key
    assert 0.0 <= summary["baseline_reward"] <= 1.0
    assert 0.0 <= summary["final_reward"] <= 1.0
    assert summary["final_step"] == 2  # two training steps landed and were hot-swapped in
    assert summary["stopped_because"] == "steps"
    assert {"0", "1"} <= set(summary["reward_by_step"])  # the rollouts each step sampled
    assert all(0.0 <= r <= 1.0 for r in summary["reward_by_step"].values())
    assert summary["seconds"] > 0
    assert summary["demo"]["steps"] == 2 and summary["demo"]["rollouts"] == 4
    assert summary["settings"]["groups_per_step"] == 2
    assert summary["settings"]["learning_rate"] == 1e-2  # the demo's tuning, not the serve default
    assert summary["task"] == "shout"  # the default task; every task writes the same keys
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "step 2" in (out / "trainer.log").read_text()
    with contextlib.closing(sqlite3.connect(out / "state" / "rlproxy.db")) as db:
        recorded = [step for (step,) in db.execute("SELECT step FROM steps ORDER BY step")]
    assert recorded == [0, 1, 2]  # --steps 2: no third step trained while the held-out set was played
    # What was learned, read: three replies under each step's line, one line each, and more in summary.json
    lines = result.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("step   0: reward"))
    shown = [line.strip() for line in lines[at + 1 : at + 4]]
    assert all(line[0] in "'\"" and len(line) <= 60 for line in shown), shown
    assert {"0", "1"} <= set(summary["samples_by_step"])
    assert all(1 <= len(replies) <= 8 for replies in summary["samples_by_step"].values())
    assert len(summary["final_samples"]) == 4  # the held-out set: 1 group x 4 rollouts, one reply each
    assert summary["english"] == dictionary_share(summary["final_samples"])
    assert summary["english_by_step"] == {
        step: dictionary_share(replies) for step, replies in summary["samples_by_step"].items()
    }
    # The held-out set: the same tasks for the baseline and the final score (the first and the
    # last val group), one per val rollout
    with sqlite3.connect(out / "state" / "rlproxy.db") as db:
        rows = db.execute("SELECT DISTINCT group_id FROM sessions WHERE group_id LIKE 'demo-val-%'")
        groups = sorted(group for (group,) in rows)
    store = SQLiteStore(out / "state" / "rlproxy.db")
    prompts = [
        [store.session_calls(f"{group}-r{i}")[0]["request"]["messages"][-1]["content"] for i in range(4)]
        for group in (groups[0], groups[-1])
    ]
    assert len(groups) == 2 and prompts[0] == prompts[1]
    # --eval-temperature 0: the held-out set is played greedily, training rollouts sample at 1
    with sqlite3.connect(out / "state" / "rlproxy.db") as db:
        sessions = db.execute("SELECT id, split FROM sessions WHERE group_id LIKE 'demo-%'").fetchall()
    temperatures = {
        (split, call["request"]["temperature"]) for session, split in sessions for call in store.session_calls(session)
    }
    assert temperatures == {("val", 0.0), ("train", 1.0)}


def test_dictionary_share_by_hand():
    """The hack's measure (issue 39): words are runs of 3+ ASCII letters, looked up ignoring case."""
    words = ["hello", "world", "the", "cat", "sat", "mat"]
    texts = ["HELLO world, hello!", "LADERMARKEL xy", None, "the CAT sat on\nthe mat"]
    # 9 words (xy and on are too short): all but LADERMARKEL found; 6 distinct among the 8 found
    assert dictionary_share(texts, words) == {"share": 8 / 9, "distinct_share": 6 / 8, "words": 9}
    assert dictionary_share(["LADERMARKEL ZORP"], words) == {"share": 0.0, "distinct_share": None, "words": 2}
    assert dictionary_share(["!!", ""], words)["share"] is None


def test_dictionary_share_reads_debians_word_list():
    found, why = find_or_install_word_list()
    if found != str(DICTIONARY):
        pytest.skip(why or f"RLPROXY_WORD_LIST is not {DICTIONARY}, the list the demo reads")
    english = dictionary_share(["THE CAPITAL OF FRANCE IS PARIS", "LADERMARKEL BRONTISH"])
    assert english == {"share": 4 / 6, "distinct_share": 1.0, "words": 6}


def test_demo_refuses_a_state_dir_with_checkpoints(tmp_path):
    state = tmp_path / "state"
    (state / "models" / "agent" / "checkpoints" / "0000").mkdir(parents=True)
    result = run_demo(tmp_path / "out", "--state-dir", str(state), timeout=60)
    assert result.returncode == 2
    assert "trains from scratch" in result.stderr


def test_demo_refuses_an_out_that_is_a_file_in_one_line(tmp_path):
    # --out notes.txt (or notes.txt/run) ended in mkdir's FileExistsError traceback.
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for out in (notes, notes / "run"):
        result = run_demo(out, timeout=60)
        assert result.returncode == 2
        assert f"rlproxy demo: --out {out} cannot be used (it or a folder on its path is a file)" in result.stderr
        assert "Traceback" not in result.stderr and notes.read_text() == "mine"


@pytest.mark.parametrize(
    "flags",
    [
        ["--live", "rewards", "--arrival-rate", "inf"],  # expovariate(inf) is 0: sessions spawned without end
        ["--live", "rewards", "--reward-delay", "inf"],  # each reward slept forever, and the drain waited
        ["--seconds", "nan"],  # the budget never ran out: every comparison with nan is false
    ],
)
def test_demo_refuses_a_number_that_is_not_finite(flags, capsys):
    from gateway.cli import build_parser
    from gateway.demo.options import options_from_args

    with pytest.raises(SystemExit) as refused:
        options_from_args(build_parser().parse_args(["demo", *flags]))
    assert refused.value.code == 2
    assert f"argument {flags[-2]}: '{flags[-1]}' is not a finite number" in capsys.readouterr().err


def test_a_second_demo_on_the_same_out_refuses_and_leaves_the_first_alone(tmp_path):
    # The second run used to clear the first's store and checkpoints and run on beside it: two
    # trainers saving steps into one checkpoint directory, one summary.json written twice, rc 0.
    out = tmp_path / "demo"
    flags = ["--steps", "3", "--rollouts", "4", "--groups-per-step", "2", "--eval-groups", "1", "--max-tokens", "4"]
    first_stdout = tmp_path / "first.stdout"
    with first_stdout.open("w") as stdout:
        first = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "demo", "--out", str(out), *flags],
            cwd=ROOT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            stdout=stdout,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        while "step   0: reward" not in first_stdout.read_text():  # the first is training
            assert first.poll() is None, "the first demo ended before its first step"
            time.sleep(0.2)
        second = run_demo(out, *flags, timeout=120)
        assert second.returncode == 2
        assert f"rlproxy demo: --out {out} is in use by another rlproxy demo (pid {first.pid})" in second.stderr
        assert first.wait(timeout=240) == 0
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_step"] == 3 and summary["stopped_because"] == "steps"
    with sqlite3.connect(out / "state" / "rlproxy.db") as db:  # the first's own store, not cleared under it
        assert db.execute("SELECT max(step) FROM steps WHERE model = 'agent'").fetchone() == (3,)


def test_demo_says_in_one_line_why_the_gateway_refused_its_calls(tmp_path):
    # --max-tokens past the model's context: the gateway's 400 ended in openai's traceback, exit 1.
    result = run_demo(
        tmp_path / "demo", "--steps", "1", "--rollouts", "2", "--eval-groups", "1", "--max-tokens", "5000"
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        "rlproxy demo: the gateway refused the agent's call: 'max_tokens' is 5000, but the model's context is "
        "2048 tokens, prompt included: ask for fewer than 2048 tokens; lower --max-tokens"
    ) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "flags, refusal",
    [
        (["--arrival-rate", "5"], "--arrival-rate is read only with --live (rewards or shadows)"),
        (["--reward-delay", "-1", "--unrewarded-share", "0.5"], "--reward-delay and --unrewarded-share are read only"),
        (["--live", "shadows", "--reward-delay", "2"], "--reward-delay is read only with --live rewards"),
        (["--teacher-games", "64"], "--teacher-games is read only with --warm-start sft"),
    ],
)
def test_demo_refuses_a_modes_flag_without_the_mode(flags, refusal):
    # Each ran the harness demo (no stream, no warm start) and said nothing of the flag.
    from gateway.cli import build_parser
    from gateway.demo.options import options_from_args
    from gateway.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(refusal)):
        options_from_args(build_parser().parse_args(["demo", *flags]))


def test_a_refused_warm_start_leaves_the_previous_demo_alone(tmp_path):
    # `--warm-start sft` on shout (no teacher) was refused only after the previous run's store
    # and checkpoints in OUT/state had been cleared.
    out = tmp_path / "demo"
    checkpoint = out / "state" / "models" / "agent" / "checkpoints" / "0003"
    checkpoint.mkdir(parents=True)
    (out / "state" / "rlproxy.db").write_bytes(b"the previous run")
    result = run_demo(out, "--warm-start", "sft", timeout=60)
    assert result.returncode == 2
    assert "rlproxy demo: --warm-start sft needs a task with a teacher; 'shout' has none" in result.stderr
    assert checkpoint.is_dir() and (out / "state" / "rlproxy.db").read_bytes() == b"the previous run"


def test_demo_runs_with_the_api_key_exported_for_serve(tmp_path, monkeypatch):
    # RLPROXY_API_KEY, exported for `rlproxy serve`, reached the demo's gateway but not its agent:
    # the first call ended in openai's 401 traceback, exit 1.
    monkeypatch.setenv("RLPROXY_API_KEY", "demo-key-0123456789abcdef")
    out = tmp_path / "demo"
    result = run_demo(out, "--steps", "1", "--rollouts", "2", "--eval-groups", "1", "--max-tokens", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["final_step"] == 1


def test_demo_refuses_a_shared_store_from_the_environment(tmp_path, monkeypatch):
    # RLPROXY_STORE exported for `rlproxy serve`: the demo recorded its sessions and wrote its steps
    # of 'agent' (its own checkpoints) into that store, where the real gateways would swap to them.
    shared = tmp_path / "shared" / "rlproxy.db"
    shared.parent.mkdir()
    monkeypatch.setenv("RLPROXY_STORE", f"sqlite:///{shared}")
    result = run_demo(tmp_path / "demo", "--steps", "1", "--rollouts", "2", "--eval-groups", "1", timeout=60)
    assert result.returncode == 2
    assert "rlproxy demo: RLPROXY_STORE is set: the demo keeps its own store in its state dir" in result.stderr
    assert not shared.exists()
