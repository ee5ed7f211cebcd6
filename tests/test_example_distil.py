"""examples/distil/run.sh, phase by phase, on the built-in model: record an agent on a "hosted"
teacher, distil its good sessions into the student, then reinforce the student with GRPO.

- record: the teacher is `tests/fake_upstream.FakeUpstream` (it answers every message by echoing
  the customer's last one, and wants the key the script hands on) behind the script's gateway
  (`--engine openai`). The agent is the retail example, two tasks, two rollouts each, two model
  calls at most: a teacher that changes nothing scores 1 on the request the policy refuses
  (`cancel-shipped-refused`) and 0 on the one it should serve (`cancel-by-mistake`), so the
  script's own `MIN_REWARD=0.8` selects exactly the two sessions of the first.
- distil: `rlproxy train --objective sft` into the built-in `rlproxy/tiny-qwen2` (a rank-4 LoRA
  on CPU), one session a step: two SFT steps. The built-in instruct model would do as well, but
  building it takes about two minutes on two cores, once per test run, and the path is the same.
  The student is a copy whose config states a 4,096-token context: the teacher's sessions take
  about 2,900 tokens, past the 2,048 the built-in one states, and the trainer trains no position
  past the student's context (a session whose first reply lies past it is left out).
- reinforce: the student served by the local engine, with its trainer. The retail agent cannot
  run there (its policy and tools take about 2,900 of the built-in model's 2,048-token context:
  examples/retail/README.md), so a stand-in agent with the same command line plays (this file,
  run as `python -m tests.test_example_distil`): one group of two one-call rollouts, ranked by
  the order they finish, so the group always has a reward spread and is trained. With
  `--groups-per-step 1` it makes a step; the script's drain waits for it before stopping the gateway.

Asserted on the store afterwards: the teacher's sessions recorded under its model id, the SFT
steps on the selected sessions, the GRPO step after them on the student's own traffic (served by
the newest SFT step), and no process left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "examples/distil/run.sh"
TEACHER_MODEL = "teacher-model"  # the id the agent asks the hosted API for
TEACHER_KEY = "sk-teacher-test"
GOOD, BAD = "cancel-shipped-refused", "cancel-by-mistake"


# ---------------------------------------------------------------- the stand-in agent (reinforce)


def stand_in_agent(argv: list[str] | None = None) -> None:
    """The retail agent's command line (--base-url --model --tasks --rollouts), one short call a rollout."""
    from sdk import RLProxy

    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tasks", type=int, default=1)
    parser.add_argument("--rollouts", type=int, default=2)
    args = parser.parse_args(argv)
    proxy = RLProxy(base_url=args.base_url)
    try:
        for task in range(args.tasks):
            finished = itertools.count()
            lock = threading.Lock()

            def rollout(session, finished=finished, lock=lock) -> float:
                session.openai_client().chat.completions.create(
                    model=args.model,
                    messages=[
                        {"role": "system", "content": "You serve the customers of an online store."},
                        {"role": "user", "content": "Please cancel my order #W1003."},
                    ],
                    max_tokens=8,
                    temperature=1.0,
                )
                with lock:
                    return next(finished) / max(args.rollouts - 1, 1)

            with proxy.group() as group:
                result = group.run(rollout, n=args.rollouts, concurrency=args.rollouts)
            print(f"task {task} ({group.id}): rewards {sorted(result.rewards)}", flush=True)
    finally:
        proxy.close()


if __name__ == "__main__":
    stand_in_agent()
    sys.exit(0)


# ---------------------------------------------------------------- the test

from tests.fake_upstream import FakeUpstream  # noqa: E402
from tests.helpers import free_port  # noqa: E402
from tests.helpers_trainer import tiny_qwen2_reading  # noqa: E402


