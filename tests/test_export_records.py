"""`rlproxy export --format rlproxy|openai|parquet` on a store with tool-using sessions
that a real trainer step trained on.

The `openai` lines are checked by a validator written from OpenAI's chat fine-tuning
format (the `FineTuneChatRequestInput` schema of OpenAI's API reference and the
fine-tuning guide's tool-calling example); the parquet rows against the recording itself
(token ids, which tokens were sampled, their logprobs) and GRPO's advantage by hand.
"""

import asyncio
import json
import math
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from gateway.store import CallRecord
from gateway.store.sqlite import SQLiteStore
from tests.helpers_trainer import Recorder, trainer_settings
from trainer.data import build_batch, load_groups
from trainer.worker import run_worker

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


class ToolRecorder(Recorder):
    """Two calls per session, as an agent with a tool makes them: the model calls
    get_weather, the agent runs it and sends the result back, the model answers."""

    def render(self, messages: list[dict], reply: dict | None = None) -> str:
        msgs = [*messages, reply] if reply else messages
        return self.tokenizer.apply_chat_template(
            msgs, tools=TOOLS, add_generation_prompt=reply is None, tokenize=False
        )

    def turn(self, session_id, group_id, index, messages, reply, split, step):
        prompt_text = self.render(messages)
        completion_text = self.render(messages, reply)[len(prompt_text) :]
        completion_text = completion_text[
            : completion_text.rindex(self.tokenizer.eos_token) + len(self.tokenizer.eos_token)
        ]
        prompt, completion = self.encode(prompt_text), self.encode(completion_text)
        wire_reply = {**reply}
        if reply.get("tool_calls"):  # on the wire, arguments are a JSON string
            wire_reply["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                for c in reply["tool_calls"]
            ]
        self.store.record_call_sync(
            CallRecord(
                id=f"{session_id}-{index}",
                session_id=session_id,
                group_id=group_id,
                split=split,
                model="agent",
                served=f"agent@{step}",
                step=step,
                engine="local",
                stream=False,
                status="ok",
                request={"model": "agent", "messages": messages, "tools": TOOLS},
                response={
                    "choices": [
                        {
                            "index": 0,
                            "message": wire_reply,
                            "finish_reason": "tool_calls" if reply.get("tool_calls") else "stop",
                        }
                    ]
                },
                latency_ms=1.0,
                prompt_ids=prompt,
                completion_ids=[completion],
                behaviour_logprobs=[self.logprobs(prompt, completion)],
            )
        )
        return prompt, completion

    def tool_session(self, session_id, group_id, city, answer, reward, split="train", step=0):
        call = {
            "id": f"call_{session_id}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": city}},
        }
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"What is the weather in {city}?"},
        ]
        first = self.turn(
            session_id, group_id, 0, messages, {"role": "assistant", "content": "", "tool_calls": [call]}, split, step
        )
        wire_call = {**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}}
        messages = [
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [wire_call]},
            {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18}'},
        ]
        second = self.turn(session_id, group_id, 1, messages, {"role": "assistant", "content": answer}, split, step)
        asyncio.run(self.store.set_reward(session_id, reward))
        return first, second


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    settings = trainer_settings(tmp_path_factory.mktemp("state"))
    recorder = ToolRecorder(settings)
    recorded = {}
    for gid, cities in (("tools-a", ["Paris", "London"]), ("tools-b", ["Rome", "Oslo", "Lima"])):
        for i, city in enumerate(cities):
            sid = f"{gid}-s{i}"
            recorded[sid] = recorder.tool_session(sid, gid, city, f"It is sunny in {city}.", reward=float(i == 0))
        asyncio.run(recorder.store.close_group(gid))
    recorder.tool_session("val-s0", "val", "Bern", "Cold.", reward=0.25, split="val", step=1)
    recorder.group("untrained", [1.0, 0.0], step=1)  # closed after the step: never trained
    recorder.close()
    trained_settings = settings.model_copy(update={"groups_per_step": 2})
    # The step takes the two tool groups (the oldest ready ones); "untrained" waits for a next step.
    assert run_worker(trained_settings, max_steps=1) == 1
    return settings, recorded


def export(settings, tmp_path, fmt, *args):
    out = tmp_path / f"out.{fmt}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "export",
            "--state-dir",
            str(settings.state_dir),
            "--format",
            fmt,
            "-o",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return out


