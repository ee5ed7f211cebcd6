"""The airline example (examples/airline/): its fare rules and grader by hand, then the agent end to end
through a real gateway (`openai` engine) whose upstream plays scripted policies, a correct one and a
wrong one per task: the tool loop, the recorded trajectory, the reward from the database state, RULER."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from examples.airline.agent import AIRLINE
from examples.airline.env import AirlineEnv
from examples.airline.tasks import TASKS
from examples.toolagent import main
from tests.helpers import free_port
from tests.helpers_judge import FakeJudge, judge_url
from tests.helpers_policy import ScriptedPolicy, call, check_trajectory, say
from tests.helpers_upstream import openai_gateway

ROOT = Path(__file__).resolve().parents[1]


def by_id(task_id: str):
    return next(t for split in TASKS.values() for t in split if t.id == task_id)


def as_user(user_id: str) -> AirlineEnv:
    env = AirlineEnv()
    assert not env.call("get_user_details", {"user_id": user_id}).startswith("Error")
    return env


def confirmed(env: AirlineEnv, name: str, **arguments) -> str:
    env.on_user("yes")
    return env.call(name, arguments)


# ---------------------------------------------------------------- the rules and the grader, by hand


def test_every_task_replays_to_its_goal_and_the_ids_are_unique():
    ids = [t.id for split in TASKS.values() for t in split]
    assert len(ids) == len(set(ids)) and len(TASKS["train"]) >= 8 and len(TASKS["val"]) >= 4
    for task in TASKS["train"] + TASKS["val"]:
        assert AIRLINE.grade(task, AirlineEnv().replay(list(task.actions))).reward == 1.0


def test_a_change_charges_the_fare_difference_and_keeps_unchanged_flights_at_their_price():
    # R5NH6C: business, HAT001 05-22 + HAT003 05-25 at 610; say the first was bought on sale at 500 (580 today).
    db = AirlineEnv().db
    db["reservations"]["R5NH6C"]["flights"][0]["price"] = 500
    env = AirlineEnv(db)
    env.call("get_user_details", {"user_id": "ava_patel_5566"})
    result = json.loads(
        confirmed(
            env,
            "update_reservation_flights",
            reservation_id="R5NH6C",
            cabin="business",
            flights=[
                {"flight_number": "HAT001", "date": "2024-05-22"},
                {"flight_number": "HAT003", "date": "2024-05-27"},
            ],
            payment_method_id="credit_card_6612",
        )
    )
    assert [s["price"] for s in result["flights"]] == [500, 600]  # kept at what was paid; the new one at today's
    assert result["payment_history"][-1] == {"payment_id": "credit_card_6612", "amount": -10.0}  # 1110 -> 1100
    # A cabin change prices every flight anew: ZFA04Y economy at 200 -> business on the same flight at 600.
    env = as_user("emma_kim_9957")
    result = json.loads(
        confirmed(
            env,
            "update_reservation_flights",
            reservation_id="ZFA04Y",
            cabin="business",
            flights=[{"flight_number": "HAT001", "date": "2024-05-20"}],
            payment_method_id="credit_card_7815",
        )
    )
    assert result["flights"][0]["price"] == 600 and result["payment_history"][-1]["amount"] == 400.0
    # Two passengers pay the difference twice; a refund to a gift card raises its balance.
    db = AirlineEnv().db
    db["reservations"]["ZFA04Y"]["passengers"].append({"first_name": "Jun", "last_name": "Kim", "dob": "1988-09-30"})
    env = AirlineEnv(db)
    env.call("get_user_details", {"user_id": "emma_kim_9957"})
    result = json.loads(
        confirmed(
            env,
            "update_reservation_flights",
            reservation_id="ZFA04Y",
            cabin="economy",
            flights=[{"flight_number": "HAT001", "date": "2024-05-22"}],
            payment_method_id="gift_card_4421",
        )
    )
    assert result["payment_history"][-1] == {"payment_id": "gift_card_4421", "amount": -20.0}
    assert env.db["users"]["emma_kim_9957"]["payment_methods"]["gift_card_4421"]["balance"] == 320.0
    assert env.violations == []


def test_the_fare_rules_are_enforced_and_counted():
    env = as_user("emma_kim_9957")
    assert "basic economy" in confirmed(
        env,
        "update_reservation_flights",
        reservation_id="K2PL9Q",
        cabin="economy",
        payment_method_id="credit_card_7815",
        flights=[{"flight_number": "HAT004", "date": "2024-05-20"}, {"flight_number": "HAT005", "date": "2024-05-23"}],
    )
    assert "cannot change" in confirmed(
        env,
        "update_reservation_flights",
        reservation_id="ZFA04Y",
        cabin="economy",
        payment_method_id="credit_card_7815",
        flights=[{"flight_number": "HAT003", "date": "2024-05-25"}],
    )
    assert "holds 300.00" in confirmed(
        env,
        "update_reservation_flights",
        reservation_id="ZFA04Y",
        cabin="business",
        payment_method_id="gift_card_4421",
        flights=[{"flight_number": "HAT001", "date": "2024-05-20"}],
    )
    assert "cancelled only within 24 hours" in confirmed(env, "cancel_reservation", reservation_id="ZFA04Y")
    assert "another user" in env.call("get_reservation_details", {"reservation_id": "MX7T3B"})
    assert len(env.violations) == 5 and env.db == AirlineEnv().db
    liam = as_user("liam_chen_7788")
    confirmed(
        liam,
        "update_reservation_baggages",
        reservation_id="T3VB8E",
        total_baggages=0,
        nonfree_baggages=0,
        payment_method_id="credit_card_3344",
    )
    assert liam.violations == ["update_reservation_baggages: checked bags can be added, not removed"]
    # The flight of this one has departed (HAT006 on 05-10 landed): no change, no cancellation.
    db = AirlineEnv().db
    db["reservations"]["T3VB8E"]["flights"][0]["date"] = "2024-05-10"
    db["reservations"]["T3VB8E"]["insurance"] = "yes"
    landed = AirlineEnv(db)
    landed.call("get_user_details", {"user_id": "liam_chen_7788"})
    assert "already departed" in confirmed(landed, "cancel_reservation", reservation_id="T3VB8E")


def test_arguments_of_the_wrong_type_are_reported_not_raised():
    env = as_user("liam_chen_7788")
    env.on_user("yes")
    answer = env.call(
        "update_reservation_baggages",
        {
            "reservation_id": "U9KC2L",
            "total_baggages": "2",
            "nonfree_baggages": True,
            "payment_method_id": "credit_card_3344",
        },
    )
    assert answer == (
        "Error: wrong arguments for update_reservation_baggages: arguments.total_baggages must be "
        "an integer; arguments.nonfree_baggages must be an integer"
    )
    answer = env.call(
        "book_reservation",
        {
            **by_id("book-with-insurance").actions[0].arguments,
            "user_id": "liam_chen_7788",
            "flights": [{"flight_number": "HAT001"}],
            "passengers": "Liam Chen",
        },
    )
    assert "arguments.flights[0].date is missing; arguments.passengers must be an array" in answer
    assert env.violations == [] and env.db == AirlineEnv().db
    assert env.confirmed  # nothing was attempted: the "yes" still stands


@pytest.mark.parametrize(
    "user_id, reservation_id, why",
    [
        ("noah_garcia_1234", "MX7T3B", "the airline cancelled HAT002 on 05-21"),
        ("ava_patel_5566", "Q8WZ1D", "booked 6 hours ago"),
        ("ava_patel_5566", "R5NH6C", "travel insurance"),
    ],
)
def test_each_allowed_cancellation_refunds_everything(user_id, reservation_id, why):
    env = as_user(user_id)
    paid = AirlineEnv().db["reservations"][reservation_id]["payment_history"]
    result = json.loads(confirmed(env, "cancel_reservation", reservation_id=reservation_id))
    assert result["status"] == "cancelled", why
    assert result["payment_history"] == paid + [{**p, "amount": -p["amount"]} for p in paid]
    assert env.violations == []


def test_a_cancel_after_a_cheaper_change_refunds_what_is_left_and_charges_no_spent_gift_card():
    env = as_user("liam_chen_7788")  # a gift card holding 100
    card = env.db["users"]["liam_chen_7788"]["payment_methods"]["gift_card_5150"]
    liam = [{"first_name": "Liam", "last_name": "Chen", "dob": "1995-07-21"}]

    def book(origin, destination, flight, date, cabin, payment_method_id):
        return json.loads(
            confirmed(
                env,
                "book_reservation",
                user_id="liam_chen_7788",
                origin=origin,
                destination=destination,
                flight_type="one_way",
                cabin=cabin,
                flights=[{"flight_number": flight, "date": date}],
                passengers=liam,
                payment_method_id=payment_method_id,
                total_baggages=0,
                nonfree_baggages=0,
                insurance="no",
            )
        )

    booked = book("BOS", "ORD", "HAT006", "2024-05-16", "business", "credit_card_3344")  # 450, today
    confirmed(
        env,
        "update_reservation_flights",
        reservation_id=booked["reservation_id"],
        cabin="economy",
        flights=[{"flight_number": "HAT006", "date": "2024-05-17"}],
        payment_method_id="gift_card_5150",
    )  # 160: the 290 difference refunded to the gift card
    assert card["balance"] == 390.0
    book("JFK", "LAX", "HAT001", "2024-05-21", "economy", "gift_card_5150")  # 210 ...
    book("ORD", "BOS", "HAT007", "2024-05-19", "economy", "gift_card_5150")  # ... and 170 spend it
    assert card["balance"] == 10.0

    # Booked today: the policy allows the cancellation, and the 160 the reservation holds goes back.
    answer = confirmed(env, "cancel_reservation", reservation_id=booked["reservation_id"])
    assert not answer.startswith("Error"), answer
    result = json.loads(answer)
    assert result["status"] == "cancelled" and env.violations == []
    assert result["payment_history"] == [
        {"payment_id": "credit_card_3344", "amount": 450.0},
        {"payment_id": "gift_card_5150", "amount": -290.0},
        {"payment_id": "credit_card_3344", "amount": -160.0},
    ]
    assert card["balance"] == 10.0


def test_booking_prices_by_hand():
    env = as_user("noah_garcia_1234")  # silver, economy: 2 free bags; HAT001 05-22 economy 190, insurance 30
    result = json.loads(confirmed(env, "book_reservation", **by_id("book-with-insurance").actions[0].arguments))
    assert result["reservation_id"] == "NEW001" and result["payment_history"] == [
        {"payment_id": "credit_card_2231", "amount": 220.0}
    ]
    assert env.db["users"]["noah_garcia_1234"]["reservations"][-1] == "NEW001"
    # Three bags for a regular member in economy: 1 free, 2 at 50; a 100 gift card cannot pay it.
    liam = as_user("liam_chen_7788")
    booking = dict(
        user_id="liam_chen_7788",
        origin="ORD",
        destination="BOS",
        flight_type="one_way",
        cabin="economy",
        flights=[{"flight_number": "HAT007", "date": "2024-05-19"}],
        passengers=[{"first_name": "Liam", "last_name": "Chen", "dob": "1995-07-21"}],
        total_baggages=3,
        nonfree_baggages=2,
        insurance="no",
    )
    assert "holds 100.00, not the 270.00" in confirmed(
        liam, "book_reservation", payment_method_id="gift_card_5150", **booking
    )  # 170 + 2 * 50
    assert json.loads(confirmed(liam, "book_reservation", payment_method_id="credit_card_3344", **booking))[
        "payment_history"
    ] == [{"payment_id": "credit_card_3344", "amount": 270.0}]
    assert liam.violations == ["book_reservation: gift card gift_card_5150 holds 100.00, not the 270.00 to be paid"]


def test_grades_correct_extra_write_and_rule_broken():
    task = by_id("change-date")
    right = as_user("emma_kim_9957")
    confirmed(right, "update_reservation_flights", **task.actions[0].arguments)
    assert AIRLINE.grade(task, right).reward == 1.0
    extra = as_user("emma_kim_9957")
    confirmed(extra, "update_reservation_flights", **task.actions[0].arguments)
    confirmed(
        extra,
        "update_reservation_baggages",
        reservation_id="ZFA04Y",
        total_baggages=2,
        nonfree_baggages=0,
        payment_method_id="credit_card_7815",
    )
    graded = AIRLINE.grade(task, extra)
    assert (graded.reward, graded.db_match, graded.violations) == (0.0, False, ())
    unconfirmed = as_user("emma_kim_9957")
    unconfirmed.call("update_reservation_flights", task.actions[0].arguments)
    graded = AIRLINE.grade(task, unconfirmed)
    assert (graded.reward, graded.db_match, len(graded.violations)) == (0.0, True, 1)
    # Refusing is right for a refused request; trying is a rule broken even though nothing changed.
    refused = by_id("change-basic-economy-refused")
    assert AIRLINE.grade(refused, as_user("emma_kim_9957")).reward == 1.0


# ---------------------------------------------------------------- end to end through the gateway

CANCEL_OK = [
    call("get_user_details", user_id="noah_garcia_1234"),
    call("get_reservation_details", reservation_id="MX7T3B"),
    say(
        "Flight HAT002 on 2024-05-21 was cancelled by the airline, so reservation MX7T3B can be cancelled and "
        "the 240.00 you paid refunded to credit_card_2231. Do you confirm (yes/no)?"
    ),
    call("cancel_reservation", reservation_id="MX7T3B"),
    say("Reservation MX7T3B is cancelled; 240.00 is on its way back to your card."),
]
CANCEL_BEFORE_LOOKUP = [  # the right end state, but it read the reservation before looking up the user
    call("get_reservation_details", reservation_id="MX7T3B"),
    call("get_user_details", user_id="noah_garcia_1234"),
    call("get_reservation_details", reservation_id="MX7T3B"),
    say("I can cancel MX7T3B and refund 240.00 to your card. Do you confirm (yes/no)?"),
    call("cancel_reservation", reservation_id="MX7T3B"),
    say("Reservation MX7T3B is cancelled."),
]


def _change(flight_number: str, price_note: str) -> list:
    return [
        call("get_user_details", user_id="emma_kim_9957"),
        call("get_reservation_details", reservation_id="ZFA04Y"),
        call("search_direct_flight", origin="JFK", destination="LAX", date="2024-05-22"),
        say(f"{flight_number} on 2024-05-22 in economy {price_note}. Do you confirm (yes/no)?"),
        call(
            "update_reservation_flights",
            reservation_id="ZFA04Y",
            cabin="economy",
            flights=[{"flight_number": flight_number, "date": "2024-05-22"}],
            payment_method_id="credit_card_7815",
        ),
        say("Your reservation ZFA04Y now flies on 2024-05-22."),
    ]


SCRIPTS = {
    "MX7T3B": [CANCEL_OK, CANCEL_BEFORE_LOOKUP],
    "ZFA04Y from the May 20": [
        _change("HAT001", "costs 190.00, so 10.00 is refunded to your card"),
        _change("HAT002", "costs 230.00, so 30.00 is charged"),
    ],
}  # not the same flight
EXPECTED = {
    ("MX7T3B", 0): (1.0, 1.0, 0.0),
    ("MX7T3B", 1): (0.0, 1.0, 1.0),
    ("ZFA04Y from the May 20", 0): (1.0, 1.0, 0.0),
    ("ZFA04Y from the May 20", 1): (0.0, 0.0, 0.0),
}


@pytest.fixture(scope="module")
def judge_port() -> int:
    return free_port()  # the FakeJudge's: the gateway starts first and allows that judge


@pytest.fixture(scope="module")
def served(tmp_path_factory, judge_port):
    judges = {"judge_model": ["openai/judge"], "judge_api_base": [judge_url(judge_port)]}
    with (
        ScriptedPolicy(SCRIPTS) as policy,
        openai_gateway(policy.url, tmp_path_factory.mktemp("airline-state"), **judges) as (server, _),
    ):
        yield server.url, policy


def _run(url: str, *extra: str) -> list[dict]:
    return main(
        AIRLINE,
        [
            "--base-url",
            url + "/v1",
            "--model",
            "agent",
            "--rollouts",
            "2",
            "--task",
            "cancel-airline-cancelled",
            "--task",
            "change-date",
            *extra,
        ],
    )


def test_the_agent_runs_the_tool_loop_and_posts_the_database_reward(served):
    url, policy = served
    records = _run(url)
    assert len(records) == 4 and {r["task"] for r in records} == {"cancel-airline-cancelled", "change-date"}
    seen = set()
    for record in records:
        key, index = policy.script_of(record["messages"])
        seen.add((key, index))
        reward, db_match, violations = EXPECTED[(key, index)]
        session = check_trajectory(url, record, SCRIPTS[key][index], AirlineEnv().tool_names)
        assert record["reward"] == session["reward"] == reward
        assert session["metrics"]["db_match"] == db_match and session["metrics"]["violations"] == violations
    assert seen == set(EXPECTED)
    # The rule-breaking rollout was told why, in the tool result it read.
    wrong = next(r for r in records if policy.script_of(r["messages"]) == ("MX7T3B", 1))
    assert wrong["messages"][3]["content"].startswith("Error: the user is not authenticated")
    for group_id in {r["group_id"] for r in records}:
        group = httpx.get(f"{url}/v1/groups/{group_id}").json()
        assert group["closed"] and group["ready"] and sorted(s["reward"] for s in group["sessions"]) == [0.0, 1.0]


def test_ruler_scores_each_group_through_the_gateway(served, judge_port, monkeypatch):
    url, policy = served
    monkeypatch.setenv("RLPROXY_JUDGE_API_KEY", "sk-judge-test")
    with FakeJudge(port=judge_port) as judge:
        records = _run(url, "--ruler", "--judge-model", "openai/judge", "--judge-api-base", judge.url)
    assert len(judge.requests) == 2
    assert any("update_reservation_flights" in json.dumps(body) for body in judge.bodies)
    for group_id in {r["group_id"] for r in records}:
        group = httpx.get(f"{url}/v1/groups/{group_id}").json()
        assert group["ruler_status"] == "scored" and group["closed"] and group["ready"]
        sessions = {s["id"]: s for s in group["sessions"]}
        mine = [r for r in records if r["group_id"] == group_id]
        assert sorted(r["ruler_score"] for r in mine) == [0.5, 1.0]
        for record in mine:
            assert sessions[record["session_id"]]["reward"] == record["ruler_score"]
            assert (
                sessions[record["session_id"]]["metrics"]["independent_reward"]
                == record["reward"]
                == EXPECTED[policy.script_of(record["messages"])][0]
            )


def test_the_script_runs_as_its_readme_says(served, tmp_path):
    url, _ = served
    out = tmp_path / "rollouts.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/airline/agent.py"),
            "--base-url",
            url + "/v1",
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
    assert "cancel-airline-cancelled (grp_" in done.stdout
    assert sorted(json.loads(line)["reward"] for line in out.read_text().splitlines()) == [0.0, 1.0]
