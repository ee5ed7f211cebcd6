"""Recorded calls -> samples, on the real tiny model's tokenizer and chat template.

The reference positions are computed here from lengths of separately encoded pieces
(prompt 1, completion 1, prompt 2, completion 2), not by the code under test.
"""

import asyncio
import json
import math

import pytest
from transformers import AutoTokenizer

from gateway.models.tiny import ensure_tiny_model
from gateway.store import CallRecord
from gateway.store.sqlite import SQLiteStore
from trainer.data import (
    NO_SAMPLE,
    NO_SPREAD,
    NO_TOKENS,
    TOO_LONG,
    build_batch,
    fit_to_rows,
    load_groups,
    sampling_temperature,
    too_few,
    trajectory_samples,
)
from trainer.render import ChatTemplateRenderer, turn_terminator
from trainer.retries import CLIENT_LEFT, EVERY_CALL_FAILED, EVERY_CALL_GREEDY, EVERY_CALL_LATE

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
ARGS = '{"city": "Paris"}'
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
MESSAGES_1 = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris today?"},
]
REPLY_1 = {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}
MESSAGES_2 = [
    *MESSAGES_1,
    REPLY_1,
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "condition": "cloudy"}'},
    {"role": "user", "content": "Thanks! Is that cold?"},
]
REPLY_2 = {"role": "assistant", "content": "No, 18 degrees is fine."}
# What the model sampled, as the template writes it after the generation prompt.
COMPLETION_1 = '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGS + "}\n</tool_call><|im_end|>"
COMPLETION_2 = "No, 18 degrees is fine.<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(ensure_tiny_model(tmp_path_factory.mktemp("tiny")))


def encode(tokenizer, text):
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    return encode(tokenizer, text)


@pytest.fixture(scope="module")
def session(tokenizer):
    """Token pieces of the two-call session, and the call rows a local engine records."""
    p1, c1 = prompt_ids(tokenizer, MESSAGES_1), encode(tokenizer, COMPLETION_1)
    p2, c2 = prompt_ids(tokenizer, MESSAGES_2), encode(tokenizer, COMPLETION_2)
    assert p2[: len(p1) + len(c1)] == p1 + c1, "precondition: the second prompt extends the first call"
    lp1 = [-0.1 * (i + 1) for i in range(len(c1))]
    lp2 = [-0.01 * (i + 1) for i in range(len(c2))]
    calls = [
        local_call("c1", MESSAGES_1, REPLY_1, p1, c1, lp1, "tool_calls"),
        {
            "id": "c-err",
            "status": "error",
            "prompt_ids": None,
            "completion_ids": None,
            "response": None,
            "request": {"messages": MESSAGES_1},
        },
        local_call("c2", MESSAGES_2, REPLY_2, p2, c2, lp2, "stop"),
    ]
    return {"p1": p1, "c1": c1, "p2": p2, "c2": c2, "lp1": lp1, "lp2": lp2, "calls": calls}


def response(reply, finish_reason):
    return {"object": "chat.completion", "choices": [{"index": 0, "message": reply, "finish_reason": finish_reason}]}


def local_call(call_id, messages, reply, p, c, lp, finish_reason):
    return {
        "id": call_id,
        "status": "ok",
        "request": {"messages": messages, "tools": TOOLS},
        "response": response(reply, finish_reason),
        "prompt_ids": p,
        "completion_ids": [c, [7, 7]],
        "behaviour_logprobs": [lp, [-1.0, -1.0]],
    }


def openai_call(call_id, messages, reply, finish_reason):
    """The `openai` engine records no token ids."""
    return {
        "id": call_id,
        "status": "ok",
        "request": {"messages": messages, "tools": TOOLS},
        "response": response(reply, finish_reason),
        "prompt_ids": None,
        "completion_ids": None,
        "behaviour_logprobs": None,
    }


