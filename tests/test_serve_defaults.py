"""`rlproxy serve` with its defaults on the built-in model learns a task nothing else in the
suite uses, and serves every step it trained.

The task (VOWELS: reward = the fraction of the reply's characters that are a, e, i, o or u) is
played through the real gateway with the official `openai` client, rewards and group
closes over HTTP, and the trainer that `--trainer auto` starts beside the gateway. No
training flag is given: the settings tuned for the built-in model (`gateway.models.tuning`) must
be in force, logged at start and saved next to every checkpoint.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import openai
import pytest

from tests.helpers import gateway_process

PROMPTS = ("Sing a vowel.", "Say aaah.", "What sound does an owl make?", "Reply with vowels only.")
ROLLOUTS = 8
GROUPS_PER_STEP = 4  # the built-in model's tuned default
STEPS = 24
# Groups in a row whose rollouts all scored the same: the policy has become deterministic (on the
# built-in model it settles on a reply such as "ureureure", 0.67, within about 13 steps) and no
# group will train again, so the run ends there.
FLAT_GROUPS_TO_STOP = 16
# Tried first: LOWERCASE (a-z) starts at 0.61, too near its ceiling (+0.15 in 12 steps); DIGITS
# starts at 0: no group has a reward spread, so nothing trains.
MARGIN = 0.2  # one run measured 0.263 -> 0.521 after 20 steps


def reward(text: str | None) -> float:
    return sum(ch in "aeiou" for ch in text) / len(text) if text else 0.0


def play_group(
    client: openai.OpenAI, http: httpx.Client, split: str, prompt: str, model: str = "agent"
) -> tuple[str, list[float]]:
    group = f"{split}-{uuid.uuid4().hex[:8]}"
    rewards = []
    for i in range(ROLLOUTS):
        session = f"{group}-{i}"
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=6,
            temperature=1.0,
            extra_headers={"X-Session-Id": session, "X-Group-Id": group, "X-Split": split},
        )
        rewards.append(reward(reply.choices[0].message.content))
        http.post(f"/v1/sessions/{session}/reward", json={"reward": rewards[-1]}).raise_for_status()
    http.post(f"/v1/groups/{group}/close", json={}).raise_for_status()
    return group, rewards


def evaluate(client, http, model: str) -> float:
    rewards = [r for prompt in PROMPTS for r in play_group(client, http, "val", prompt, model)[1]]
    return sum(rewards) / len(rewards)


def served_step(http: httpx.Client) -> int | None:
    return http.get("/healthz").json().get("step")


@pytest.mark.timeout(600)
def test_serve_defaults_learn_a_new_task_and_every_step_stays_servable(tmp_path):
    state = tmp_path / "state"
    with gateway_process(
        ["--state-dir", str(state), "--poll-interval", "0.2", "--log-level", "info"], env={"RLPROXY_TORCH_THREADS": "1"}
    ) as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        http = httpx.Client(base_url=url, timeout=60)
        deadline = time.monotonic() + 600
        while served_step(http) is None:
            assert time.monotonic() < deadline, "step 0 never served"
            time.sleep(0.2)
        baseline = evaluate(client, http, "agent@0")
        played = flat_in_a_row = 0
        pending: list[str] = []  # train groups closed but neither trained nor skipped yet
        while (served_step(http) or 0) < STEPS and flat_in_a_row < FLAT_GROUPS_TO_STOP:
            assert time.monotonic() < deadline, f"only {served_step(http)} steps trained"
            start = served_step(http)
            # As the demo does: keep groups_per_step groups waiting (a group without a reward
            # spread is skipped and replaced), then wait for the step they make: on-policy.
            while len(pending) < GROUPS_PER_STEP and flat_in_a_row < FLAT_GROUPS_TO_STOP:
                group, rewards = play_group(client, http, "train", PROMPTS[played % len(PROMPTS)])
                pending.append(group)
                flat_in_a_row = flat_in_a_row + 1 if max(rewards) - min(rewards) < 1e-9 else 0
                played += 1
            while served_step(http) == start and time.monotonic() < deadline:
                states = [http.get(f"/v1/groups/{g}").json() for g in pending]
                pending = [g["id"] for g in states if g.get("trained_step") is None and not g.get("skipped")]
                if len(pending) < GROUPS_PER_STEP and served_step(http) == start:
                    break  # some were skipped: play more
                time.sleep(0.2)
            if served_step(http) != start:
                states = [http.get(f"/v1/groups/{g}").json() for g in pending]
                pending = [g["id"] for g in states if g.get("trained_step") is None and not g.get("skipped")]
        final = evaluate(client, http, "agent")
        # Ten and more steps on, the untrained step still answers (loaded on demand).
        step0 = client.chat.completions.with_raw_response.create(
            model="agent@0", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert step0.headers["x-model-step"] == "0"
        http.close()
        client.close()

    print(f"VOWELS through rlproxy serve defaults: {baseline:.3f} -> {final:.3f}")
    assert final >= baseline + MARGIN, f"reward rose only {baseline:.3f} -> {final:.3f}"
    saved = json.loads((state / "models" / "agent" / "checkpoints" / "0001" / "settings.json").read_text())
    assert saved["learning_rate"] == 1e-2 and saved["lora_rank"] == 8  # the built-in model's tuning
