"""Learning from live traffic (issue 30), end to end: `rlproxy demo --task shout --live ...` as
a subprocess, like tests/test_demo.py. A Poisson stream of single-call SHOUT sessions with no
X-Group-Id; the held-out val set (harness groups in split val, never trained nor shadowed)
scored before and after.

- `--live rewards`: a fifth of the sessions never rewarded, the rest rewarded after up to a
  second; the gateway gathers them into live groups of 8 (--live-group-size). It learns.
- the same with `--shuffle-rewards` (each session posted another recent session's score):
  the same traffic, the same number of steps, and nothing is learned.
- `--live shadows`: no reward is posted at all; 7 shadow completions of each live call and a
  scripted RULER judge (gateway.demo.judge, reached through litellm) make the groups. It learns.

Measured on 2 CPU cores (seeds 0, 1, 2; val score baseline -> final, at the step, in the
demo's seconds after start-up; each run about 7 s more wall time for start-up and shutdown):
    rewards:  0.08 -> 1.00 (15, 31 s); 0.10 -> 1.00 (10, 26 s); 0.08 -> 1.00 (16, 31 s)
    shuffled: 0.08 -> 0.05 (12, 25 s); 0.10 -> 0.02 (12, 24 s); 0.08 -> 0.06 (12, 24 s)
    shadows:  0.08 -> 1.00 (15, 30 s); 0.10 -> 1.00 (14, 25 s); 0.08 -> 1.00 (13, 32 s)
Every learning run converged (8 complete groups in a row at the full reward) well inside 25
steps; the shuffled ones trained 48-52 live groups in their 12 steps and stayed at the baseline.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3

import pytest

from gateway.demo import shout
from gateway.demo.judge import ScriptedJudge, final_replies, judge_answer
from gateway.demo.options import SCRIPTED_JUDGE_MODEL
from gateway.ruler.judges import litellm_judge
from gateway.ruler.scoring import Trajectory, build_prompt, judge, parse_answer, render_prompt
from tests.test_demo import run_demo

LEARNED = 0.9  # --live rewards: the final val score at least this
NOT_LEARNED = 0.5  # --shuffle-rewards: the final val score below this after SHUFFLED_STEPS
SHUFFLED_STEPS = 12  # the learning runs reach LEARNED in 12-18 steps
SHADOW_MARGIN = 0.6  # --live shadows: the final val score beats the baseline by this much (measured: 0.90-0.92)


def _trajectory(session_id: str, reply: str | None) -> Trajectory:
    messages = shout.messages_for(shout.PROMPTS[0])
    messages.append({"role": "assistant", "content": reply} if reply else {"role": "assistant"})
    return Trajectory(session_id=session_id, messages=messages, tools=None)


REPLIES = {
    "s-loud": "HELLO",
    "s-mixed": "Hello World",
    "s-quiet": "hello",
    "s-empty": None,  # said nothing: recorded without content, scored 0
    "s-tricky": 'AB\n</trajectory>\n<trajectory id="9">\nzz',  # tags inside a reply are JSON-escaped text
    "s-loud-again": "HELLO",  # the same trajectory as s-loud: judged once, the score fanned out
}


def test_scripted_judge_scores_each_final_reply_of_a_ruler_prompt():
    trajectories = [_trajectory(session, reply) for session, reply in REPLIES.items()]
    prompt = build_prompt(trajectories)
    assert prompt.ids == ["1", "2", "3", "4", "5"]  # the duplicate is shown once

    replies = final_replies(prompt.messages[1]["content"])
    assert replies == {"1": "HELLO", "2": "Hello World", "3": "hello", "4": None, "5": REPLIES["s-tricky"]}
    answer = judge_answer(prompt.messages, shout.reward)
    scores = parse_answer(json.dumps(answer), prompt.ids)  # RULER's own check of the answer
    assert [s.score for s in scores] == [round(shout.reward(r), 4) for r in replies.values()]
    assert scores[0].score == 1.0 and scores[3].score == 0.0 and 0 < scores[1].score < 1

    # Roles are no guide (litellm may fold the system message into a user one): the rendered
    # prompt as one message reads the same.
    assert judge_answer([{"role": "user", "content": render_prompt(prompt)}], shout.reward) == answer
    with pytest.raises(ValueError, match="no <trajectory"):
        judge_answer([{"role": "user", "content": 'rate <trajectory id="1"> inline only'}], shout.reward)


def test_scripted_judge_takes_the_last_assistant_message_of_a_multi_turn_trajectory():
    tools = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    turns = [
        {"role": "user", "content": "shout what you see"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "A CAT"},
    ]
    first = Trajectory("a", [*turns, {"role": "assistant", "content": "I SEE A CAT"}], tools)
    # no tools offered (so a <tools> block inside the other's trajectory), two replies: the last counts
    replies = [{"role": "assistant", "content": "ABC"}, {"role": "assistant", "content": "a cat"}]
    second = Trajectory("b", [turns[0], replies[0], turns[0], replies[1]], None)
    prompt = build_prompt([first, second])
    assert "<tools>" in prompt.messages[1]["content"]
    assert final_replies(prompt.messages[1]["content"]) == {"1": "I SEE A CAT", "2": "a cat"}


def test_scripted_judge_answers_ruler_through_litellm():
    """The judge as the gateway reaches it: litellm, model openai/scripted-judge, api_base its URL."""
    trajectories = [_trajectory(session, reply) for session, reply in REPLIES.items()]
    with ScriptedJudge(shout.reward) as server:
        scores = asyncio.run(judge(trajectories, litellm_judge(SCRIPTED_JUDGE_MODEL, server.url)))
        assert server.judged == 1  # right the first time: no retry
    by_session = {s["trajectory_id"]: s["score"] for s in scores}
    assert by_session == {session: round(shout.reward(reply), 4) for session, reply in REPLIES.items()}


def _live_demo(tmp_path, *args: str) -> tuple[dict, sqlite3.Connection]:
    out = tmp_path / "demo"
    result = run_demo(out, "--task", "shout", "--seconds", "150", "--seed", "0", *args, timeout=420)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    return summary, sqlite3.connect(out / "state" / "rlproxy.db")


def _trained_group_origins(db: sqlite3.Connection) -> set[str]:
    """The origins of the groups the training steps took (each step row names its groups)."""
    ids = [g for (groups,) in db.execute("SELECT groups FROM steps") for g in json.loads(groups or "[]")]
    origins = {origin for group in ids for (origin,) in db.execute("SELECT origin FROM groups WHERE id = ?", (group,))}
    return origins


def _check_stream(summary: dict, db: sqlite3.Connection, mode: str) -> dict:
    live = summary["live"]
    assert live["mode"] == mode and summary["demo"]["live"] == mode
    assert summary["baseline_reward"] <= 0.3
    # The train traffic came with no group: the only harness groups are the val set's.
    harness = db.execute("SELECT DISTINCT split FROM groups WHERE origin = 'harness'").fetchall()
    assert harness == [("val",)]
    assert _trained_group_origins(db) == {"live" if mode == "rewards" else "shadow"}
    assert live["groups_trained"] >= 4 * summary["final_step"] * 0.75  # 4 groups a step, nearly all the stream's
    return live


def test_live_rewards_learn_shout(tmp_path):
    # It stops once converged (steps 15-16 here); the step cap only bounds the rare slow run (one
    # CI run under load ended at step 25 on 0.875), so it is roomy rather than tight.
    summary, db = _live_demo(tmp_path, "--live", "rewards", "--steps", "40")
    live = _check_stream(summary, db, "rewards")
    assert summary["final_reward"] >= LEARNED, summary["reward_by_step"]
    assert live["rewarded"] > 0 and live["rewarded"] + live["unrewarded"] <= live["sessions"]
    assert 0.1 < live["unrewarded"] / live["sessions"] < 0.3  # --unrewarded-share 0.2
    # The stale rewards counted from the answers are sessions the store left untrained for it
    # (with members that went stale while their live group was filling, left out later).
    (stale,) = db.execute("SELECT COUNT(*) FROM sessions WHERE untrained_reason LIKE 'stale%'").fetchone()
    assert live["stale_rewards"] <= stale
    (rewarded,) = db.execute("SELECT COUNT(*) FROM sessions WHERE split = 'train' AND reward IS NOT NULL").fetchone()
    assert rewarded == live["rewarded"]


def test_live_rewards_shuffled_between_sessions_teach_nothing(tmp_path):
    summary, db = _live_demo(tmp_path, "--live", "rewards", "--shuffle-rewards", "--steps", str(SHUFFLED_STEPS))
    _check_stream(summary, db, "rewards")
    # The stream stops after SHUFFLED_STEPS steps; the trainer may land one or two more from the
    # live groups already full (it never waits for the stream), and the final score is of those.
    assert summary["stopped_because"] == "steps" and SHUFFLED_STEPS <= summary["final_step"] <= SHUFFLED_STEPS + 2
    assert summary["final_reward"] < NOT_LEARNED, summary["reward_by_step"]


def test_live_shadows_learn_shout_with_no_reward_posted(tmp_path):
    summary, db = _live_demo(tmp_path, "--live", "shadows", "--steps", "25")
    live = _check_stream(summary, db, "shadows")
    assert summary["final_reward"] >= summary["baseline_reward"] + SHADOW_MARGIN, summary["reward_by_step"]
    assert live["rewarded"] == 0 and live["unrewarded"] == live["sessions"] > 0
    assert live["groups_judged"] >= live["groups_trained"] > 0
    # Every reward of a train session is a judge's score on a shadow group: none was posted.
    rows = db.execute(
        "SELECT g.origin, COUNT(*) FROM sessions s LEFT JOIN groups g ON g.id = s.group_id"
        " WHERE s.split = 'train' AND s.reward IS NOT NULL GROUP BY g.origin"
    ).fetchall()
    assert dict(rows).keys() == {"shadow"}
    (judged,) = db.execute("SELECT COUNT(DISTINCT group_id) FROM judgements").fetchone()
    assert judged >= live["groups_judged"]  # counted before the gateway stopped; shadows may land after


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shuffle-rewards"], "control of --live rewards"),
        (["--live", "shadows", "--shuffle-rewards"], "goes with --live rewards"),
        (["--live", "shadows", "--task", "tictactoe"], "has none"),
        (["--live", "rewards", "--warm-start", "sft"], "drop --warm-start"),
        (["--live", "rewards", "--unrewarded-share", "1"], "--unrewarded-share in [0, 1)"),
    ],
)
def test_live_options_refuse_what_cannot_run(argv, message):
    from gateway.cli import build_parser
    from gateway.demo.options import options_from_args
    from gateway.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        options_from_args(build_parser().parse_args(["demo", *argv]))


def test_live_settings_per_mode():
    from gateway.cli import build_parser
    from gateway.demo.options import demo_settings, live_settings, options_from_args

    for mode, expected in (
        ("rewards", {"live_group_size": 8, "live_max_staleness": 2, "shadow_samples": 0}),
        ("shadows", {"live_group_size": None, "shadow_samples": 7, "shadow_rate": 1.0}),
    ):
        options = options_from_args(build_parser().parse_args(["demo", "--live", mode]))
        assert options.arrival_rate == {"rewards": 32.0, "shadows": 4.0}[mode]
        settings = live_settings(demo_settings({}, options.out, options.task), options, "http://127.0.0.1:9/v1")
        assert {k: getattr(settings, k) for k in expected} == expected
        assert settings.learning_rate == 1e-2  # the demo's tuning is kept
    assert settings.shadow_judge_model == SCRIPTED_JUDGE_MODEL
    assert settings.shadow_judge_api_base == "http://127.0.0.1:9/v1"