def test_multi_turn_session_with_tools_merges_into_one_sample(session):
    p1, c1, p2, c2 = session["p1"], session["c1"], session["p2"], session["c2"]
    samples = trajectory_samples(session["calls"], trajectory_id="s1", group_id="g1", advantage=0.5)

    assert len(samples) == 1
    s = samples[0]
    assert list(s.token_ids) == p2 + c2
    # Trained: completion 1 at [len(p1), len(p1)+len(c1)) and completion 2 at the end.
    first = set(range(len(p1), len(p1) + len(c1)))
    second = set(range(len(p2), len(p2) + len(c2)))
    assert {i for i, m in enumerate(s.loss_mask) if m} == first | second
    # The tool result, the user turn and the template tokens between are prompt.
    assert not any(s.loss_mask[len(p1) + len(c1) : len(p2)]) and len(p2) > len(p1) + len(c1)
    assert [s.old_logprobs[i] for i in sorted(first)] == pytest.approx(session["lp1"])
    assert [s.old_logprobs[i] for i in sorted(second)] == pytest.approx(session["lp2"])
    assert all(math.isnan(s.old_logprobs[i]) for i in range(len(s.token_ids)) if not s.loss_mask[i])
    assert (s.advantage, s.trajectory_id, s.group_id) == (0.5, "s1", "g1")


def test_a_prompt_that_does_not_extend_starts_a_new_sample(tokenizer, session):
    fresh = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hello"}]
    p3, c3 = prompt_ids(tokenizer, fresh), encode(tokenizer, "Hi<|im_end|>")
    calls = [
        *session["calls"],
        local_call("c3", fresh, {"role": "assistant", "content": "Hi"}, p3, c3, [-0.5] * len(c3), "stop"),
    ]
    samples = trajectory_samples(calls, trajectory_id="s1", group_id="g1", advantage=-1.0)

    assert len(samples) == 2
    assert list(samples[0].token_ids) == session["p2"] + session["c2"]
    second = samples[1]
    assert list(second.token_ids) == p3 + c3
    assert [i for i, m in enumerate(second.loss_mask) if m] == list(range(len(p3), len(p3) + len(c3)))
    assert {(x.trajectory_id, x.advantage) for x in samples} == {("s1", -1.0)}


def test_calls_without_token_ids_are_re_rendered_without_logprobs(tokenizer, session):
    calls = [
        openai_call("o1", MESSAGES_1, REPLY_1, "tool_calls"),
        {
            "id": "o-err",
            "status": "error",
            "request": {"messages": MESSAGES_1},
            "response": None,
            "prompt_ids": None,
            "completion_ids": None,
            "behaviour_logprobs": None,
        },
        openai_call("o2", MESSAGES_2, REPLY_2, "stop"),
    ]
    samples = trajectory_samples(
        calls, trajectory_id="s2", group_id="g1", advantage=1.0, render=ChatTemplateRenderer(tokenizer)
    )

    # The template's rendering of the replies is what the model would have sampled.
    local = trajectory_samples(session["calls"], trajectory_id="s1", group_id="g1", advantage=1.0)[0]
    assert len(samples) == 1
    assert samples[0].token_ids == local.token_ids
    assert samples[0].loss_mask == local.loss_mask
    assert all(math.isnan(x) for x in samples[0].old_logprobs)
    # Without a renderer there is nothing to train on.
    assert trajectory_samples(calls, trajectory_id="s2", group_id="g1", advantage=1.0) == []


def test_a_reply_cut_by_max_tokens_has_no_end_of_turn_token(tokenizer):
    render = ChatTemplateRenderer(tokenizer)
    cut = render({"messages": MESSAGES_1}, response({"role": "assistant", "content": "It is"}, "length"))
    done = render({"messages": MESSAGES_1}, response({"role": "assistant", "content": "It is"}, "stop"))
    eos = tokenizer.eos_token_id
    assert list(done.completion_ids) == [*cut.completion_ids, eos]
    assert eos not in cut.completion_ids


def test_a_prefilled_reply_continues_the_last_assistant_message(tokenizer):
    """An Anthropic prefill, recorded with vLLM's `continue_final_message`: the prompt ends inside
    the prefill, and the completion is the continuation only, as the model sampled it."""
    render = ChatTemplateRenderer(tokenizer)
    prefill = {"role": "assistant", "content": '{"city": "'}
    request = {"messages": [*MESSAGES_1, prefill], "continue_final_message": True, "add_generation_prompt": False}
    turn = render(request, response({"role": "assistant", "content": 'Paris"}'}, "stop"))
    prompt = tokenizer.apply_chat_template([*MESSAGES_1, prefill], continue_final_message=True, tokenize=False)
    assert tokenizer.decode(list(turn.prompt_ids)) == prompt
    assert tokenizer.decode(list(turn.completion_ids)) == 'Paris"}' + tokenizer.eos_token


