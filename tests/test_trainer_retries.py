"""Retries are not trajectories: 499 calls and retry orphans are recorded but never trained."""

from trainer.data import trajectory_samples
from trainer.retries import retry_orphans, trainable_calls

Q1 = [{"role": "user", "content": "what is 2+2?"}]


def call(call_id, messages, answer, prompt, completion, status="ok", http_status=200):
    return {
        "id": call_id,
        "status": status,
        "http_status": http_status,
        "request": {"model": "m", "messages": messages},
        "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]},
        "prompt_ids": prompt,
        "completion_ids": [completion],
        "behaviour_logprobs": [[-0.5] * len(completion)],
    }


def test_retry_whose_first_answer_was_dropped():
    # The client timed out on `a` and retried (`b`, same request); it went on from b's answer.
    a = call("a", Q1, "five", [1, 2], [50])
    b = call("b", Q1, "four", [1, 2], [40])
    c = call(
        "c",
        [*Q1, {"role": "assistant", "content": "four"}, {"role": "user", "content": "sure?"}],
        "yes",
        [1, 2, 40, 3],
        [60],
    )
    assert retry_orphans([a, b, c]) == {"a"}
    samples = trajectory_samples([a, b, c], trajectory_id="s", group_id="g", advantage=1.0)
    # By hand: b then c merge into one sequence; a's token 50 appears nowhere.
    assert [(s.token_ids, s.loss_mask) for s in samples] == [((1, 2, 40, 3, 60), (False, False, True, False, True))]


def test_conversation_continued_from_the_first_answer():
    # The retry's answer arrived but the client had already gone on with the first one.
    a = call("a", Q1, "four", [1, 2], [40])
    b = call("b", Q1, "five", [1, 2], [50])
    c = call(
        "c",
        [*Q1, {"role": "assistant", "content": "four"}, {"role": "user", "content": "ok"}],
        "x",
        [1, 2, 40, 3],
        [60],
    )
    assert retry_orphans([a, b, c]) == {"b"}
    assert [x["id"] for x in trainable_calls([a, b, c])] == ["a", "c"]


def test_last_turn_retried_keeps_the_latest():
    a = call("a", Q1, "five", [1, 2], [50])
    b = call("b", Q1, "four", [1, 2], [40])
    assert retry_orphans([a, b]) == {"a"}
    samples = trajectory_samples([a, b], trajectory_id="s", group_id="g", advantage=1.0)
    assert [s.token_ids for s in samples] == [(1, 2, 40)]


def test_client_left_499_is_never_trained():
    gone = call("gone", Q1, "four", [1, 2], [40], status="ok", http_status=499)
    stream_gone = call("sg", Q1, "fo", [1, 2], [41], status="error", http_status=499)
    assert trainable_calls([gone, stream_gone]) == []
    assert trajectory_samples([gone, stream_gone], trajectory_id="s", group_id="g", advantage=1.0) == []


def test_distinct_requests_are_not_retries():
    a = call("a", Q1, "four", [1, 2], [40])
    b = call("b", [{"role": "user", "content": "and 3+3?"}], "six", [1, 5], [70])
    assert retry_orphans([a, b]) == set()
    assert len(trainable_calls([a, b])) == 2