# ------------------------------------------------------------------ OpenAI's fine-tuning format


def validate_fine_tuning_line(line: dict) -> None:
    """One line of a chat fine-tuning file, as OpenAI's docs define it: only `messages`,
    `tools`, `parallel_tool_calls` (and the legacy `functions`) at the top; roles system,
    user, assistant, tool (function is legacy); an assistant message has content or
    tool_calls; a tool call is {id, type: "function", function: {name, arguments}} with
    `arguments` a string holding a JSON object; each tool message answers a tool call made
    earlier in the conversation; the conversation ends with an assistant message; `tools`
    are {type: "function", function: {name, description?, parameters?}}; an assistant
    `weight` is 0 or 1."""
    assert set(line) <= {"messages", "tools", "parallel_tool_calls", "functions"}, set(line)
    messages = line["messages"]
    assert isinstance(messages, list) and messages
    allowed = {
        "system": {"role", "content", "name"},
        "user": {"role", "content", "name"},
        "assistant": {"role", "content", "name", "tool_calls", "weight", "refusal", "function_call"},
        "tool": {"role", "content", "tool_call_id"},
    }
    open_calls: set[str] = set()
    for message in messages:
        role = message.get("role")
        assert role in allowed, f"role {role!r}"
        assert set(message) <= allowed[role], f"{role} message keys {set(message)}"
        if role in ("system", "user"):
            assert isinstance(message["content"], (str, list))
        if role == "assistant":
            assert "content" in message or message.get("tool_calls"), "assistant needs content or tool_calls"
            assert message.get("content") is None or isinstance(message["content"], str)
            assert message.get("weight", 1) in (0, 1)
            for call in message.get("tool_calls", []):
                assert set(call) == {"id", "type", "function"} and call["type"] == "function" and call["id"]
                assert set(call["function"]) == {"name", "arguments"} and call["function"]["name"]
                assert isinstance(call["function"]["arguments"], str), "arguments must be a JSON string"
                assert isinstance(json.loads(call["function"]["arguments"]), dict)
                open_calls.add(call["id"])
        if role == "tool":
            assert isinstance(message["content"], str)
            assert message["tool_call_id"] in open_calls, "a tool message answers an earlier tool call"
    assert messages[-1]["role"] == "assistant", "the conversation ends with what is trained: an assistant reply"
    names = set()
    for tool in line.get("tools", []):
        assert set(tool) == {"type", "function"} and tool["type"] == "function"
        assert set(tool["function"]) <= {"name", "description", "parameters", "strict"}
        assert isinstance(tool["function"]["name"], str)
        names.add(tool["function"]["name"])
    for message in messages:
        for call in message.get("tool_calls", []):
            assert not line.get("tools") or call["function"]["name"] in names, "a call names a declared tool"