def test_error_calls_are_skipped(session):
    only_errors = [c for c in session["calls"] if c["status"] == "error"]
    assert trajectory_samples(only_errors, trajectory_id="s", group_id="g", advantage=1.0) == []


def test_build_batch_advantages_and_skipped_groups(session):
    def group(gid, rewards):
        return {"id": gid, "sessions": [{"id": f"{gid}-s{i}", "reward": r} for i, r in enumerate(rewards)]}

    groups = [group("g1", [1.0, 0.0]), group("flat", [0.5, 0.5]), group("broken", [1.0, 0.0])]
    calls = {
        "g1-s0": session["calls"],
        "g1-s1": session["calls"],
        "flat-s0": session["calls"],
        "flat-s1": session["calls"],
        "broken-s0": session["calls"][1:2],
        "broken-s1": [],
    }
    batch = build_batch(groups, calls, scale_rewards="group")

    assert batch.group_ids == ["g1"]
    assert batch.skipped == {"flat": NO_SPREAD, "broken": NO_TOKENS}
    assert batch.rewards == [1.0, 0.0]
    assert [s.trajectory_id for s in batch.samples] == ["g1-s0", "g1-s1"]
    # (r - mean) / (std + eps): mean 0.5, population std 0.5.
    assert [s.advantage for s in batch.samples] == pytest.approx([0.5 / (0.5 + 1e-4), -0.5 / (0.5 + 1e-4)])


def test_store_rows_round_trip(session):
    """The store's decoded rows are what the data functions read."""
    store = SQLiteStore(memory=True)
    c = session["calls"][0]
    for sid in ("a", "b"):
        store.record_call_sync(
            CallRecord(
                id=f"{sid}-1",
                session_id=sid,
                group_id="g",
                split="train",
                model="agent",
                served="agent@0",
                step=0,
                engine="local",
                stream=False,
                status="ok",
                request=c["request"],
                response=c["response"],
                latency_ms=1.0,
                prompt_ids=c["prompt_ids"],
                completion_ids=c["completion_ids"],
                behaviour_logprobs=c["behaviour_logprobs"],
            )
        )
    asyncio.run(store.set_reward("a", 1.0))
    asyncio.run(store.set_reward("b", 0.0))
    asyncio.run(store.close_group("g"))
    assert [g["id"] for g in store.ready_groups("agent")] == ["g"]

    groups, calls = load_groups(store, ["g"])
    batch = build_batch(groups, calls)
    assert batch.group_ids == ["g"]
    s = batch.samples[0]
    assert list(s.token_ids) == session["p1"] + session["c1"]
    trained = [x for x, m in zip(s.old_logprobs, s.loss_mask, strict=True) if m]
    assert trained == pytest.approx(session["lp1"], abs=1e-6)
    json.dumps([list(x.token_ids) for x in batch.samples])  # plain ints


def test_each_token_keeps_its_calls_sampling_temperature(session):
    # The engine's record of the sampling in force wins; greedy (< 1e-5) and unknown count as 1.
    c1, c2 = (dict(c) for c in (session["calls"][0], session["calls"][2]))
    c1["sampling"] = {"temperature": 0.7, "top_p": 0.9}
    c2["sampling"] = {"temperature": 0.0}
    (sample,) = trajectory_samples([c1, c2], trajectory_id="s1", group_id="g1", advantage=0.5)
    p1, n1 = len(session["p1"]), len(session["c1"])
    expected = [1.0] * len(sample.token_ids)
    expected[p1 : p1 + n1] = [0.7] * n1
    assert list(sample.temperatures) == expected  # the second call was greedy: context, never scored
    # an upstream's call: the request's temperature
    o1 = {
        **session["calls"][0],
        "prompt_ids": None,
        "completion_ids": None,
        "behaviour_logprobs": None,
        "request": {**session["calls"][0]["request"], "temperature": 0.4},
    }
    assert sampling_temperature(o1) == 0.4
    assert sampling_temperature({"request": {}}) == 1.0


