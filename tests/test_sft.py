"""`rlproxy train --objective sft`: which tokens a supervised sample trains (checked by hand on
the real chat template), the sessions it skips rather than train wrongly, the selection it
shares with `rlproxy export`, its steps and snapshot, and GRPO after it (`--init-from`, or the
same run going on)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from transformers import AutoTokenizer

from gateway.cli import main
from gateway.models.tiny import ensure_tiny_model
from gateway.store import CallRecord
from gateway.store.sqlite import SQLiteStore
from tests.helpers_trainer import Recorder, trainer_settings
from trainer import checkpoints as ckpts
from trainer.render import ChatTemplateRenderer
from trainer.sft.samples import DROPPED_PARTS, SPECIAL_TEXT, TEMPLATE_REFUSED, TOOL_CALL_LOST, session_samples

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "look a number up",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]
SYSTEM = {"role": "system", "content": "You look numbers up."}
USER = {"role": "user", "content": "What is 7?"}
TOOL_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"x": 7}'}}],
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "7 is lucky"}
ANSWER = {"role": "assistant", "content": "Seven is lucky."}


def teacher_call(n: int, messages: list[dict], reply: dict) -> dict:
    """A call as the openai engine records a hosted model's answer: no token ids."""
    return {
        "id": f"c{n}",
        "status": "ok",
        "http_status": 200,
        "request": {"model": "teacher", "messages": messages, "tools": TOOLS},
        "response": {"choices": [{"index": 0, "message": reply, "finish_reason": "stop"}]},
    }


