"""`--promote canary` with the real trainer on the built-in model: the harness reads
`X-Model-Step` and rewards by the step that answered: SHOUT's rule (the demo's task: the fraction
of capitals), plus `BONUS` for the trained steps up to `GOOD`, less `PENALTY` for later ones. The
canary promotes the good step, rejects the first bad one, and the trainer, restarted, goes on from
the incumbent. The bonus makes "good" a fact of the harness, as the penalty makes "bad": one GRPO
step on one group of 4 may itself score lower than step 0 (0.05 against 0.11, seen in about one
run in ten), and the canary then rightly rejected it. Within a group every session sees one step,
so the bonus shifts no advantage the trainer learns from."""

from __future__ import annotations

import os
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import pytest

from gateway.app import create_app
from gateway.demo import shout
from gateway.promotion.canary import share_of
from gateway.settings import Settings
from tests.helpers import ThreadServer
from trainer.worker import TrainerWorker

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*tie_word_embeddings"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing"),
]

GOOD, BONUS, PENALTY, SHARE, ROLLOUTS = 1, 0.5, 1.0, 0.5, 4


def group(client: httpx.Client, gid: str, seen: list) -> None:
    """One harness group: ROLLOUTS sessions of one SHOUT prompt, each rewarded by the step that answered."""
    for i in range(ROLLOUTS):
        sid = f"{gid}-s{i}"
        response = client.post(
            "/v1/chat/completions",
            headers={"X-Session-Id": sid, "X-Group-Id": gid},
            json={"model": "agent", "messages": shout.messages_for(shout.PROMPTS[0]), "max_tokens": 6},
        )
        assert response.status_code == 200, response.text
        step = int(response.headers["x-model-step"])
        reward = shout.reward(response.json()["choices"][0]["message"]["content"])
        reward += BONUS if 0 < step <= GOOD else -PENALTY if step > GOOD else 0.0
        assert client.post(f"/v1/sessions/{sid}/reward", json={"reward": reward}).status_code == 200
        seen.append((gid, step))
    assert client.post(f"/v1/groups/{gid}/close", json={}).status_code == 200


def scenario(tmp_path, promote: str) -> Settings:
    """The gateway and trainer of both tests: one group a step, the tiny model, a fast poll."""
    return Settings(
        engine="local",
        state_dir=tmp_path,
        poll_interval=0.05,
        default_max_tokens=6,
        max_tokens_per_row=1024,
        promote=promote,
        canary_share=SHARE,
        canary_min_sessions=2 * ROLLOUTS,
        canary_margin=0.3,
        # No watch after a promotion: "good" here only means not penalised, and a real step may
        # score a little below step 0 (within the margin it was promoted by), which the watch,
        # with no margin, then rolls back (seen once in CI). tests/test_canary.py tests the watch.
        watch_sessions=0,
        max_staleness=20,
        groups_per_step=1,
        lora_rank=4,
        lora_alpha=8,
        learning_rate=1e-2,
    )


def test_canary_with_the_trainer_promotes_the_good_step_rejects_the_bad_and_goes_on_from_the_incumbent(tmp_path):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    settings = scenario(tmp_path, "canary")
    worker = TrainerWorker(settings)
    worker.start()  # step 0
    stop = threading.Event()
    trainer = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    seen: list[tuple[str, int]] = []
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        trainer.start()
        for g in range(200):  # a hang guard, not a speed requirement
            rows = {r["step"]: r for r in client.get("/v1/training/steps").json()["data"]}
            if rows.get(2, {}).get("state", "candidate") != "candidate":
                break
            group(client, f"g{g}", seen)
        stop.set()
        trainer.join(120)
        rows = {r["step"]: r for r in client.get("/v1/training/steps").json()["data"]}
        assert rows[1]["state"] == "promoted" and rows[1]["parent"] == 0
        assert rows[2]["state"] == "rejected" and rows[2]["parent"] == 1
        assert rows[2]["decision"]["reason"] == "the incumbent is better"
        # The trainer may already have published step 3 (from the incumbent: parent 1) as the next
        # candidate; a group the share sends to the incumbent sees step 1 either way.
        assert all(row["parent"] == 1 for step, row in rows.items() if step > 2)
        after_gid = next(f"after-{i}" for i in range(1000) if share_of(f"group:after-{i}") >= SHARE)
        after: list[tuple[str, int]] = []
        group(client, after_gid, after)
    worker.close()
    assert {step for _, step in after} == {1}, "NAME serves the incumbent after the rejection"
    # A group's sessions all saw one step; the candidate answered exactly the groups its share hashes to.
    steps_of: dict[str, set[int]] = {}
    for gid, step in seen:
        steps_of.setdefault(gid, set()).add(step)
    assert all(len(steps) == 1 for steps in steps_of.values())
    on_bad = {gid for gid, steps in steps_of.items() if steps == {2}}
    assert on_bad and all(share_of(f"group:{gid}") < SHARE for gid in on_bad)
    # The incumbent keeps every session outside the share: no group hashed at or above it met step 2.
    outside = [gid for gid in steps_of if share_of(f"group:{gid}") >= SHARE]
    assert outside and not any(2 in steps_of[gid] for gid in outside)
    print(
        f"{len(seen)} sessions; on the rejected candidate: {ROLLOUTS * len(on_bad)}; "
        f"outside the share: {ROLLOUTS * len(outside)}"
    )

    restarted = TrainerWorker(settings)
    restarted.start()
    try:
        lora = {k: v for k, v in get_peft_model_state_dict(restarted.backend.model).items()}
        incumbent = load_file(settings.checkpoints_dir() / "0001" / "adapter_model.safetensors")
        rejected = load_file(settings.checkpoints_dir() / "0002" / "adapter_model.safetensors")
        assert set(lora) == set(incumbent)
        assert all(lora[k].equal(incumbent[k]) for k in lora), "the restarted trainer starts from the incumbent"
        assert not all(lora[k].equal(rejected[k]) for k in lora)
    finally:
        restarted.close()


def test_the_control_under_always_serves_the_bad_step_to_everyone(tmp_path):
    """The same scenario with `--promote always`: once step 2 exists, every session meets a bad step."""
    settings = scenario(tmp_path, "always")
    worker = TrainerWorker(settings)
    worker.start()
    stop = threading.Event()
    trainer = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    after: list[tuple[str, int]] = []
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        trainer.start()
        for g in range(200):  # a hang guard, not a speed requirement
            steps = {r["step"] for r in client.get("/v1/training/steps").json()["data"]}
            if 2 in steps:
                served = int(
                    client.post(
                        "/v1/chat/completions",
                        json={"model": "agent", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
                    ).headers["x-model-step"]
                )
                if served >= 2:
                    break
            group(client, f"g{g}", [])
        stop.set()  # no step after this one is needed: the control is about who meets step 2+
        for g in range(4):
            group(client, f"after-{g}", after)
        trainer.join(120)
        rows = client.get("/v1/training/steps").json()["data"]
    worker.close()
    assert {r["state"] for r in rows} <= {"promoted", "superseded"}  # nothing is ever held back
    # Groups on both sides of the canary's share: under `always` each of them meets a bad step.
    assert {share_of(f"group:{gid}") < SHARE for gid, _ in after} == {True, False}
    assert all(step > GOOD for _, step in after), after