def test_validator_rejects_what_openai_rejects():
    good = {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
            {"role": "assistant", "content": "ok"},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    validate_fine_tuning_line(good)
    bad_arguments = json.loads(json.dumps(good))
    bad_arguments["messages"][1]["tool_calls"][0]["function"]["arguments"] = {}
    bad_tool = json.loads(json.dumps(good))
    bad_tool["messages"][2]["tool_call_id"] = "c9"
    extra_key = {**good, "session_id": "s"}
    for bad in (bad_arguments, bad_tool, extra_key, {"messages": good["messages"][:3]}):
        with pytest.raises(AssertionError):
            validate_fine_tuning_line(bad)


def test_openai_export_is_valid_fine_tuning_data_one_line_per_trained_sample(trained, tmp_path):
    settings, recorded = trained
    out = export(settings, tmp_path, "openai", "--group", "tools-a", "--group", "tools-b")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    # Each session's two calls merge into one sample (the second prompt extends the first
    # prompt + completion), so one conversation per session.
    assert len(lines) == 5
    for line in lines:
        validate_fine_tuning_line(line)
        # Both replies of a merged session were sampled and trained: neither says weight 0.
        assert not any("weight" in message for message in line["messages"])
    first = lines[0]
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    call = first["messages"][2]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert first["messages"][3] == {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18}'}
    assert first["messages"][4] == {"role": "assistant", "content": "It is sunny in Paris."}
    assert first["tools"] == TOOLS


def test_parquet_rows_are_the_trainers_samples(trained, tmp_path):
    settings, recorded = trained
    table = pq.read_table(export(settings, tmp_path, "parquet", "--split", "train"))
    rows = {r["session_id"]: r for r in table.to_pylist()}
    # One row per sample: the five tool sessions (one merged sample each) and the two
    # single-call sessions of the group trained by no step yet.
    assert table.num_rows == 7 and len(rows) == 7

    store = SQLiteStore(settings.db_path)
    groups, calls = load_groups(store, ["tools-a", "tools-b"])
    batch = build_batch(groups, calls, scale_rewards="group")
    assert len(batch.samples) == 5
    for sample in batch.samples:  # the trainer's own samples, field by field
        row = rows[sample.trajectory_id]
        assert tuple(row["token_ids"]) == sample.token_ids
        assert tuple(row["loss_mask"]) == sample.loss_mask
        assert row["advantage"] == pytest.approx(sample.advantage)
        assert row["step"] == 1
        assert len(row["temperatures"]) == len(row["token_ids"])  # recorded at T = 1 here
        assert all(t == 1.0 for t in row["temperatures"])

    for sid, ((p1, c1), (p2, c2)) in recorded.items():  # and against the recording itself
        row = rows[sid]
        assert row["token_ids"] == p2 + c2 and p2[: len(p1) + len(c1)] == p1 + c1
        between = len(p2) - len(p1) - len(c1)  # the tool result and the template around it
        assert row["loss_mask"] == [False] * len(p1) + [True] * len(c1) + [False] * between + [True] * len(c2)
        assert row["prompt_ids"] == p1 and row["completion_ids"] == row["token_ids"][len(p1) :]
        logged = [x for x, m in zip(row["old_logprobs"], row["loss_mask"], strict=False) if m]
        assert all(x is None for x, m in zip(row["old_logprobs"], row["loss_mask"], strict=False) if not m)
        session_calls = store.session_calls(sid)
        assert logged == pytest.approx(
            session_calls[0]["behaviour_logprobs"][0] + session_calls[1]["behaviour_logprobs"][0]
        )
        # GRPO by hand: a group with one winner among n has advantages (r - mean) / (std + 1e-4),
        # std the population one: sqrt(p (1 - p)) with p = 1/n.
        n = 2 if sid.startswith("tools-a") else 3
        mean, std = 1 / n, math.sqrt((1 / n) * (1 - 1 / n))
        assert row["advantage"] == pytest.approx((sid.endswith("s0") - mean) / (std + 1e-4), abs=1e-6)
        assert row["reward"] == float(sid.endswith("s0"))
        messages = json.loads(row["messages"])
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert json.loads(row["tools"]) == TOOLS
    for sid in ("untrained-s0", "untrained-s1"):
        assert rows[sid]["step"] is None and rows[sid]["advantage"] is None and rows[sid]["sampled_by_step"] == 1
    asyncio.run(store.close())


def test_filters(trained, tmp_path):
    settings, _ = trained

    def ids(*args):
        out = export(settings, tmp_path, "rlproxy", *args)
        return sorted(json.loads(line)["id"] for line in out.read_text().splitlines())

    assert len(ids()) == 8
    assert ids("--split", "val") == ["val-s0"]
    assert ids("--group", "untrained") == ["untrained-s0", "untrained-s1"]
    assert ids("--min-reward", "0.5") == ["tools-a-s0", "tools-b-s0", "untrained-s0"]
    assert ids("--min-reward", "0.2", "--split", "val") == ["val-s0"]
    assert ids("--since-step", "1") == ["untrained-s0", "untrained-s1", "val-s0"]  # answered by agent@1
    assert ids("--rewarded", "--since-step", "2") == []


def test_parquet_needs_a_file_and_unknown_format_is_refused(trained):
    settings, _ = trained
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "export", "--state-dir", str(settings.state_dir), "--format", "parquet"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--output" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "export", "--format", "csv"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "invalid choice" in done.stderr


def test_calls_recorded_without_token_ids_are_rendered_like_the_trainer_does(tmp_path):
    """An `openai`-engine call has no token ids: its sample is the chat template's rendering
    (`ChatTemplateRenderer`, what the trainer trains on) with no behaviour logprobs."""
    from transformers import AutoTokenizer

    from gateway.models.registry import resolve_base_model
    from gateway.settings import Settings

    settings = Settings(state_dir=tmp_path)
    store = SQLiteStore(settings.db_path)
    messages = [{"role": "user", "content": "Hello"}]
    store.record_call_sync(
        CallRecord(
            id="r1",
            session_id="s1",
            group_id="g",
            split="train",
            model="agent",
            served=None,
            step=None,
            engine="openai",
            stream=False,
            status="ok",
            request={"model": "agent", "messages": messages},
            response={
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "Hi! How can I help you?"},
                        "finish_reason": "stop",
                    }
                ]
            },
            latency_ms=1.0,
        )
    )
    asyncio.run(store.close())
    row = pq.read_table(export(settings, tmp_path, "parquet")).to_pylist()[0]
    tokenizer = AutoTokenizer.from_pretrained(resolve_base_model(settings.base_model, tmp_path))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    completion = ids("Hi! How can I help you?<|im_end|>")
    assert row["token_ids"] == ids(prompt) + completion
    assert row["loss_mask"] == [False] * len(ids(prompt)) + [True] * len(completion)
    assert row["old_logprobs"] == [None] * len(row["token_ids"])
    assert row["step"] is None and row["sampled_by_step"] is None
    line = json.loads(export(settings, tmp_path, "openai").read_text())
    validate_fine_tuning_line(line)
    assert line == {"messages": [*messages, {"role": "assistant", "content": "Hi! How can I help you?"}]}