TOOL_SESSION = [
    teacher_call(1, [SYSTEM, USER], TOOL_CALL),
    teacher_call(2, [SYSTEM, USER, TOOL_CALL, TOOL_RESULT], ANSWER),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(ensure_tiny_model(tmp_path_factory.mktemp("tiny")))


def trained_text(tokenizer, sample) -> list[str]:
    """The runs of trained tokens of a sample, as text."""
    runs, current = [], []
    for token, trained in zip(sample.token_ids, sample.loss_mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_an_sft_sample_trains_the_assistant_turns_only_as_the_students_template_writes_them(tokenizer):
    found = session_samples("s", TOOL_SESSION, ChatTemplateRenderer(tokenizer))
    assert found.skipped is None
    (sample,) = found.samples
    # By hand, from Qwen2.5's template: the tool call in its <tool_call> tags and the answer, each
    # with the <|im_end|> the model samples to stop; system, user, tool result and the
    # "<|im_start|>assistant\n" headers are context.
    assert trained_text(tokenizer, sample) == [
        '<tool_call>\n{"name": "lookup", "arguments": {"x": 7}}\n</tool_call><|im_end|>',
        "Seven is lucky.<|im_end|>",
    ]
    whole = tokenizer.decode(list(sample.token_ids))
    assert whole == tokenizer.apply_chat_template(
        [
            SYSTEM,
            USER,
            {
                **TOOL_CALL,
                "tool_calls": [{**TOOL_CALL["tool_calls"][0], "function": {"name": "lookup", "arguments": {"x": 7}}}],
            },
            TOOL_RESULT,
            ANSWER,
        ],
        tools=TOOLS,
        tokenize=False,
    ).rstrip("\n")
    assert "<tool_response>\n7 is lucky\n</tool_response>" in whole  # the tool's turn, masked


def test_a_session_whose_rendering_is_ambiguous_is_skipped_with_the_reason(tokenizer):
    render = ChatTemplateRenderer(tokenizer)
    image = {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url"}]}
    found = session_samples("img", [teacher_call(1, [SYSTEM, image], ANSWER)], render)
    assert found.samples == () and found.skipped == DROPPED_PARTS.format(kinds="image_url")
    # a template without tools cannot write the tool call
    plain = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    found = session_samples("tools", TOOL_SESSION, ChatTemplateRenderer(plain))
    assert found.skipped == TOOL_CALL_LOST.format(name="lookup")


def test_a_session_the_template_refuses_or_with_a_special_tokens_text_is_skipped_not_the_run(tokenizer):
    # A student whose template refuses a system message (Gemma's): that session is skipped with
    # the template's words, the run goes on (raised, it ended `train --objective sft`).
    strict = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    strict.chat_template = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + tokenizer.chat_template
    )
    found = session_samples("sys", TOOL_SESSION, ChatTemplateRenderer(strict))
    assert found.samples == () and found.skipped == TEMPLATE_REFUSED.format(error="System role not supported")
    # A teacher's reply that writes "<|im_end|>" as text trains as that text, not as the student's
    # end of turn mid-reply (gateway.models.special_text)...
    echo = {"role": "assistant", "content": "Qwen ends a turn with <|im_end|> and goes on."}
    found = session_samples("echo", [teacher_call(1, [SYSTEM, USER], echo)], ChatTemplateRenderer(tokenizer))
    (sample,) = found.samples
    trained = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert trained.count(eot) == 1 and trained[-1] == eot
    assert trained_text(tokenizer, sample) == ["Qwen ends a turn with <|im_end|> and goes on.<|im_end|>"]
    # ...and where the template cuts such a text, its place is unknown: the session is skipped
    cutting = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    cutting.chat_template = tokenizer.chat_template.replace("message.content or ''", "(message.content or '')[:34]")
    found = session_samples("cut", [teacher_call(1, [SYSTEM, USER], echo)], ChatTemplateRenderer(cutting))
    assert found.samples == () and found.skipped == SPECIAL_TEXT.format(token="<|im_end|>")


# Qwen3's way, in small: an assistant turn's <think>...</think> is written only while it is the
# turn being rendered; in the history of a later call it is dropped.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}{{ (m.content or '').split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m.content or '' }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_history_the_template_rewrote_splits_the_session_into_samples_instead_of_skipping_it(tokenizer):
    thinking = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    thinking.chat_template = THINKING_TEMPLATE
    first = {"role": "assistant", "content": "<think>7 is in the table.</think>\n\nSeven."}
    second = {"role": "assistant", "content": "<think>Add one.</think>\n\nEight."}
    more = {"role": "user", "content": "And plus one?"}
    calls = [teacher_call(1, [SYSTEM, USER], first), teacher_call(2, [SYSTEM, USER, first, more], second)]
    found = session_samples("think", calls, ChatTemplateRenderer(thinking))
    # The second prompt does not extend the first sample (its thinking is gone): a new sample
    # starts there, counted as a split; each reply is trained once, thinking included.
    assert found.skipped is None and found.splits == 1
    one, two = found.samples
    assert trained_text(thinking, one) == ["<think>7 is in the table.</think>\n\nSeven.<|im_end|>"]
    assert trained_text(thinking, two) == ["<think>Add one.</think>\n\nEight.<|im_end|>"]
    context = thinking.decode([t for t, trained in zip(two.token_ids, two.loss_mask, strict=True) if not trained])
    assert context.endswith(
        "<|im_start|>assistant\nSeven.<|im_end|>\n<|im_start|>user\nAnd plus one?<|im_end|>\n<|im_start|>assistant\n"
    )
    # an agent that rewrote an earlier answer splits the same way
    rewritten = {"role": "assistant", "content": "Eight."}
    render = ChatTemplateRenderer(tokenizer)
    calls = [teacher_call(1, [SYSTEM, USER], ANSWER), teacher_call(2, [SYSTEM, USER, rewritten, USER], ANSWER)]
    found = session_samples("rw", calls, render)
    assert found.skipped is None and found.splits == 1
    assert [trained_text(tokenizer, s) for s in found.samples] == [["Seven is lucky.<|im_end|>"]] * 2


def record(store, session_id: str, *, model: str, group: str | None, created_at: float, split: str = "train"):
    store.record_call_sync(
        CallRecord(
            id=f"{session_id}-1",
            session_id=session_id,
            group_id=group,
            split=split,
            model=model,
            served=model,
            step=None,
            engine="openai",
            stream=False,
            status="ok",
            request={"model": model, "messages": [SYSTEM, USER], "tools": TOOLS},
            response={"choices": [{"index": 0, "message": ANSWER, "finish_reason": "stop"}]},
            latency_ms=1.0,
            created_at=created_at,
        )
    )


@pytest.fixture
def teacher_store(tmp_path):
    """Sessions of a teacher and of another model, before and after a moment, well and badly rewarded."""
    settings = trainer_settings(tmp_path / "state")
    settings.state_dir.mkdir(parents=True)
    store = SQLiteStore(settings.db_path)
    moment = time.time() - 1000
    for i in range(8):
        model = "teacher" if i % 4 else "other"
        record(store, f"t{i}", model=model, group=f"g{i // 2}", created_at=moment + (i - 2) * 100)
        asyncio.run(store.set_reward(f"t{i}", 1.0 if i % 2 else 0.5))
    record(store, "v0", model="teacher", group=None, created_at=moment + 500, split="val")
    asyncio.run(store.set_reward("v0", 1.0))
    asyncio.run(store.close())
    return settings, moment


def flags(settings, moment) -> list[str]:
    return ["--state-dir", str(settings.state_dir), "--model", "teacher", "--since", str(moment), "--min-reward", "0.8"]


def test_export_and_sft_select_the_same_sessions(teacher_store, tmp_path, capsys):
    settings, moment = teacher_store
    out = tmp_path / "export.jsonl"
    assert main(["export", *flags(settings, moment), "--output", str(out)]) == 0
    exported = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert exported == ["t3", "t5", "t7", "v0"]  # teacher, at or after the moment, rewarded >= 0.8
    train = ["train", *flags(settings, moment), "--objective", "sft", "--sft-sessions-per-step", "2"]
    train += ["--lora-rank", "4", "--lora-alpha", "8", "--max-tokens-per-row", "512"]
    assert main(train) == 0
    state = ckpts.latest_checkpoint(settings.checkpoints_dir()).state()
    assert sorted(state["sft"]["train"]) + state["sft"]["val"] == exported
    steps = SQLiteStore(settings.db_path).steps("agent")
    assert [s["step"] for s in steps] == [0, 1, 2] and {s["metrics"]["objective"] for s in steps[1:]} == {"sft"}
    assert all(s["metrics"]["val_loss"] > 0 and s["metrics"]["loss"] > 0 for s in steps[1:])
    # the selected sessions' groups are never taken by GRPO afterwards
    store = SQLiteStore(settings.db_path)
    assert store.get_group("g1")["skipped"].startswith("distilled") and store.get_group("g0")["skipped"] is None
    # a bad time says what to give
    with pytest.raises(SystemExit) as exited:
        main(["export", "--state-dir", str(settings.state_dir), "--since", "yesterday"])
    assert exited.value.code == 2 and "2026-11-25T14:00" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--epochs", "--sft-sessions-per-step"])
def test_a_zero_count_is_refused_before_the_model_loads(tmp_path, capsys, flag):
    # It was refused only after the trainer had loaded the model and saved a step 0 in the state dir.
    with pytest.raises(SystemExit) as exited:
        main(["train", "--objective", "sft", "--state-dir", str(tmp_path), flag, "0"])
    assert exited.value.code == 2 and f"{flag}: '0' must be 1 or more" in capsys.readouterr().err
    assert not (tmp_path / "models").exists()


def test_sft_resumes_its_snapshot_and_grpo_goes_on_from_it_or_a_new_run_starts_from_it(tmp_path):
    settings = trainer_settings(tmp_path, model_name="student")
    recorder = Recorder(settings)
    for i in range(4):
        recorder.call(f"d{i}", f"dg{i}", f"What is {i}?", "It is 42.")
    recorder.group("rl", [1.0, 0.0])
    recorder.close()
    base = ["train", "--state-dir", str(tmp_path), "--model-name", "student", "--lora-rank", "4"]
    base += ["--lora-alpha", "8", "--max-tokens-per-row", "256", "--learning-rate", "0.01"]
    sft = [*base, "--objective", "sft", "--group", "dg0", "--group", "dg1", "--group", "dg2", "--group", "dg3"]
    sft += ["--sft-sessions-per-step", "1", "--epochs", "2"]
    assert main([*sft, "--max-steps", "3"]) == 0
    root = settings.checkpoints_dir()
    first = ckpts.latest_checkpoint(root).state()["sft"]
    assert (first["epoch"], first["position"]) == (0, 3)
    # a restart goes on with the same snapshot (a session recorded since is not added)
    recorder = Recorder(settings)
    recorder.call("late", "dg0", "What is 9?", "It is 42.")
    recorder.close()
    assert main(sft) == 0
    last = ckpts.latest_checkpoint(root)
    assert last.step == 8 and last.state()["sft"]["train"] == first["train"] and "late" not in first["train"]
    assert last.state()["sft"]["epoch"] == 2
    # GRPO goes on from the newest step, whatever its objective, with a fresh optimizer
    assert main([*base, "--max-steps", "1", "--groups-per-step", "1", "--max-staleness", "100"]) == 0
    steps = SQLiteStore(settings.db_path).steps("student")
    assert steps[-1]["step"] == 9 and steps[-1]["groups"] == ["rl"] and "objective" not in steps[-1]["metrics"]
    # a new run starts from any step of it: the adapter as its step 0, not the optimizer
    other = [*base[:3], "--model-name", "fresh", *base[5:], "--max-steps", "0"]
    assert main([*other, "--init-from", "student@4"]) == 0
    seeded = settings.checkpoints_dir("fresh") / "0000"
    source = root / "0004"
    assert (seeded / "adapter_model.safetensors").read_bytes() == (source / "adapter_model.safetensors").read_bytes()
    assert json.loads((seeded / "trainer_state.json").read_text())["metrics"] == {"init_from": "student@4"}


def test_init_from_is_refused_for_another_base_model_or_adapter_shape_or_an_unknown_step(tmp_path, capsys):
    base = ["train", "--state-dir", str(tmp_path), "--lora-alpha", "8", "--max-steps", "0"]
    assert main([*base, "--model-name", "a", "--lora-rank", "4"]) == 0
    assert main([*base, "--model-name", "b", "--lora-rank", "8", "--init-from", "a@0"]) == 2
    assert "lora_rank 4 (here 8)" in capsys.readouterr().err
    assert main([*base, "--model-name", "b", "--lora-rank", "4", "--init-from", "a@3"]) == 2
    assert "no step 3 of 'a' (steps: 0)" in capsys.readouterr().err
    assert main([*base, "--model-name", "b", "--lora-rank", "4", "--init-from", "a"]) == 2
    assert "NAME@STEP" in capsys.readouterr().err
    assert main([*base, "--model-name", "b", "--lora-rank", "4", "--init-from", "a@²"]) == 2  # not a traceback
    assert "NAME@STEP" in capsys.readouterr().err
    # the same rule keeps a run from resuming under another shape
    assert main([*base, "--model-name", "a", "--lora-rank", "8"]) == 2
    assert "were trained with lora_rank 4 (here 8); keep those settings" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--group", "g1"], "--group selects"),
        (["--rewarded", "--min-reward", "0.5"], "--rewarded and --min-reward select"),
    ],
)
def test_a_selection_flag_without_objective_sft_is_refused_before_anything_loads(tmp_path, capsys, flags, said):
    # GRPO trains every ready group: `--group g1` there trained all the others too, and said nothing.
    assert main(["train", "--state-dir", str(tmp_path / "state"), *flags]) == 2
    err = capsys.readouterr().err
    assert f"rlproxy train: {said} the sessions of `--objective sft`" in err, err
    assert not (tmp_path / "state" / "models").exists()  # no model loaded, no step 0 saved


