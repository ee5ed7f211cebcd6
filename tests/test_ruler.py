"""RULER: the prompt (pure, and a golden file), the answer checks, and whole judgements through
the gateway against a loopback OpenAI-compatible judge that checks what it is sent."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.engines.base import Completion, Engine, EngineRequest, StreamEnd
from gateway.ruler.scoring import (
    DEFAULT_RUBRIC,
    RESPONSE_FORMAT,
    InvalidJudgeAnswer,
    Trajectory,
    build_prompt,
    common_prefix_length,
    normalize_message,
    parse_answer,
    render_prompt,
    trajectory_from_calls,
)
from gateway.settings import Settings
from tests.helpers import ThreadServer, free_port
from tests.helpers_judge import FakeJudge, good_answer, judge_url, shown_ids
from tests.helpers_upstream import openai_gateway, raw_store_bytes

GOLDEN = Path(__file__).parent / "golden" / "ruler_prompt.txt"
JUDGE_KEY = "sk-judge-" + "41c2e9b0-never-store-me"  # RLPROXY_JUDGE_API_KEY: for judges at a judge_api_base
PROVIDER_KEY = "sk-provider-" + "9a7d03c1-stays-home"  # OPENAI_API_KEY: must never go to a judge_api_base
SYSTEM = "You are a careful calculator agent. Use the tool when it helps."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "evaluate arithmetic",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


# ---------------------------------------------------------------- pure parts


def _call(messages, reply, status="ok", tools=None):
    request = {"model": "m", "messages": messages}
    if tools:
        request["tools"] = tools
    return {
        "status": status,
        "request": request,
        "response": {"choices": [{"message": reply}]} if status == "ok" else None,
    }


def test_calls_merge_into_one_trajectory_and_failed_calls_are_left_out():
    system, user = {"role": "system", "content": SYSTEM}, {"role": "user", "content": "2+2?"}
    call_reply = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}
        ],
    }
    echoed = {"role": "assistant", "content": "", "tool_calls": call_reply["tool_calls"]}  # the client's echo
    tool = {"role": "tool", "tool_call_id": "c1", "content": "4"}
    calls = [
        _call([system, user], call_reply, tools=TOOLS),
        _call([system, user, echoed, tool], None, status="error"),
        _call([system, user, echoed, tool], {"role": "assistant", "content": "4"}, tools=TOOLS),
    ]
    trajectory = trajectory_from_calls("s1", calls)
    assert [m["role"] for m in trajectory.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert trajectory.messages[2] == normalize_message(call_reply)
    assert "refusal" not in trajectory.messages[2]
    assert trajectory.tools == TOOLS

    # A call that does not continue the history (a second conversation) is appended whole.
    other = _call([{"role": "user", "content": "summarise"}], {"role": "assistant", "content": "done"})
    assert len(trajectory_from_calls("s1", [*calls, other]).messages) == 7


def test_common_prefix_leaves_every_trajectory_its_last_message():
    a, b, c = ({"role": "user", "content": x} for x in "abc")
    assert common_prefix_length([[a, b, c], [a, b, a]]) == 2
    assert common_prefix_length([[a, b], [a, b, c]]) == 1
    assert common_prefix_length([[a, b, c]]) == 2
    assert common_prefix_length([[a], []]) == 0


def _trajectories() -> list[Trajectory]:
    system = {"role": "system", "content": SYSTEM}
    user = {"role": "user", "content": "What is 17 * 23?"}
    call = {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "17 * 23"}'},
            }
        ],
    }
    return [
        Trajectory(
            "s-tool",
            [
                system,
                user,
                call,
                {"role": "tool", "tool_call_id": "c1", "content": "391"},
                {"role": "assistant", "content": "17 * 23 = 391"},
            ],
            TOOLS,
        ),
        Trajectory("s-guess", [system, user, {"role": "assistant", "content": "About 400."}], TOOLS),
        Trajectory(
            "s-tool-again",
            [
                system,
                user,
                call,
                {"role": "tool", "tool_call_id": "c1", "content": "391"},
                {"role": "assistant", "content": "17 * 23 = 391"},
            ],
            TOOLS,
        ),
    ]


def test_prompt_matches_the_golden_file():
    text = render_prompt(build_prompt(_trajectories()))
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "prompt changed; rerun with UPDATE_GOLDEN=1 if that was intended"


def test_prompt_sends_the_shared_prefix_and_tools_once_and_identical_trajectories_once():
    prompt = build_prompt(_trajectories())
    user = prompt.messages[1]["content"]
    assert prompt.members == {"1": ["s-tool", "s-tool-again"], "2": ["s-guess"]}
    assert user.count(SYSTEM) == 1 and user.count("What is 17 * 23?") == 1
    assert user.count("<tools>") == 1 and user.count('"calculator"') >= 1
    assert user.index("<context>") < user.index('<trajectory id="1">') < user.index('<trajectory id="2">')
    assert user.count("17 * 23 = 391") == 1  # the duplicate is not shown
    assert DEFAULT_RUBRIC in prompt.messages[0]["content"]
    assert "2 attempts" in prompt.messages[0]["content"]


def test_different_tools_go_with_their_trajectory():
    one, two, _ = _trajectories()
    other_tools = [{"type": "function", "function": {"name": "search"}}]
    user = build_prompt([one, Trajectory(two.session_id, two.messages, other_tools)]).messages[1]["content"]
    assert user.count("<tools>") == 2
    assert user.index('"search"') > user.index('<trajectory id="2">')


def test_custom_rubric_replaces_the_default():
    system = build_prompt(_trajectories(), rubric="Shorter answers win.").messages[0]["content"]
    assert "Shorter answers win." in system and DEFAULT_RUBRIC not in system


@pytest.mark.parametrize(
    "answer, problem",
    [
        ("", "empty"),
        ("the first one is better", "not valid JSON"),
        ('{"scores": [{"trajectory_id": "1", "explanation": "ok", "score": 0.5}]}', "expected one score for each"),
        (
            '{"scores": [{"trajectory_id": "1", "explanation": "", "score": 1}, '
            '{"trajectory_id": "3", "explanation": "", "score": 0}]}',
            "ids ['1', '3']",
        ),
        (
            '{"scores": [{"trajectory_id": "1", "explanation": "", "score": 1.5}, '
            '{"trajectory_id": "2", "explanation": "", "score": 0}]}',
            "less than or equal to 1",
        ),
        (
            '{"scores": [{"trajectory_id": "1", "explanation": "", "score": 1}, '
            '{"trajectory_id": "1", "explanation": "", "score": 0}]}',
            "expected one score for each",
        ),
    ],
)
def test_bad_answers_are_rejected_with_the_reason(answer, problem):
    with pytest.raises(InvalidJudgeAnswer) as info:
        parse_answer(answer, ["1", "2"])
    assert problem in str(info.value)


def test_a_fenced_answer_in_any_order_is_accepted():
    answer = (
        '```json\n{"scores": [{"trajectory_id": "2", "explanation": "b", "score": 0.1}, '
        '{"trajectory_id": "1", "explanation": "a", "score": 0.9}]}\n```'
    )
    assert [s.score for s in parse_answer(answer, ["1", "2"])] == [0.9, 0.1]


# ---------------------------------------------------------------- through the gateway


@pytest.fixture(scope="module")
def judge_port() -> int:
    """Where each test's FakeJudge listens: the gateway starts first and allows that judge."""
    return free_port()


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory, judge_port):
    state_dir = tmp_path_factory.mktemp("ruler-state")
    judges = {"judge_model": ["openai/j", "openai/judge-model"], "judge_api_base": [judge_url(judge_port)]}
    with openai_gateway(upstream.url, state_dir, **judges) as (server, services):
        yield server, services, state_dir