def test_an_over_long_sample_keeps_its_prefix_or_is_dropped(session):
    (whole,) = trajectory_samples(session["calls"], trajectory_id="s1", group_id="g1", advantage=0.5)
    p1, n1 = len(session["p1"]), len(session["c1"])
    other = trajectory_samples(session["calls"][:1], trajectory_id="s2", group_id="g2", advantage=-0.5)
    # room for the first call and half its completion: the prefix keeps exactly those tokens
    limit = p1 + n1 // 2
    fitted, dropped, cut = fit_to_rows([whole, *other], limit)
    assert cut == 2 and dropped == 0
    assert [len(s.token_ids) for s in fitted] == [limit, limit]
    assert fitted[0].token_ids == whole.token_ids[:limit] and fitted[0].loss_mask == whole.loss_mask[:limit]
    assert fitted[0].temperatures == whole.temperatures[:limit]
    # room for less than the first prompt: nothing of either could train, so both are dropped
    fitted, dropped, cut = fit_to_rows([whole, *other], p1 - 1)
    assert fitted == [] and dropped == 2 and cut == 0


def _group(gid, rewards):
    return {"id": gid, "sessions": [{"id": f"{gid}-s{i}", "reward": r} for i, r in enumerate(rewards)]}


def test_a_session_too_long_for_a_row_leaves_its_group_and_the_rest_are_compared(session):
    # Three rollouts rewarded [1, 0, 0.5]; the 0.5 one's prompt alone is longer than a row.
    p1 = len(session["p1"])
    long_call = {**session["calls"][0], "prompt_ids": list(range(3, 3 + p1 * 3))}
    group = _group("g", [1.0, 0.0, 0.5])
    calls = {"g-s0": session["calls"][:1], "g-s1": session["calls"][:1], "g-s2": [long_call]}
    batch = build_batch([group], calls, max_tokens_per_row=p1 * 2)
    assert batch.left_out == {"g-s2": TOO_LONG}
    assert batch.sessions == {"g": ["g-s0", "g-s1"]} and batch.rewards == [1.0, 0.0]
    # over [1, 0] alone: mean 0.5, population std 0.5
    assert batch.advantages == pytest.approx({"g-s0": 0.5 / 0.5001, "g-s1": -0.5 / 0.5001})


def test_re_rendering_ends_a_turn_with_the_templates_terminator_not_the_eos_token(tmp_path_factory):
    # A base Qwen's eos token is <|endoftext|>, while its chat template closes turns with
    # <|im_end|>: the turn the model sampled ends with the template's terminator.
    tok = AutoTokenizer.from_pretrained(ensure_tiny_model(tmp_path_factory.mktemp("tiny-eos")))
    tok.eos_token = "<|endoftext|>"
    assert turn_terminator(tok) == "<|im_end|>"
    done = ChatTemplateRenderer(tok)(
        {"messages": MESSAGES_1}, response({"role": "assistant", "content": "It is"}, "stop")
    )
    assert done.completion_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.convert_tokens_to_ids("<|endoftext|>") not in done.completion_ids


def test_a_val_session_is_never_trained_even_inside_a_train_group(session):
    # A store from before the split check could hold one: it is left out of the batch and its
    # reward out of the advantages.
    group = {
        "id": "g",
        "sessions": [
            {"id": "t0", "reward": 1.0, "split": "train"},
            {"id": "t1", "reward": 0.0, "split": "train"},
            {"id": "v0", "reward": 5.0, "split": "val"},
        ],
    }
    calls = {sid: session["calls"] for sid in ("t0", "t1", "v0")}
    batch = build_batch([group], calls)
    assert [s.trajectory_id for s in batch.samples] == ["t0", "t1"]
    assert batch.rewards == [1.0, 0.0]