def test_keep_checkpoints_bounds_an_sft_run_too(tmp_path):
    """`--keep-checkpoints 2` holds for `train --objective sft` as for GRPO: the newest two stay."""
    settings = trainer_settings(tmp_path, model_name="student")
    recorder = Recorder(settings)
    for i in range(4):
        recorder.call(f"d{i}", f"dg{i}", f"What is {i}?", "It is 42.")
    recorder.close()
    argv = ["train", "--state-dir", str(tmp_path), "--model-name", "student", "--lora-rank", "4", "--lora-alpha", "8"]
    argv += ["--max-tokens-per-row", "256", "--objective", "sft", "--sft-sessions-per-step", "1", "--epochs", "1"]
    argv += [arg for i in range(4) for arg in ("--group", f"dg{i}")]
    assert main([*argv, "--keep-checkpoints", "2"]) == 0
    root = settings.checkpoints_dir()
    assert [c.step for c in ckpts.list_checkpoints(root)] == [3, 4]
    assert [row["step"] for row in SQLiteStore(settings.db_path).steps("student")] == [0, 1, 2, 3, 4]


def test_sft_trains_no_position_past_the_base_models_context(tmp_path):
    # A teacher's session can be longer than the student reads: this rotary student states 128
    # positions, rows take 512 tokens. The 380-token session trained whole, past the context the
    # student was configured for and is served at; it is left out with the reason instead.
    from tests.helpers_trainer import tiny_qwen2_reading

    student = tiny_qwen2_reading(tmp_path, 128)
    settings = trainer_settings(tmp_path / "state", base_model=str(student))
    settings.state_dir.mkdir(parents=True)
    store = SQLiteStore(settings.db_path)
    for session, question in (("short", "What is 7?"), ("long", "What is 7? " * 60)):
        store.record_call_sync(
            CallRecord(
                id=f"{session}-1",
                session_id=session,
                group_id=None,
                split="train",
                model="teacher",
                served="teacher",
                step=None,
                engine="openai",
                stream=False,
                status="ok",
                request={"model": "teacher", "messages": [{"role": "user", "content": question}]},
                response={"choices": [{"index": 0, "message": ANSWER, "finish_reason": "stop"}]},
                latency_ms=1.0,
                created_at=time.time(),
            )
        )
    asyncio.run(store.close())
    argv = ["train", "--state-dir", str(settings.state_dir), "--base-model", str(student), "--model", "teacher"]
    argv += ["--objective", "sft", "--sft-sessions-per-step", "2", "--epochs", "1", "--max-tokens-per-row", "512"]
    assert main([*argv, "--lora-rank", "4", "--lora-alpha", "8"]) == 0
    sft = ckpts.latest_checkpoint(settings.checkpoints_dir()).state()["sft"]
    assert sorted(sft["train"]) == ["long", "short"]
    reason = "longer than a row of 128 tokens (the base model's context) before its first reply"
    assert sft["skipped"] == {"long": reason}
    (step,) = SQLiteStore(settings.db_path).steps("agent")[1:]
    assert step["metrics"]["sessions"] == 1 and 0 < step["metrics"]["tokens"] <= 128
