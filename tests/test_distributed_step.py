"""A step on two gloo processes gives the adapter one process gives (`rlproxy train --nproc 2`).

Two real ranks (torch.distributed, gloo, CPU) train the tiny model: rank 0 drives the step as the
worker does (train, save), rank 1 follows its announcements (`trainer.follower`). The same step on
one process, in this test's process, is the reference: the adapter and the AdamW moments each rank
pair writes must equal it to 1e-5, for DDP and for FSDP2 (`--shard full`), for grpo, dr_grpo and dapo
(whose normalisers count the whole batch, not a rank's share), with beta > 0 under FSDP2, with
--reward-kl sharpened (each rank's KL and log pi_ref sums added before the rewards are shaped), for
an SFT step, after loading a checkpoint one process wrote, and for a step whose loss is not finite
on one rank only (refused on both, nothing changed).
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from gateway.settings import Settings
from tests.helpers import free_port
from trainer.backends.base import ADAPTER_FILES, OPTIMIZER_FILE
from trainer.types import Sample

# AdamW's first update of an entry is lr * g / (|g| + eps): for a gradient entry near eps the float32
# rounding of a sum taken in another order is amplified up to lr itself. At the tiny model's 1e-2
# that is ~1e-5 on a few entries whichever way the batch is cut; at 1e-3, ~1e-6: the bound below then
# tests the reduction, not the rounding. The moments (exp_avg = 0.1 g) are compared as they are.
BASE = dict(lora_rank=4, lora_alpha=8, learning_rate=1e-3, max_tokens_per_row=64, seed=3)

SCENARIOS = {
    "ddp-grpo": dict(shard="none", loss_type="grpo"),
    "ddp-dr_grpo": dict(shard="none", loss_type="dr_grpo", max_tokens_norm=40),
    "full-dapo-beta": dict(shard="full", loss_type="dapo", beta=0.1),
    "ddp-reward-kl": dict(shard="none", loss_type="grpo", reward_kl=0.05, reward_kl_sharpen=1.5),
    "full-grpo-two-passes": dict(shard="full", loss_type="grpo", epochs_per_step=2),
    "full-grpo-checkpointing": dict(shard="full", loss_type="grpo", gradient_checkpointing=True),
    "ddp-sft": dict(shard="none", objective="sft"),
    "full-sft": dict(shard="full", objective="sft"),
    "full-resume": dict(shard="full", loss_type="grpo", resume=True),
    "ddp-not-finite": dict(shard="none", loss_type="grpo", poison=True),
    "full-not-finite": dict(shard="full", loss_type="grpo", poison=True),
}


REWARDS = {"t0": 1.0, "t1": 0.0, "t2": 0.5, "t3": 0.25, "t4": 0.75}  # what --reward-kl shapes


def batch() -> list[Sample]:
    """Seven samples of uneven lengths (9-41 tokens), two trajectories of two samples each (a
    multi-turn session's calls), recorded behaviour logprobs, advantages of both signs."""
    rng = random.Random(7)
    samples = []
    lengths = [41, 9, 23, 17, 33, 12, 28]
    trajectories = ["t0", "t1", "t0", "t2", "t3", "t3", "t4"]
    for i, (n, trajectory) in enumerate(zip(lengths, trajectories, strict=True)):
        prompt = n // 3
        advantage = rng.choice([-1.3, -0.4, 0.6, 1.1])
        samples.append(
            Sample(
                token_ids=tuple(rng.randrange(3, 200) for _ in range(n)),
                loss_mask=(False,) * prompt + (True,) * (n - prompt),
                old_logprobs=(math.nan,) * prompt + tuple(-rng.uniform(0.5, 4.0) for _ in range(n - prompt)),
                advantage=advantage,
                trajectory_id=trajectory,
                group_id=f"g{i % 2}",
                reward=REWARDS[trajectory],
            )
        )
    return samples


def settings_for(state_dir: Path, scenario: str) -> Settings:
    values = {k: v for k, v in SCENARIOS[scenario].items() if k not in ("objective", "resume", "poison")}
    return Settings(state_dir=state_dir, **BASE, **values)


def poison(backend) -> None:
    """This process's policy logprobs become NaN: its loss is not finite (the other rank's is)."""
    forward = backend.token_logprobs
    backend.token_logprobs = lambda row: forward(row) * math.nan


def run_step(backend, scenario: str, settings: Settings, out: Path, start_from: Path | None) -> None:
    """What rank 0 (or the one process) does: load, train one step, save."""
    from trainer.sft.step import sft_step
    from trainer.step import NonFiniteStep, train_step

    options = SCENARIOS[scenario]
    if start_from is not None:
        backend.load(start_from)
    samples = batch()
    out.mkdir(parents=True, exist_ok=True)
    try:
        if options.get("objective") == "sft":
            sft_step(backend, samples, settings)
        else:
            train_step(backend, samples, settings, token_budget=None)
    except NonFiniteStep as exc:
        (out / "refused.txt").write_text(str(exc))
    backend.save(out)


def rank_main(rank: int, port: int, state_dir: str, results: str, start_from: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    from trainer.backends.peft import PeftBackend
    from trainer.distributed.team import join
    from trainer.follower import follow

    team = None
    for scenario in SCENARIOS:
        settings = settings_for(Path(state_dir), scenario)
        team = team or join(settings)
        assert team is not None
        team.shard = settings.shard
        torch.manual_seed(settings.seed)
        backend = PeftBackend(settings)
        backend.attach_team(team)
        if rank == 1 and SCENARIOS[scenario].get("poison"):
            poison(backend)
        if rank == 0:
            resume = Path(start_from) if SCENARIOS[scenario].get("resume") else None
            run_step(backend, scenario, settings, Path(results) / scenario, resume)
            team.announce("stop")
        else:
            follow(backend, settings)
    team.close()


def assert_same_checkpoint(got: Path, want: Path) -> None:
    got_weights, want_weights = load_file(got / ADAPTER_FILES[1]), load_file(want / ADAPTER_FILES[1])
    assert got_weights.keys() == want_weights.keys()
    for key in want_weights:
        torch.testing.assert_close(got_weights[key], want_weights[key], atol=1e-5, rtol=0, msg=key)
    got_state = torch.load(got / OPTIMIZER_FILE, weights_only=True)
    want_state = torch.load(want / OPTIMIZER_FILE, weights_only=True)
    assert got_state["state"].keys() == want_state["state"].keys()
    for index, values in want_state["state"].items():
        for name, value in values.items():
            torch.testing.assert_close(got_state["state"][index][name], value, atol=1e-5, rtol=0, msg=f"{index}.{name}")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every scenario on one process (here) and on two (spawned once for all of them)."""
    from trainer.backends.peft import PeftBackend

    root = tmp_path_factory.mktemp("distributed")
    state_dir = root / "state"
    start_from = root / "one-process-step"
    # A checkpoint one process trained, for the resume scenario to start both runs from.
    settings = settings_for(state_dir, "ddp-grpo")
    torch.manual_seed(settings.seed)
    run_step(PeftBackend(settings), "ddp-grpo", settings, start_from, None)
    alone = root / "one"
    for scenario in SCENARIOS:
        settings = settings_for(state_dir, scenario)
        torch.manual_seed(settings.seed)
        resume = start_from if SCENARIOS[scenario].get("resume") else None
        backend = PeftBackend(settings)
        if SCENARIOS[scenario].get("poison"):
            poison(backend)
        run_step(backend, scenario, settings, alone / scenario, resume)
    together = root / "two"
    mp.start_processes(
        rank_main, args=(free_port(), str(state_dir), str(together), str(start_from)), nprocs=2, start_method="spawn"
    )
    return alone, together


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if not SCENARIOS[s].get("poison")])
def test_two_ranks_write_the_adapter_one_process_writes(two_ranks, scenario):
    alone, together = two_ranks
    assert not (together / scenario / "refused.txt").exists()
    assert_same_checkpoint(together / scenario, alone / scenario)


def test_the_step_trained_something(two_ranks):
    """The comparisons above would pass for a step that changed nothing: this one did."""
    alone, _ = two_ranks
    trained = load_file(alone / "ddp-grpo" / ADAPTER_FILES[1])
    assert any(key.endswith("lora_B.weight") and value.abs().max() > 1e-4 for key, value in trained.items())


@pytest.mark.parametrize("scenario", ["ddp-not-finite", "full-not-finite"])
def test_a_loss_not_finite_on_one_rank_stops_the_step_on_both(two_ranks, scenario):
    alone, together = two_ranks
    reason = (together / scenario / "refused.txt").read_text()
    assert "not finite" in reason  # rank 0's own loss was finite: rank 1's stopped the step on both
    weights = load_file(together / scenario / ADAPTER_FILES[1])
    assert all(value.abs().max() == 0 for key, value in weights.items() if key.endswith("lora_B.weight"))
    assert_same_checkpoint(together / scenario, alone / scenario)


def failing_rank_main(rank: int, port: int, state_dir: str, out: str) -> None:
    """Rank 0's forward fails (say, out of memory) inside a step; rank 1 is inside it too."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    from gateway.models.registry import resolve_base_model
    from trainer.backends.peft import PeftBackend
    from trainer.distributed.team import TeamBroken, join
    from trainer.follower import follow
    from trainer.step import train_step

    settings = settings_for(Path(state_dir), "ddp-grpo")
    resolve_base_model(settings.base_model, settings.state_dir)  # built before the ranks meet, as run_worker does
    team = join(settings)
    assert team is not None
    backend = PeftBackend(settings)
    backend.attach_team(team)
    try:
        if rank == 0:

            def out_of_memory(row):
                raise RuntimeError("CUDA out of memory (a stand-in)")

            backend.token_logprobs = out_of_memory
            train_step(backend, batch(), settings)
        else:
            follow(backend, settings)
    except TeamBroken as exc:
        Path(out, f"rank{rank}.txt").write_text(exc.message)
    os._exit(0)  # rank 0 leaves the team as a failed rank's process does; rank 1 then hears it is gone


def test_a_step_that_fails_on_one_rank_ends_the_run_on_every_rank(tmp_path):
    """Not a hang until --dist-timeout: the failing rank says why, the other hears the team broke."""
    context = mp.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=failing_rank_main, args=(r, port, str(tmp_path), str(tmp_path))) for r in (0, 1)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
        assert proc.exitcode == 0
    failed = (tmp_path / "rank0.txt").read_text()
    assert "the team broke during a grpo step (RuntimeError: CUDA out of memory (a stand-in))" in failed
    heard = (tmp_path / "rank1.txt").read_text()
    assert "training rank 1 of 2: the team broke during a grpo step" in heard  # gloo's reason follows, as it came