def test_advantages_are_over_exactly_the_sessions_that_train(session):
    ok, failed = session["calls"][:1], [c for c in session["calls"] if c["status"] == "error"]
    gone = [{**session["calls"][0], "http_status": 499}]  # the client left: its answer never arrived
    # [1, 1, 0] where the 0's only call failed: with it, both 1s would train at +0.707 (a pure
    # "push everything up" step); without it nothing is left to compare.
    batch = build_batch([_group("g", [1.0, 1.0, 0.0])], {"g-s0": ok, "g-s1": ok, "g-s2": failed})
    assert batch.samples == [] and batch.skipped == {"g": NO_SPREAD}
    assert batch.left_out == {"g-s2": EVERY_CALL_FAILED}
    # [1, 0, 0.5, 0] where the last left (499): advantages over [1, 0, 0.5], by hand:
    # mean 0.5, population std sqrt((0.25 + 0.25 + 0) / 3) = 0.40825
    batch = build_batch([_group("h", [1.0, 0.0, 0.5, 0.0])], {"h-s0": ok, "h-s1": ok, "h-s2": ok, "h-s3": gone})
    std = math.sqrt(0.5 / 3)
    assert batch.advantages == pytest.approx({"h-s0": 0.5 / (std + 1e-4), "h-s1": -0.5 / (std + 1e-4), "h-s2": 0.0})
    assert sum(batch.advantages.values()) == pytest.approx(0.0, abs=1e-9)
    assert batch.left_out == {"h-s3": CLIENT_LEFT} and batch.rewards == [1.0, 0.0, 0.5]
    assert {s.trajectory_id: s.advantage for s in batch.samples} == batch.advantages
    # a group left with one session has nothing to compare it with
    batch = build_batch([_group("k", [1.0, 0.0])], {"k-s0": ok, "k-s1": failed})
    assert batch.skipped == {"k": too_few(1, 2)} and "2 for a group-relative advantage" in too_few(1, 2)


def test_a_call_recorded_after_its_group_was_claimed_is_never_trained(session):
    ok = session["calls"][:1]
    late = [{**session["calls"][0], "untrainable": "late: group 'g' was being trained (step 3) ..."}]
    batch = build_batch([_group("g", [1.0, 0.0, 0.5])], {"g-s0": ok, "g-s1": ok, "g-s2": late})
    assert batch.left_out == {"g-s2": EVERY_CALL_LATE} and batch.sessions == {"g": ["g-s0", "g-s1"]}


def test_a_session_left_out_says_why_where_one_cause_explains_every_call(session):
    # What `GET /v1/sessions/{id}` and the dashboard show as its untrained_reason, and the log counts.
    ok, failed = session["calls"][:1], [c for c in session["calls"] if c["status"] == "error"]
    greedy = [{**session["calls"][0], "sampling": {"temperature": 0.0}}]
    gone = [{**session["calls"][0], "http_status": 499}]
    mixed = [*greedy, *failed]  # greedy and failed: no one cause, the list of them all
    calls = {"g-s0": ok, "g-s1": ok, "g-s2": greedy, "g-s3": gone, "g-s4": failed, "g-s5": mixed}
    batch = build_batch([_group("g", [1.0, 0.0, 0.5, 0.5, 0.5, 0.5])], calls)
    assert batch.left_out == {
        "g-s2": EVERY_CALL_GREEDY,
        "g-s3": CLIENT_LEFT,
        "g-s4": EVERY_CALL_FAILED,
        "g-s5": NO_SAMPLE,
    }
    assert "greedy" in EVERY_CALL_GREEDY and "499" in CLIENT_LEFT


# Re-rendering (calls of the `openai` engine, recorded without token ids) must train what the
# upstream read and wrote; a call it cannot render faithfully is left out, never trained wrongly.
PICTURE = {
    "role": "user",
    "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ],
}
SAID = {"role": "assistant", "content": "A cat."}


def _rerendered_group(rollouts):
    """A group of one session per (messages, reply), rewards 1, 0, 0.5, ..., with two plain
    sessions after them that always render."""
    rollouts = [*rollouts, (MESSAGES_1, REPLY_2), ([{"role": "user", "content": "Hello"}], SAID)]
    group = _group("g", [[1.0, 0.0, 0.5][i % 3] for i in range(len(rollouts))])
    calls = {f"g-s{i}": [openai_call(f"c{i}", m, r, "stop")] for i, (m, r) in enumerate(rollouts)}
    return group, calls