def processes_of(state: Path) -> list[int]:
    """Processes whose command line names the test's state directory (gateways, trainers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if str(state).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def run_phase(phase: str, env: dict, timeout: float = 120) -> str:
    """`bash examples/distil/run.sh PHASE`; its output. On a timeout the script gets SIGTERM, so
    that its trap stops the gateway, as Ctrl-C would."""
    proc = subprocess.Popen(
        ["bash", str(RUN), phase],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        raise AssertionError(f"run.sh {phase} took over {timeout} s:\n{output[-6000:]}") from None
    assert proc.returncode == 0, f"run.sh {phase} exited with {proc.returncode}:\n{output[-6000:]}"
    return output


def rows(db: Path, sql: str, *params) -> list[dict]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(row) for row in conn.execute(sql, params)]


def test_record_distil_reinforce_on_the_built_in_model(tmp_path):
    state = tmp_path / "state"
    db = state / "rlproxy.db"
    python = sys.executable
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHON": python,
        "RLPROXY": f"{python} -m gateway.cli",
        "STATE": str(state),
        "PORT": str(free_port()),
        # record
        "TEACHER_KEY": TEACHER_KEY,
        "TEACHER_MODEL": TEACHER_MODEL,
        "TASKS": "2",
        "TEACHER_ROLLOUTS": "2",
        "AGENT_ARGS": f"--task {GOOD} --task {BAD} --max-turns 2 --max-tokens 32",
        # distil (MIN_REWARD stays the script's 0.8)
        "STUDENT": str(tiny_qwen2_reading(tmp_path, 4096)),
        "ENGINE": "local",
        "DEVICE": "cpu",
        "EPOCHS": "1",
        "TRAIN_ARGS": "--lora-rank 4 --lora-alpha 8",
        "SFT_ARGS": "--sft-sessions-per-step 1",
    }
    env.pop("PYTHONPATH", None)  # the script and the agents find `gateway`, `sdk` and `examples` themselves
    try:
        # ------------------------------------------------ record
        with FakeUpstream(api_key=TEACHER_KEY) as teacher:
            out = run_phase("record", {**env, "TEACHER_URL": teacher.url})
            chats = teacher.chat_requests()
        assert f"{GOOD} (grp_" in out and f"{BAD} (grp_" in out and "gateway stopped" in out, out
        assert chats and all(r.body["model"] == TEACHER_MODEL for r in chats)  # the id went upstream as it was
        assert all(r.headers["authorization"] == f"Bearer {TEACHER_KEY}" for r in chats)
        teacher_sessions = rows(db, "SELECT id, group_id, reward FROM sessions WHERE model = ?", TEACHER_MODEL)
        assert len(teacher_sessions) == 4 and sorted(s["reward"] for s in teacher_sessions) == [0.0, 0.0, 1.0, 1.0]
        assert processes_of(state) == []

        # ------------------------------------------------ distil
        out = run_phase("distil", env)
        selected = [json.loads(line)["id"] for line in (state / "distil-selection.jsonl").read_text().splitlines()]
        good = sorted(s["id"] for s in teacher_sessions if s["reward"] == 1.0)
        assert sorted(selected) == good, out
        steps = rows(db, "SELECT step, metrics FROM steps WHERE model = 'agent' ORDER BY step")
        assert [s["step"] for s in steps] == [0, 1, 2], out
        for step in steps[1:]:
            metrics = json.loads(step["metrics"])
            assert metrics["objective"] == "sft" and metrics["loss"] > 0 and metrics["sessions"] == 1
        snapshot = json.loads((state / "models/agent/checkpoints/0002/trainer_state.json").read_text())
        assert sorted(snapshot["sft"]["train"]) == good and snapshot["sft"]["epoch"] == 1
        skipped = {g["id"]: g["skipped"] for g in rows(db, "SELECT id, skipped FROM groups")}
        good_group = {s["group_id"] for s in teacher_sessions if s["reward"] == 1.0}.pop()
        assert skipped.pop(good_group).startswith("distilled") and set(skipped.values()) == {None}
        assert "agent@2: sft" in out and processes_of(state) == []

        # ------------------------------------------------ reinforce
        started = time.time()
        out = run_phase(
            "reinforce",
            {
                **env,
                "AGENT": f"{python} -m tests.test_example_distil",
                "AGENT_ARGS": "",
                "RL_TASKS": "1",
                "ROLLOUTS": "2",
                "SERVE_ARGS": "--groups-per-step 1 --poll-interval 0.2",
                "DRAIN": "90",
            },
        )
        steps = rows(db, "SELECT step, metrics, groups FROM steps WHERE model = 'agent' ORDER BY step")
        assert [s["step"] for s in steps] == [0, 1, 2, 3], out
        grpo = steps[3]
        assert "objective" not in json.loads(grpo["metrics"])  # a GRPO step, after the SFT ones
        (group,) = json.loads(grpo["groups"])
        student = rows(db, "SELECT id, reward FROM sessions WHERE group_id = ?", group)
        assert sorted(s["reward"] for s in student) == [0.0, 1.0]
        calls = rows(db, "SELECT model, step, engine FROM calls WHERE group_id = ?", group)
        assert len(calls) == 2 and all(c == {"model": "agent", "step": 2, "engine": "local"} for c in calls)
        assert rows(db, "SELECT trained_step FROM groups WHERE id = ?", group) == [{"trained_step": 3}]
        assert "agent@3: grpo" in out and "gateway stopped" in out
        assert processes_of(state) == []
        print(f"reinforce took {time.time() - started:.0f} s")
    finally:
        for pid in processes_of(state):  # only after a failure: the test's own gateways and trainers
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
