"""The retail example (examples/retail/): its grader by hand, then the agent end to end through a real
gateway (`openai` engine) whose upstream plays scripted policies, a correct one and a wrong one per
task: the tool loop, the recorded trajectory, the reward from the database state, RULER on the group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from examples.retail.agent import RETAIL
from examples.retail.env import RetailEnv
from examples.retail.tasks import TASKS
from examples.toolagent import SimulatedUser, grade, main
from tests.helpers import free_port
from tests.helpers_judge import FakeJudge, judge_url
from tests.helpers_policy import ScriptedPolicy, call, check_trajectory, fail, say
from tests.helpers_upstream import openai_gateway

ROOT = Path(__file__).resolve().parents[1]
CANCEL, RETURN = TASKS["train"][0], TASKS["train"][1]
assert (CANCEL.id, RETURN.id) == ("cancel-by-mistake", "return-to-gift-card")


def by_id(task_id: str):
    return next(t for split in TASKS.values() for t in split if t.id == task_id)


# ---------------------------------------------------------------- the grader, by hand


def test_every_task_replays_to_its_goal_and_the_ids_are_unique():
    ids = [t.id for split in TASKS.values() for t in split]
    assert len(ids) == len(set(ids)) and len(TASKS["train"]) >= 8 and len(TASKS["val"]) >= 4
    for task in TASKS["train"] + TASKS["val"]:
        assert RETAIL.grade(task, RetailEnv().replay(list(task.actions))).reward == 1.0


def test_the_right_writes_confirmed_after_authenticating_score_1():
    env = RetailEnv()
    env.call("find_user_id_by_email", {"email": "mia.li3668@example.com"})
    env.on_user("Yes, please go ahead.")
    result = env.call("cancel_pending_order", {"order_id": "#W1001", "reason": "ordered by mistake"})
    assert json.loads(result)["status"] == "cancelled"
    # What the goal must look like, written out: cancelled, the reason, the card refunded.
    order = env.db["orders"]["#W1001"]
    assert order["cancel_reason"] == "ordered by mistake"
    assert order["payment_history"][-1] == {
        "transaction_type": "refund",
        "amount": 37.0,
        "payment_method_id": "credit_card_9951",
    }
    graded = RETAIL.grade(CANCEL, env)
    assert (graded.reward, graded.db_match, graded.violations, graded.partial) == (1.0, True, (), 1.0)


def test_an_extra_write_scores_0_even_when_confirmed():
    env = RetailEnv()
    env.call("find_user_id_by_email", {"email": "mia.li3668@example.com"})
    env.on_user("yes")
    env.call("cancel_pending_order", {"order_id": "#W1001", "reason": "ordered by mistake"})
    env.on_user("yes")
    env.call(
        "return_delivered_order_items",
        {"order_id": "#W1002", "item_ids": ["4001"], "payment_method_id": "credit_card_9951"},
    )
    graded = RETAIL.grade(CANCEL, env)
    assert graded.reward == 0.0 and not graded.db_match and graded.violations == ()
    assert graded.partial == 0.5  # two orders touched: #W1001 right, #W1002 changed when it should not be


def test_a_rule_broken_scores_0_even_when_the_state_is_right():
    env = RetailEnv()
    env.call("find_user_id_by_email", {"email": "mia.li3668@example.com"})
    env.call("cancel_pending_order", {"order_id": "#W1001", "reason": "ordered by mistake"})  # nobody said yes
    graded = RETAIL.grade(CANCEL, env)
    assert graded.db_match and graded.reward == 0.0
    assert graded.violations == ("cancel_pending_order: attempted without the user's explicit confirmation",)


def test_the_tools_refuse_what_the_policy_forbids_and_count_it():
    env = RetailEnv()
    assert env.call("get_order_details", {"order_id": "#W1001"}).startswith("Error: the user is not authenticated")
    env.call("find_user_id_by_name_zip", {"first_name": "mia", "last_name": "LI", "zip": "94110"})
    assert env.user_id == "mia_li_3668"
    assert "another user" in env.call("get_order_details", {"order_id": "#W2001"})
    env.on_user("yes")
    assert "only a pending order" in env.call(
        "cancel_pending_order", {"order_id": "#W1003", "reason": "no longer needed"}
    )
    env.on_user("yes")
    assert "same product" in env.call(
        "exchange_delivered_order_items",
        {"order_id": "#W1002", "item_ids": ["4001"], "new_item_ids": ["3002"], "payment_method_id": "gift_card_1122"},
    )
    assert len(env.violations) == 4 and env.db == RetailEnv().db
    # A refused request leaves the database alone, but the attempt is a rule broken.
    graded = RETAIL.grade(by_id("cancel-shipped-refused"), env)
    assert graded.db_match and graded.reward == 0.0


def test_a_cancel_after_a_payment_change_refunds_only_what_each_method_paid():
    env = RetailEnv()
    env.call("find_user_id_by_email", {"email": "yusuf.ali@example.com"})
    card = env.db["users"]["yusuf_ali_1010"]["payment_methods"]["gift_card_7070"]
    env.on_user("yes")  # #W4001 (150.00, PayPal) onto the gift card (200.00), then back to PayPal
    env.call("modify_pending_order_payment", {"order_id": "#W4001", "payment_method_id": "gift_card_7070"})
    assert card["balance"] == 50.0
    env.on_user("yes")
    env.call("modify_pending_order_payment", {"order_id": "#W4001", "payment_method_id": "paypal_2020"})
    assert card["balance"] == 200.0
    env.on_user("yes")
    env.call("cancel_pending_order", {"order_id": "#W4001", "reason": "no longer needed"})
    assert env.violations == [] and card["balance"] == 200.0  # the card holds nothing of the order: no refund
    history = env.db["orders"]["#W4001"]["payment_history"]
    net: dict[str, float] = {}
    for entry in history:
        sign = 1 if entry["transaction_type"] == "payment" else -1
        net[entry["payment_method_id"]] = net.get(entry["payment_method_id"], 0.0) + sign * entry["amount"]
    assert net == {"paypal_2020": 0.0, "gift_card_7070": 0.0}  # every payment refunded exactly once
    assert history[-1] == {"transaction_type": "refund", "amount": 150.0, "payment_method_id": "paypal_2020"}


def test_mistakes_in_a_call_are_reported_and_keep_the_confirmation():
    env = RetailEnv()
    env.call("find_user_id_by_email", {"email": "omar.khan@example.com"})
    env.on_user("Yes")
    assert env.call("no_such_tool", {}).startswith("Error: there is no tool")
    assert "not a JSON object" in env.call("get_order_details", "{order_id: #W2001")
    assert "wrong arguments" in env.call("get_order_details", {"id": "#W2001"})
    assert "not (each once) in order" in env.call(
        "return_delivered_order_items", {"order_id": "#W2001", "item_ids": ["9999"], "payment_method_id": "paypal_7788"}
    )
    env.call(
        "return_delivered_order_items", {"order_id": "#W2001", "item_ids": ["1003"], "payment_method_id": "paypal_7788"}
    )
    assert env.violations == [] and env.db["orders"]["#W2001"]["status"] == "return requested"


def test_the_grade_rule_on_hand_written_states():
    initial = {"orders": {"a": {"s": "pending"}, "b": {"s": "pending"}}, "flag": False}
    goal = {"orders": {"a": {"s": "cancelled"}, "b": {"s": "cancelled"}}, "flag": False}
    half = {"orders": {"a": {"s": "cancelled"}, "b": {"s": "pending"}}, "flag": False}
    assert grade(initial, goal, goal, []).reward == 1.0
    assert grade(initial, goal, goal, ["a rule"]).reward == 0.0
    assert (grade(initial, half, goal, []).reward, grade(initial, half, goal, []).partial) == (0.0, 0.5)
    flagged = {**goal, "flag": True}
    assert grade(initial, flagged, goal, []).partial == 2 / 3
    assert grade(initial, initial, initial, []).partial == 1.0


def test_the_simulated_customer_confirms_follows_up_and_stops():
    user = SimulatedUser(by_id("compensation-to-human"))
    assert user.first().startswith("Hi, I'm Sofia Rossi")
    assert user.reply("Shall I proceed? (yes/no)") == SimulatedUser.YES
    assert user.reply("I cannot offer compensation.") == "Then please transfer me to a human agent."
    assert user.reply("Anything else?") is None


# ---------------------------------------------------------------- end to end through the gateway

CANCEL_OK = [
    call("find_user_id_by_email", email="mia.li3668@example.com"),
    call("get_order_details", order_id="#W1001"),
    say(
        "Order #W1001 is pending: a red T-shirt and a white mug, 37.00 paid by credit card. I can cancel it "
        "with the reason 'ordered by mistake' and refund the card. Do you confirm (yes/no)?"
    ),
    call("cancel_pending_order", order_id="#W1001", reason="ordered by mistake"),
    say("Order #W1001 is cancelled and 37.00 is refunded to your credit card."),
]
CANCEL_UNCONFIRMED = [  # the right end state, but the write came without the customer's "yes"
    call("find_user_id_by_email", email="mia.li3668@example.com"),
    call("cancel_pending_order", order_id="#W1001", reason="ordered by mistake"),
    say("Order #W1001 is cancelled."),
]


def _return(payment_method_id: str) -> list:
    return [
        call("find_user_id_by_name_zip", first_name="Mia", last_name="Li", zip="94110"),
        call("get_order_details", order_id="#W1002"),
        call("get_user_details", user_id="mia_li_3668"),
        say(
            f"I can return the desk lamp (item 4001) of order #W1002 and refund 40.00 to {payment_method_id}. "
            "Do you confirm (yes/no)?"
        ),
        call("return_delivered_order_items", order_id="#W1002", item_ids=["4001"], payment_method_id=payment_method_id),
        say("The return is requested; the refund follows once the lamp is back."),
    ]


NEW_ADDRESS = {
    "order_id": "#W2002",
    "address1": "77 Atlantic Ave",
    "address2": "Apt 4",
    "city": "Brooklyn",
    "state": "NY",
    "country": "USA",
    "zip": "11201",
}
ADDRESS_OK = [
    call("find_user_id_by_name_zip", first_name="Omar", last_name="Khan", zip="10001"),
    call("get_order_details", order_id="#W2002"),
    say("Order #W2002 is pending; I can ship it to 77 Atlantic Ave, Apt 4, Brooklyn, NY 11201, USA. Confirm?"),
    call("modify_pending_order_address", **NEW_ADDRESS),
    say("Done: #W2002 now ships to Brooklyn."),
]
CONTEXT_OVERFLOW = [
    call("find_user_id_by_name_zip", first_name="Omar", last_name="Khan", zip="10001"),
    fail(400, "this model's context is 2048 tokens; the messages take 2868"),
]

SCRIPTS = {
    "order #W1001": [CANCEL_OK, CANCEL_UNCONFIRMED],
    "desk lamp": [_return("gift_card_1122"), _return("credit_card_9951")],  # the card: a wrong state
    "#W2002 to 77": [ADDRESS_OK, CONTEXT_OVERFLOW],
}
# (database reward, db_match, violations) of each script, by what the grader must find
EXPECTED = {
    ("order #W1001", 0): (1.0, 1.0, 0.0),
    ("order #W1001", 1): (0.0, 1.0, 1.0),
    ("desk lamp", 0): (1.0, 1.0, 0.0),
    ("desk lamp", 1): (0.0, 0.0, 0.0),
}


@pytest.fixture(scope="module")
def judge_port() -> int:
    return free_port()  # the FakeJudge's: the gateway starts first and allows that judge


@pytest.fixture(scope="module")
def served(tmp_path_factory, judge_port):
    judges = {"judge_model": ["openai/judge"], "judge_api_base": [judge_url(judge_port)]}
    with (
        ScriptedPolicy(SCRIPTS) as policy,
        openai_gateway(policy.url, tmp_path_factory.mktemp("retail-state"), **judges) as (server, _),
    ):
        yield server.url, policy


def _run(url: str, *extra: str) -> list[dict]:
    return main(RETAIL, ["--base-url", url + "/v1", "--model", "agent", "--tasks", "2", "--rollouts", "2", *extra])


def test_the_agent_runs_the_tool_loop_and_posts_the_database_reward(served):
    url, policy = served
    records = _run(url)
    assert len(records) == 4 and {r["task"] for r in records} == {CANCEL.id, RETURN.id}
    seen = set()
    for record in records:
        key, index = policy.script_of(record["messages"])
        seen.add((key, index))
        reward, db_match, violations = EXPECTED[(key, index)]
        session = check_trajectory(url, record, SCRIPTS[key][index], RetailEnv().tool_names)
        assert record["reward"] == session["reward"] == reward
        assert session["metrics"]["db_match"] == db_match and session["metrics"]["violations"] == violations
        assert session["metrics"]["tool_calls"] == sum(1 for step in SCRIPTS[key][index] if step.tool)
        # The results the model read are the store's: after the cancel, the order says cancelled.
        tool_results = [
            json.loads(m["content"]) for m in record["messages"] if m["role"] == "tool" and m["content"].startswith("{")
        ]
        if key == "order #W1001":
            assert tool_results[-1]["status"] == "cancelled"
    assert seen == set(EXPECTED)  # each group held a right and a wrong rollout
    for group_id in {r["group_id"] for r in records}:
        group = httpx.get(f"{url}/v1/groups/{group_id}").json()
        assert group["closed"] and group["ready"] and group["n_sessions"] == 2
        assert sorted(s["reward"] for s in group["sessions"]) == [0.0, 1.0]


def test_ruler_scores_each_group_through_the_gateway(served, judge_port, monkeypatch):
    url, policy = served
    monkeypatch.setenv("RLPROXY_JUDGE_API_KEY", "sk-judge-test")
    with FakeJudge(port=judge_port) as judge:
        records = _run(url, "--ruler", "--judge-model", "openai/judge", "--judge-api-base", judge.url)
    assert len(judge.requests) == 2  # one judgement per group
    for body in judge.bodies:
        prompt = json.dumps(body["messages"])
        assert "find_user_id" in prompt and "authenticate" in prompt.lower()  # the calls, and the policy
        assert RETAIL.rubric[:60] in body["messages"][0]["content"]
    for group_id in {r["group_id"] for r in records}:
        group = httpx.get(f"{url}/v1/groups/{group_id}").json()
        assert group["ruler_status"] == "scored" and group["closed"] and group["ready"]
        by_session = {s["id"]: s for s in group["sessions"]}
        mine = [r for r in records if r["group_id"] == group_id]
        assert sorted(r["ruler_score"] for r in mine) == [0.5, 1.0]  # the loopback judge ranks the two
        for record in mine:
            session = by_session[record["session_id"]]
            assert session["reward"] == record["ruler_score"]  # the judge's score is the reward now
            # and the database reward is kept beside it
            assert session["metrics"]["independent_reward"] == record["reward"]
            assert record["reward"] == EXPECTED[policy.script_of(record["messages"])][0]


def test_the_script_runs_as_its_readme_says(served, tmp_path):
    url, _ = served
    out = tmp_path / "rollouts.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # it finds `examples` and `sdk` itself
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/retail/agent.py"),
            "--base-url",
            url + "/v1",
            "--model",
            "agent",
            "--tasks",
            "1",
            "--rollouts",
            "2",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"{CANCEL.id} (grp_" in done.stdout and "database rewards" in done.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["reward"] for line in lines) == [0.0, 1.0]
    assert "2 rollouts, mean database reward 0.500" in done.stdout


def test_a_rollout_the_model_server_refuses_is_left_out_of_its_group(served, capsys):
    url, policy = served
    records = main(RETAIL, ["--base-url", url + "/v1", "--task", "new-address", "--rollouts", "2"])
    (record,) = records  # the other one failed: no reward, no record
    assert policy.script_of(record["messages"]) == ("#W2002 to 77", 0) and record["reward"] == 1.0
    assert "1 failed (Error code: 400" in capsys.readouterr().out
    group = httpx.get(f"{url}/v1/groups/{record['group_id']}").json()
    assert group["closed"] and group["ready"] and [s["reward"] for s in group["sessions"]] == [1.0]
    (discarded,) = group["discarded_sessions"]
    assert "context is 2048 tokens" in discarded["discard_reason"]
    # Every rollout failing stops the run with the reason.
    with pytest.raises(SystemExit, match="every rollout of task new-address failed.*context is 2048 tokens"):
        main(RETAIL, ["--base-url", url + "/v1", "--task", "new-address", "--rollouts", "1", "--tasks", "2"])