def test_a_sample_the_trainer_cut_to_a_row_is_exported_as_trained(tmp_path):
    # A sample longer than --max-tokens-per-row trains on its first tokens; the export looked
    # for the call whose tokens equal the cut sample, found none, and left the session out.
    settings = trainer_settings(tmp_path, max_tokens_per_row=48)
    recorder = Recorder(settings)
    long_answer = " ".join(["word"] * 80)
    for gid in ("long-a", "long-b"):
        for i, reward in enumerate([1.0, 0.0]):
            recorder.call(f"{gid}-s{i}", gid, f"Question {i}?", f"{long_answer} {i}")
            asyncio.run(recorder.store.set_reward(f"{gid}-s{i}", reward))
        asyncio.run(recorder.store.close_group(gid))
    recorder.close()
    assert run_worker(settings, max_steps=1) == 1

    store = SQLiteStore(settings.db_path)
    groups, calls = load_groups(store, ["long-a", "long-b"])
    batch = build_batch(groups, calls, scale_rewards="group", max_tokens_per_row=48)
    asyncio.run(store.close())
    assert batch.cut == 4
    rows = {r["session_id"]: r for r in pq.read_table(export(settings, tmp_path, "parquet")).to_pylist()}
    assert len(rows) == 4
    for sample in batch.samples:
        row = rows[sample.trajectory_id]
        assert tuple(row["token_ids"]) == sample.token_ids and len(row["token_ids"]) == 48
        assert tuple(row["loss_mask"]) == sample.loss_mask and row["step"] == 1
    lines = export(settings, tmp_path, "openai").read_text().splitlines()
    assert len(lines) == 4
    for line in lines:
        validate_fine_tuning_line(json.loads(line))


def test_sessions_of_a_step_keep_checkpoints_removed_export_the_advantage_they_trained_with(tmp_path):
    """`--scale-rewards none --keep-checkpoints 1`: step 1's checkpoint (and the settings.json beside
    it) is gone by step 3. Its sessions' advantages are still those step 1 trained with, r - mean,
    not a batch rebuilt with the default settings (group scaling: 1.41 for 0.67)."""
    from trainer.worker import TrainerWorker

    settings = trainer_settings(tmp_path, groups_per_step=1, keep_checkpoints=1, scale_rewards="none")
    recorder = Recorder(settings)
    worker = TrainerWorker(settings)
    try:
        worker.start()
        for step in range(3):
            recorder.group(f"g{step}", [1.0, 0.0, 0.0], step=step)
            assert worker.train_once(worker.groups_to_train()) is not None
    finally:
        worker.close()
        recorder.close()
    assert not (settings.checkpoints_dir() / "0001").exists()
    rows = pq.read_table(export(settings, tmp_path, "parquet")).to_pylist()
    assert sorted(r["step"] for r in rows) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    for row in rows:
        assert row["advantage"] == pytest.approx(2 / 3 if row["session_id"].endswith("s0") else -1 / 3)
