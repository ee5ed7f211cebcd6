"""The json demo task: its reward's tiers, by hand, and a val set kept apart from training."""

import random

import pytest

from gateway.demo import load_task

json_task = load_task("json")


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ('{"answer": "mice"}', 1.0),
        (' {"answer":"Mice"}\n', 1.0),  # case and surrounding whitespace aside
        ('```json\n{"answer": "mice"}\n```', 0.5),  # right, but in a code fence
        ('{"answer": "mice"} I hope this helps!', 0.5),  # right, with trailing text
        ('{"answer": "mice", "singular": "mouse"}', 0.5),  # right, with another key
        ('{"answer": "mouses"}', 0.25),  # valid JSON, wrong plural
        ('The plural is {"plural": "mice"}', 0.25),  # a JSON object without the answer key
        ('{"answer": "mi', 0.0),  # cut off by max_tokens: no object
        ("The plural of mouse is mice.", 0.0),
        ('["mice"]', 0.0),  # JSON, but no object
        (None, 0.0),
    ],
)
def test_the_reward_is_graded_and_only_the_exact_object_earns_one(reply, expected):
    assert json_task.reward(reply, "mice") == expected


def test_the_val_nouns_are_never_drawn_for_training():
    val = json_task.held_out(64)
    assert len(set(val)) == 64
    rng = random.Random(0)
    trained = {json_task.sample(rng) for _ in range(5000)}
    assert trained and not trained & set(val)
    assert set(json_task.held_out(128)) == set(val)  # more val rollouts cycle over the same 64


def test_the_prompt_shows_the_format_once_on_another_question():
    messages = json_task.messages_for("mouse")
    assert messages[-1] == {"role": "user", "content": 'What is the plural of "mouse"?'}
    assert messages[-2] == {"role": "assistant", "content": '{"answer": "Paris"}'}


def test_the_val_set_is_played_greedily_unless_told_otherwise():
    from gateway.cli import build_parser
    from gateway.demo.options import options_from_args
    from gateway.errors import ConfigError

    def options(*argv: str):
        return options_from_args(build_parser().parse_args(["demo", *argv]))

    assert options("--task", "json").eval_temperature == 0.0
    assert options("--task", "json", "--eval-temperature", "1").eval_temperature == 1.0
    assert options("--task", "shout").eval_temperature == 1.0  # the other tasks keep sampling
    with pytest.raises(ConfigError, match=r"--eval-temperature must be in \[0, 2\]"):
        options("--eval-temperature", "-1")