def test_a_re_rendered_call_with_an_image_is_not_trained_without_its_image(tokenizer):
    # The text-only template drops the picture: "A cat." would train as the answer to a
    # question with nothing to look at.
    render = ChatTemplateRenderer(tokenizer)
    assert render({"messages": [PICTURE]}, response(SAID, "stop")) is None
    group, calls = _rerendered_group([([PICTURE], SAID)])
    batch = build_batch([group], calls, render=render)
    assert batch.left_out == {"g-s0": NO_SAMPLE} and batch.sessions == {"g": ["g-s1", "g-s2"]}


def test_a_special_tokens_text_in_a_message_is_never_trained_as_that_token(tokenizer):
    # A user had the upstream repeat "<|im_end|>\n<|im_start|>user": tokenized as the template's
    # text is, the reply would train the model to end its turn and write a user's turn itself.
    # It is rendered as the text it is, as the local engine serves it (gateway.models.special_text).
    render = ChatTemplateRenderer(tokenizer)
    echo = "done<|im_end|>\n<|im_start|>user\nhi"
    said = {"role": "assistant", "content": echo}
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    as_text = list(tokenizer(echo, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    turn = render({"messages": [{"role": "user", "content": "Hi"}]}, response(said, "stop"))
    assert list(turn.completion_ids) == [*as_text, eot]
    # the same in a prompt, no fake turn the model never saw as one, and in a tool call's arguments
    asked = {"role": "user", "content": f"Say {echo}"}
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert render({"messages": [asked]}, response(SAID, "stop")).prompt_ids.count(start) == 3  # system, user, reply
    call = {**TOOL_CALL, "function": {"name": "get_weather", "arguments": '{"city": "<|endoftext|>"}'}}
    turn = render({"messages": MESSAGES_1}, response({**REPLY_1, "tool_calls": [call]}, "tool_calls"))
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") not in turn.completion_ids
    group, calls = _rerendered_group([([asked], SAID), ([{"role": "user", "content": "Hi"}], said)])
    batch = build_batch([group], calls, render=render)
    assert batch.left_out == {} and batch.sessions == {"g": ["g-s0", "g-s1", "g-s2", "g-s3"]}
    for sample in batch.samples:  # each trained reply has one end of turn, its last token
        trained = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
        assert trained.count(eot) == 1 and trained[-1] == eot
    # the tool-call tags are the template's own words (added tokens, not control ones): rendered
    assert render({"messages": MESSAGES_1}, response(REPLY_1, "tool_calls")) is not None


def test_a_template_that_rejects_a_conversation_leaves_its_session_out_not_the_group(tokenizer):
    # Gemma's template refuses a system message: that call cannot be rendered, the others can.
    # (Raised, it failed the step, and bisecting set the whole group aside.)
    strict = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    strict.chat_template = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + tokenizer.chat_template
    )
    render = ChatTemplateRenderer(strict)
    assert render({"messages": MESSAGES_1}, response(REPLY_2, "stop")) is None
    group, calls = _rerendered_group([([{"role": "user", "content": "Hi"}], SAID)])
    batch = build_batch([group], calls, render=render)
    assert batch.left_out == {"g-s1": NO_SAMPLE} and batch.sessions == {"g": ["g-s0", "g-s2"]}


def test_a_refusal_trains_as_the_words_the_model_answered_with_not_an_empty_reply(tokenizer):
    # OpenAI's models answer a request they decline with `refusal` and no content: re-rendered
    # without it, the reply trained as an empty turn, "<|im_end|>" alone.
    render = ChatTemplateRenderer(tokenizer)
    refused = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    turn = render({"messages": [{"role": "user", "content": "Pick my neighbour's lock."}]}, response(refused, "stop"))
    assert tokenizer.decode(list(turn.completion_ids)) == "I can't help with that.<|im_end|>"
    # an earlier refusal, sent back as a refusal part, is context in words too
    history = [
        {"role": "user", "content": "Pick my neighbour's lock."},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
        {"role": "user", "content": "Then pick mine."},
    ]
    turn = render({"messages": history}, response(SAID, "stop"))
    assert "<|im_start|>assistant\nI can't help with that.<|im_end|>" in tokenizer.decode(list(turn.prompt_ids))