@pytest.fixture
def judge_env(monkeypatch):
    monkeypatch.setenv("RLPROXY_JUDGE_API_KEY", JUDGE_KEY)
    monkeypatch.setenv("OPENAI_API_KEY", PROVIDER_KEY)


def _run_group(server, group_id: str, attempts: list[str]) -> list[str]:
    """One session per attempt: the task, then the attempt, with tools offered; returns session ids."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    session_ids = []
    for index, attempt in enumerate(attempts):
        session_id = f"{group_id}-s{index}"
        headers = {"X-Session-Id": session_id, "X-Group-Id": group_id}
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 17 * 23?"}]
        first = client.chat.completions.create(
            model="fake-model", messages=messages, tools=TOOLS, extra_headers=headers
        )
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": attempt}]
        client.chat.completions.create(model="fake-model", messages=messages, tools=TOOLS, extra_headers=headers)
        session_ids.append(session_id)
    client.close()
    return session_ids


def _ruler(server, group_id: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/groups/{group_id}/ruler", json=body, timeout=120)


def _group(server, group_id: str) -> dict:
    return httpx.get(f"{server.url}/v1/groups/{group_id}").json()


def test_a_group_is_judged_scores_become_rewards_and_it_closes(gateway, judge_env, judge_port):
    server, services, state_dir = gateway
    sessions = _run_group(server, "g-judged", ["Answer 391", "Answer 400", "Answer 391"])
    httpx.post(f"{server.url}/v1/sessions/{sessions[1]}/reward", json={"reward": 0.3}).raise_for_status()

    with FakeJudge(port=judge_port) as judge:
        response = _ruler(server, "g-judged", judge_model="openai/judge-model", judge_api_base=judge.url)
    assert response.status_code == 200, response.text

    # What the judge was sent: one request, schema response format, ids, prefix once, tools once.
    (request,) = judge.requests
    body = request["body"]
    assert body["model"] == "judge-model"
    assert body["response_format"] == RESPONSE_FORMAT
    # The judge's key comes from the environment; the provider key never goes to a URL a client chose.
    assert request["headers"]["authorization"] == f"Bearer {JUDGE_KEY}"
    assert PROVIDER_KEY not in json.dumps(request)
    system, user = body["messages"][0]["content"], body["messages"][1]["content"]
    assert DEFAULT_RUBRIC in system
    assert shown_ids(body) == ["1", "2"]  # sessions 0 and 2 are identical: judged once
    assert user.count(SYSTEM) == 1 and user.count("<context>") == 1
    # The shared prefix (system, task, the first reply, which echoes the task) once, in the context.
    context = user.split("<context>\n")[1].split("\n</context>")[0]
    assert [json.loads(line)["role"] for line in context.splitlines()] == ["system", "user", "assistant"]
    assert user.count("What is 17 * 23?") == 2
    assert user.count("<tools>") == 1 and '"calculator"' in user
    assert user.count("Answer 391") == 2  # the attempt and its echo, in trajectory 1 only
    assert body["messages"] == build_prompt(services.extras["ruler"].trajectories("g-judged")).messages

    scores = {s["session_id"]: s for s in response.json()["scores"]}
    assert list(scores) == sessions
    assert scores[sessions[0]]["score"] == scores[sessions[2]]["score"] == 1.0
    assert scores[sessions[0]]["explanation"] == scores[sessions[2]]["explanation"]
    assert scores[sessions[1]]["score"] == 0.5

    group = _group(server, "g-judged")
    assert group["closed"] and group["ready"] and group["ruler_status"] == "scored"
    by_id = {s["id"]: s for s in group["sessions"]}
    assert [by_id[s]["reward"] for s in sessions] == [1.0, 0.5, 1.0]
    assert by_id[sessions[1]]["metrics"] == {"independent_reward": 0.3, "ruler_score": 0.5}
    assert "independent_reward" not in by_id[sessions[0]]["metrics"]
    assert len(group["judgements"]) == 3 and {j["judge_model"] for j in group["judgements"]} == {"openai/judge-model"}
    assert group["judgements"][1]["explanation"] == scores[sessions[1]]["explanation"]
    assert JUDGE_KEY.encode() not in raw_store_bytes(state_dir)


def test_judging_a_group_again_keeps_only_a_posted_reward_as_independent(gateway, judge_env, judge_port):
    server, _, _ = gateway
    sessions = _run_group(server, "g-twice", ["Answer 391", "Answer 12"])
    httpx.post(f"{server.url}/v1/sessions/{sessions[1]}/reward", json={"reward": 0.3}).raise_for_status()

    def scores(first: float, second: float) -> str:
        entries = [{"trajectory_id": i, "explanation": "", "score": v} for i, v in (("1", first), ("2", second))]
        return json.dumps({"scores": entries})

    with FakeJudge(port=judge_port, answers=[scores(0.9, 0.1), scores(0.2, 0.8)]) as judge:
        for _ in range(2):
            assert _ruler(server, "g-twice", judge_model="openai/j", judge_api_base=judge.url).status_code == 200
    by_id = {s["id"]: s for s in _group(server, "g-twice")["sessions"]}
    assert by_id[sessions[0]]["reward"] == 0.2
    assert by_id[sessions[0]]["metrics"] == {"ruler_score": 0.2}  # the first judge's 0.9 was nobody's reward
    assert by_id[sessions[1]]["metrics"] == {"independent_reward": 0.3, "ruler_score": 0.8}


def test_a_reward_posted_between_two_judgements_is_the_independent_one(gateway, judge_env, judge_port):
    # Posted, judged, posted again (the group is open until a step claims it), judged again: the
    # independent reward kept beside the second judge's score is the one posted last. The first
    # stayed: the session's metrics said 0.3 was the client's reward when it had said 0.6.
    server, _, _ = gateway
    sessions = _run_group(server, "g-reposted", ["Answer 391", "Answer 12"])
    entries = [{"trajectory_id": i, "explanation": "", "score": v} for i, v in (("1", 0.9), ("2", 0.1))]
    with FakeJudge(port=judge_port, answers=[json.dumps({"scores": entries})] * 2) as judge:
        for posted in (0.3, 0.6):
            httpx.post(f"{server.url}/v1/sessions/{sessions[1]}/reward", json={"reward": posted}).raise_for_status()
            assert _ruler(server, "g-reposted", judge_model="openai/j", judge_api_base=judge.url).status_code == 200
    by_id = {s["id"]: s for s in _group(server, "g-reposted")["sessions"]}
    assert by_id[sessions[1]]["reward"] == 0.1
    assert by_id[sessions[1]]["metrics"] == {"independent_reward": 0.6, "ruler_score": 0.1}
    assert by_id[sessions[0]]["metrics"] == {"ruler_score": 0.9}


def test_a_custom_rubric_reaches_the_judge(gateway, judge_env, judge_port):
    server, _, _ = gateway
    _run_group(server, "g-rubric", ["Answer 391", "Answer 390"])
    with FakeJudge(port=judge_port) as judge:
        assert (
            _ruler(
                server,
                "g-rubric",
                judge_model="openai/j",
                judge_api_base=judge.url,
                rubric="Only the exact product counts.",
            ).status_code
            == 200
        )
    system = judge.bodies[0]["messages"][0]["content"]
    assert "Only the exact product counts." in system and DEFAULT_RUBRIC not in system


def test_a_malformed_answer_is_retried_once_with_the_reason(gateway, judge_env, judge_port):
    server, _, _ = gateway
    _run_group(server, "g-retry", ["Answer 391", "Answer 12"])
    with FakeJudge(port=judge_port, answers=["I think the first one is better."]) as judge:
        response = _ruler(server, "g-retry", judge_model="openai/j", judge_api_base=judge.url)
    assert response.status_code == 200, response.text
    first, second = judge.bodies
    assert second["messages"][:2] == first["messages"]
    assert second["messages"][2] == {"role": "assistant", "content": "I think the first one is better."}
    assert "not valid JSON" in second["messages"][3]["content"] and "['1', '2']" in second["messages"][3]["content"]
    assert _group(server, "g-retry")["ruler_status"] == "scored"


def test_two_bad_answers_fail_the_judgement_and_leave_the_group_unscored(gateway, judge_env, judge_port):
    server, _, _ = gateway
    sessions = _run_group(server, "g-fail", ["Answer 391", "Answer 12"])
    wrong_ids = json.dumps(
        {
            "scores": [
                {"trajectory_id": "a", "explanation": "", "score": 1},
                {"trajectory_id": "b", "explanation": "", "score": 0},
            ]
        }
    )
    out_of_range = json.dumps(
        {
            "scores": [
                {"trajectory_id": "1", "explanation": "", "score": 7},
                {"trajectory_id": "2", "explanation": "", "score": 0},
            ]
        }
    )
    with FakeJudge(port=judge_port, answers=[wrong_ids, out_of_range]) as judge:
        response = _ruler(server, "g-fail", judge_model="openai/j", judge_api_base=judge.url)
    assert len(judge.requests) == 2  # exactly one retry
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == "judge_error"
    assert "answered wrongly twice" in error["message"] and "ids ['a', 'b']" in error["message"]

    group = _group(server, "g-fail")
    assert group["ruler_status"] == "failed" and group["ruler_error"] == error["message"]
    assert not group["closed"] and group["judgements"] == []
    assert all(s["reward"] is None for s in group["sessions"] if s["id"] in sessions)


def test_an_unreachable_judge_is_reported_without_its_key(gateway, judge_env, judge_port, caplog):
    server, _, state_dir = gateway
    _run_group(server, "g-refused", ["Answer 391", "Answer 12"])
    with FakeJudge(port=judge_port, status=400) as judge:  # its error message quotes the key it was sent
        response = _ruler(server, "g-refused", judge_model="openai/j", judge_api_base=judge.url)
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert "the judge 'openai/j' failed" in message and "HTTP 400" in message
    # What the judge replied goes to the log only (issue 37: a reply read back made RULER an SSRF).
    assert "refuses the key" not in message and "refuses the key" in caplog.text
    assert JUDGE_KEY not in message and JUDGE_KEY not in caplog.text
    group = _group(server, "g-refused")
    assert group["ruler_status"] == "failed" and JUDGE_KEY not in group["ruler_error"]
    assert JUDGE_KEY.encode() not in raw_store_bytes(state_dir)


def test_a_judge_nobody_listens_for_is_said_to_be_unreachable_not_an_http_500(gateway, judge_env, judge_port):
    # litellm wraps a refused connection in an InternalServerError with status_code 500: no judge
    # answered at all, so the reason must not read as the judge's own HTTP 500 reply.
    server, _, _ = gateway
    _run_group(server, "g-nobody", ["Answer 391", "Answer 12"])
    response = _ruler(server, "g-nobody", judge_model="openai/j", judge_api_base=judge_url(judge_port))
    assert response.status_code == 502, response.text
    message = response.json()["error"]["message"]
    assert "the judge 'openai/j' failed" in message and "could not connect" in message, message
    assert "HTTP 500" not in message and "its reply" not in message
    assert _group(server, "g-nobody")["ruler_error"] == message


def test_a_judge_that_never_finishes_its_answer_fails_the_judgement_in_time(
    gateway, judge_env, judge_port, monkeypatch
):
    """A judge that keeps the connection busy (a space now and then, never the JSON) fails the
    judgement once JUDGE_TIMEOUT has passed, and the group can be judged again."""
    server, _, _ = gateway
    _run_group(server, "g-stalled", ["Answer 391", "Answer 12"])
    monkeypatch.setattr("gateway.ruler.judges.JUDGE_TIMEOUT", 2.0)
    with FakeJudge(port=judge_port, stall=True) as judge:
        response = _ruler(server, "g-stalled", judge_model="openai/j", judge_api_base=judge.url)
    assert response.status_code == 502, response.text
    assert "the judge 'openai/j' did not answer within 2 s" in response.json()["error"]["message"]
    group = _group(server, "g-stalled")
    assert group["ruler_status"] == "failed" and "did not answer within 2 s" in group["ruler_error"]

    with FakeJudge(port=judge_port) as judge:  # not "being judged already": it can be judged again
        again = _ruler(server, "g-stalled", judge_model="openai/j", judge_api_base=judge.url)
    assert again.status_code == 200, again.text
    assert _group(server, "g-stalled")["ruler_status"] == "scored"


def test_a_group_is_judged_once_at_a_time_and_shows_running(gateway, judge_env, judge_port):
    server, _, _ = gateway
    _run_group(server, "g-busy", ["Answer 391", "Answer 12"])
    asked, release = threading.Event(), threading.Event()

    def slow_answer(body: dict) -> str:
        asked.set()
        release.wait(30)
        return good_answer(body)

    with FakeJudge(port=judge_port, answers=[slow_answer]) as judge:
        first: dict = {}
        worker = threading.Thread(
            target=lambda: first.setdefault(
                "response", _ruler(server, "g-busy", judge_model="openai/j", judge_api_base=judge.url)
            )
        )
        worker.start()
        try:
            assert asked.wait(60)
            assert _group(server, "g-busy")["ruler_status"] == "running"
            again = _ruler(server, "g-busy", judge_model="openai/j", judge_api_base=judge.url)
            assert again.status_code == 409 and "being judged already" in again.json()["error"]["message"]
        finally:
            release.set()
            worker.join(60)
    assert first["response"].status_code == 200


def test_a_group_whose_sessions_were_all_discarded_is_refused_not_a_judge_error(gateway, judge_env, judge_port):
    server, _, _ = gateway
    for session_id in _run_group(server, "g-discarded", ["Answer 391", "Answer 12"]):
        httpx.post(f"{server.url}/v1/sessions/{session_id}/discard", json={"reason": "crashed"}).raise_for_status()
    with FakeJudge(port=judge_port) as judge:
        response = _ruler(server, "g-discarded", judge_model="openai/j", judge_api_base=judge.url)
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["message"] == "group 'g-discarded' has no sessions to judge: all 2 were discarded"
    assert error["param"] == "group_id" and judge.requests == []
    assert _group(server, "g-discarded")["ruler_status"] is None  # no judgement was tried


def test_a_group_a_step_took_while_the_judge_thought_is_a_conflict_not_a_judge_error(gateway, judge_env, judge_port):
    server, services, _ = gateway
    sessions = _run_group(server, "g-taken", ["Answer 391", "Answer 12"])
    for value, session_id in enumerate(sessions):  # rewarded and closed: ready for the trainer
        httpx.post(f"{server.url}/v1/sessions/{session_id}/reward", json={"reward": value}).raise_for_status()
    httpx.post(f"{server.url}/v1/groups/g-taken/close", json={}).raise_for_status()
    asked = threading.Event()

    def answer_once_a_step_took_it(body: dict) -> str:
        asked.set()
        assert services.store.claim_for_step(["g-taken"], 1) == ["g-taken"]
        return good_answer(body)

    with FakeJudge(port=judge_port, answers=[answer_once_a_step_took_it]) as judge:
        response = _ruler(server, "g-taken", judge_model="openai/j", judge_api_base=judge.url)
    assert asked.is_set()
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["type"] == "conflict_error" and "is being trained (step 1)" in error["message"]
    group = _group(server, "g-taken")
    assert group["ruler_status"] == "failed" and group["ruler_error"] == error["message"]
    assert [s["reward"] for s in group["sessions"]] == [0, 1]  # the rewards the step took


def test_bad_requests_are_refused(gateway):
    server, _, _ = gateway
    missing = _ruler(server, "no-such-group", judge_model="openai/j")
    assert missing.status_code == 404 and "not found" in missing.json()["error"]["message"]
    assert _ruler(server, "g-judged").status_code == 400  # no judge_model
    bad_base = _ruler(server, "g-judged", judge_model="openai/j", judge_api_base="ftp://x")
    assert bad_base.status_code == 400 and "http://" in bad_base.json()["error"]["message"]


# ---------------------------------------------------------------- judge_model "self"


class _ScriptedEngine(Engine):
    """Answers every call with the next scripted content; a judge prompt gets a good answer."""

    kind = "scripted"

    def __init__(self):
        self.bodies: list[dict] = []

    @property
    def base_model_id(self) -> str:
        return "scripted-base"

    async def complete(self, request: EngineRequest) -> Completion:
        self.bodies.append(request.body)
        is_judge = request.body.get("response_format") == RESPONSE_FORMAT
        content = good_answer(request.body) if is_judge else f"attempt {len(self.bodies)}"
        return Completion(
            response={
                "id": "x",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": request.body["model"],
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
                ],
            },
            tokens=None,
        )

    async def stream(self, request: EngineRequest):
        yield StreamEnd(tokens=None)


def test_self_judges_with_the_served_model_and_is_not_recorded(tmp_path):
    engine = _ScriptedEngine()
    app = create_app(Settings(state_dir=tmp_path, trainer="off"), engine=engine)
    with ThreadServer(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for i in range(2):
            client.chat.completions.create(
                model="scripted-base",
                messages=[{"role": "user", "content": "go"}],
                extra_headers={"X-Session-Id": f"self-{i}", "X-Group-Id": "g-self"},
            )
        calls_before = app.state.services.store.counts()["calls"]
        response = _ruler(server, "g-self", judge_model="self")
        assert response.status_code == 200, response.text
        assert app.state.services.store.counts()["calls"] == calls_before  # the judge's call is not training data
        judge_body = engine.bodies[-1]
        assert judge_body["response_format"] == RESPONSE_FORMAT and judge_body["model"] == "scripted-base"
        assert [s["score"] for s in response.json()["scores"]] == [1.0, 0.5]
        with_base = _ruler(server, "g-self", judge_model="self", judge_api_base="http://127.0.0.1:1/v1")
        assert with_base.status_code == 400
