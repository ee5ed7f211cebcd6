"""A trainer that never publishes a broken step: NaN steps, failing batches bisected to the group
at fault, attempts that survive a crash, sessions too long for a row leaving their group,
discards that race a step, staleness on every engine."""

from __future__ import annotations

import hashlib
import math

import pytest

from gateway.errors import StoreFull
from tests.helpers_trainer import Recorder, trainer_settings
from trainer import publish
from trainer import worker as worker_module
from trainer.attempts import MAX_ATTEMPTS, attempt_limit
from trainer.data import TOO_LONG, too_few
from trainer.worker import TrainerWorker


def files_digest(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


@pytest.fixture
def worker(tmp_path):
    settings = trainer_settings(tmp_path, groups_per_step=2)
    recorder = Recorder(settings)
    recorder.group("g1", [1.0, 0.0, 0.5])
    recorder.group("g2", [0.0, 1.0])
    recorder.group("g3", [1.0, 0.0])
    recorder.group("g4", [0.2, 0.9])
    recorder.close()
    worker = TrainerWorker(settings)
    worker.start()
    yield worker
    worker.close()


def poison(worker, times: int):
    """The next `times` forward passes with gradients give NaN logprobs (a blown-up loss)."""
    real = worker.backend.token_logprobs
    left = [times]

    def token_logprobs(row):
        out = real(row)
        if left[0] > 0 and out.requires_grad:
            left[0] -= 1
            return out * math.nan
        return out

    worker.backend.token_logprobs = token_logprobs
    return left


def lora_weights(worker):
    return [p.detach().clone() for p in worker.backend._params]


def test_a_nan_step_changes_nothing_and_the_next_good_batch_trains(worker):
    root = worker.root
    before_files, before_steps = files_digest(root), worker.store.steps("agent")
    before_weights = lora_weights(worker)
    groups = worker.groups_to_train()
    poison(worker, 1)
    assert worker.train_once(groups) is None
    # adapter files, step rows and weights as they were; the groups stay ready, untrained
    assert files_digest(root) == before_files
    assert worker.store.steps("agent") == before_steps
    assert all((a == b).all() for a, b in zip(before_weights, lora_weights(worker), strict=False))
    assert all(worker.store.get_group(g["id"])["trained_step"] is None for g in groups)
    assert worker.next_step == 1
    # the next attempt is a good batch: it trains, and the step says an attempt failed before it
    metrics = worker.train_once(worker.groups_to_train())
    assert metrics is not None and math.isfinite(metrics["loss"]) and metrics["failed_attempts"] == 1
    assert [s["step"] for s in worker.store.steps("agent")] == [0, 1]
    assert all(math.isfinite(float(p.detach().abs().sum())) for p in worker.backend._params)


def test_a_nan_in_a_later_pass_restores_the_earlier_passes_update(worker):
    worker.settings = worker.settings.model_copy(update={"epochs_per_step": 2})
    before = lora_weights(worker)
    real = worker.backend.token_logprobs
    calls = {"n": 0}

    def second_pass_nan(row):
        out = real(row)
        if out.requires_grad:
            calls["n"] += 1
            if calls["n"] > 1:  # the first pass is one packed row here; the second pass blows up
                return out * math.nan
        return out

    worker.backend.token_logprobs = second_pass_nan
    assert worker.train_once(worker.groups_to_train()) is None
    assert calls["n"] >= 2
    assert all((a == b).all() for a, b in zip(before, lora_weights(worker), strict=False))


def test_a_failing_batch_is_bisected_and_only_the_group_at_fault_is_set_aside(worker, monkeypatch):
    # One group's samples make every step that holds them fail (out of memory, say); the
    # batch of two is split and the good group trains alone: one bad group sets aside no other.
    groups = worker.groups_to_train()
    bad, good = sorted(g["id"] for g in groups)
    real = worker_module.train_and_record

    def fails_with_bad(backend, store, model, settings, plan, **kwargs):
        if bad in plan.trained_groups:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(backend, store, model, settings, plan, **kwargs)

    monkeypatch.setattr(worker_module, "train_and_record", fails_with_bad)
    limit = attempt_limit(worker.settings.groups_per_step)
    assert limit == MAX_ATTEMPTS + 1  # one halving isolates a group of a 2-group step
    assert worker.train_once(groups) is None
    # the attempt is counted in the store, with the error; the group stays ready
    assert worker.store.get_group(bad)["attempts"] == 1
    assert worker.store.get_group(bad)["last_error"].startswith("RuntimeError: CUDA out of memory")
    results = []
    while (next_groups := worker.groups_to_train()) is not None and len(results) < 10:
        results.append(([g["id"] for g in next_groups], worker.train_once(next_groups) is not None))
    assert results[:2] == [([bad], False), ([good], True)]  # the halves, bad first
    assert worker.store.get_group(good)["trained_step"] == 1
    failed = worker.store.get_group(bad)
    assert failed["trained_step"] is None and failed["attempts"] == limit
    assert failed["failed"].startswith(f"training failed {limit} times: RuntimeError: CUDA out of memory")
    assert bad not in {g["id"] for g in worker.store.ready_groups("agent")}  # never retried
    # the other groups go on training (a step of 2, without any failure since the last step)
    assert any(ok for _, ok in results[2:])


def test_a_group_its_step_cannot_even_plan_is_set_aside_and_the_trainer_goes_on(worker, monkeypatch):
    # Planning (advantages, samples) failing on a group's data killed the trainer process, and
    # every restart with it, its groups claimed for good. It is now a failed attempt like any other.
    groups = worker.groups_to_train()
    bad, good = sorted(g["id"] for g in groups)
    real = worker_module.plan_step

    def overflows_with_bad(store, settings, render, groups, *rest):
        if bad in {g["id"] for g in groups}:
            raise OverflowError("(34, 'Numerical result out of range')")
        return real(store, settings, render, groups, *rest)

    monkeypatch.setattr(worker_module, "plan_step", overflows_with_bad)
    assert worker.train_once(groups) is None
    assert worker.store.get_group(bad)["last_error"].startswith("OverflowError")
    results = []
    while (next_groups := worker.groups_to_train()) is not None and len(results) < 10:
        results.append(([g["id"] for g in next_groups], worker.train_once(next_groups) is not None))
    assert results[:2] == [([bad], False), ([good], True)]
    assert worker.store.get_group(good)["trained_step"] == 1
    assert worker.store.get_group(bad)["failed"].startswith("training failed")


def test_a_trainer_that_dies_mid_step_counts_the_attempt(tmp_path):
    # The claim counts the attempt before training: a process killed in the step (out of host
    # memory) leaves the count in the store and the restart gives the claim back. One death is
    # nobody's fault (a deploy's kill): the step is tried again as it was; after a second, each
    # group trains alone, and the one that kills every attempt is set aside in the end.
    settings = trainer_settings(tmp_path, groups_per_step=2)
    recorder = Recorder(settings)
    recorder.group("g1", [1.0, 0.0])  # kills the trainer whenever it is trained
    recorder.group("g2", [0.0, 1.0])
    recorder.close()

    def restart_and_die():
        """A restart that chooses a step, claims it and dies in it: what it chose."""
        worker = TrainerWorker(settings)
        try:
            worker.store.release_model_claims(worker.model)  # what `start` does first
            chosen = [g["id"] for g in worker.groups_to_train() or []]
            if "g1" in chosen:
                worker.store.claim_for_step(chosen, 1)  # ... and the trainer dies here
            return chosen
        finally:
            worker.close()

    assert restart_and_die() == ["g1", "g2"]
    assert restart_and_die() == ["g1", "g2"]  # one death: the same step again
    limit = attempt_limit(2)
    for attempt in range(3, limit + 1):
        assert restart_and_die() == ["g1"]  # two: a suspect trains alone
        assert TrainerWorker(settings).store.get_group("g1")["attempts"] == attempt
    assert restart_and_die() == ["g2"]  # g1 is set aside; g2, a suspect too, trains alone
    worker = TrainerWorker(settings)
    try:
        g1, g2 = worker.store.get_group("g1"), worker.store.get_group("g2")
        assert g1["attempts"] == limit
        assert g1["failed"].startswith(f"training failed {limit} times: the trainer stopped")
        assert g2["failed"] is None and g2["attempts"] == 2
    finally:
        worker.close()


@pytest.mark.parametrize("phase", ["train", "record"])
def test_a_discard_that_races_the_step_takes_it_back(worker, monkeypatch, phase):
    groups = worker.groups_to_train()
    victim = groups[0]["sessions"][0]["id"]
    before_files, before_weights = files_digest(worker.root), lora_weights(worker)

    def discard_now(at: str, step: int) -> None:
        if at == phase:  # after training (train) or after the checkpoint was written (record)
            import asyncio

            asyncio.run(worker.store.discard_session(victim, "the rollout crashed"))

    monkeypatch.setattr(publish, "_test_pause", discard_now)
    assert worker.train_once(groups) is None
    assert files_digest(worker.root) == before_files  # a written checkpoint was removed again
    assert all((a == b).all() for a, b in zip(before_weights, lora_weights(worker), strict=False))
    assert [s["step"] for s in worker.store.steps("agent")] == [0]
    monkeypatch.setattr(publish, "_test_pause", lambda at, step: None)
    metrics = worker.train_once(worker.groups_to_train())
    assert metrics is not None
    step = worker.store.steps("agent")[-1]
    group = worker.store.get_group(groups[0]["id"])
    assert group["trained_step"] == step["step"] == 1
    assert victim not in {s["id"] for s in group["sessions"]}


def test_a_session_too_long_for_a_row_leaves_its_group_and_the_rest_train(tmp_path):
    settings = trainer_settings(tmp_path, groups_per_step=2, max_tokens_per_row=60)
    recorder = Recorder(settings)
    recorder.group("short", [1.0, 0.0])
    # one session of this group has a prompt longer than a row: nothing of it can be trained
    recorder.call("long-s0", "long", "What is " + "very " * 80 + "long?", "No.")
    recorder.call("long-s1", "long", "What is 1?", "It is 42.")
    recorder.call("long-s2", "long", "What is 2?", "It is 2.")
    recorder.call("pair-s0", "pair", "What is " + "very " * 80 + "long?", "No.")
    recorder.call("pair-s1", "pair", "What is 1?", "It is 42.")
    import asyncio

    for sid, reward in {"long-s0": 1.0, "long-s1": 0.0, "long-s2": 1.0, "pair-s0": 1.0, "pair-s1": 0.0}.items():
        asyncio.run(recorder.store.set_reward(sid, reward))
    asyncio.run(recorder.store.close_group("long"))
    asyncio.run(recorder.store.close_group("pair"))
    recorder.close()
    worker = TrainerWorker(settings)
    worker.start()
    try:
        metrics = worker.train_once([worker.store.get_group(g) for g in ("short", "long", "pair")])
        assert metrics is not None and metrics["groups"] == 2 and metrics["left_out_sessions"] == 1
        assert worker.store.get_group("short")["trained_step"] == 1
        long = worker.store.get_group("long")
        assert long["trained_step"] == 1
        by_id = {s["id"]: s for s in long["sessions"]}
        assert by_id["long-s0"]["untrained_reason"] == TOO_LONG and by_id["long-s0"]["advantage"] is None
        # the advantages are over [0, 1], the two sessions trained: they sum to zero
        assert by_id["long-s1"]["advantage"] == pytest.approx(-by_id["long-s2"]["advantage"]) != 0
        pair = worker.store.get_group("pair")  # one session left: nothing to compare it with
        assert pair["trained_step"] is None and pair["skipped"] == too_few(1, 2)
        assert worker.store.get_session("pair-s0")["untrained_reason"] == TOO_LONG
    finally:
        worker.close()


def test_staleness_applies_to_the_local_engine_too(tmp_path):
    settings = trainer_settings(tmp_path, engine="local", max_staleness=1, groups_per_step=1)
    recorder = Recorder(settings)
    recorder.group("old", [1.0, 0.0], step=None)  # the base model answered: step 0
    recorder.group("recent", [1.0, 0.0], step=3)
    recorder.close()
    worker = TrainerWorker(settings)  # not started: no model needed to choose groups
    try:
        worker.next_step = 5  # training from step 4
        assert [g["id"] for g in worker.groups_to_train()] == ["recent"]
        assert worker.store.get_group("old")["skipped"] == "stale: sampled by step 0, training from step 4"
    finally:
        worker.close()


def test_choosing_groups_reads_no_step_history_however_long_the_run(tmp_path):
    """While groups gather the trainer looks for them at every poll, for weeks: it reads what it
    needs of the steps (the parent chain, step 0's --init-from), never every step's metrics and
    group lists, which grow with each step."""
    settings = trainer_settings(tmp_path, engine="local", max_staleness=1, groups_per_step=2)
    recorder = Recorder(settings)
    recorder.group("old", [1.0, 0.0], step=None)  # the base model answered: step 0
    recorder.group("recent", [1.0, 0.0], step=3)
    recorder.close()
    worker = TrainerWorker(settings)  # not started: no model needed to choose groups
    try:
        worker.store.steps = None  # any read of the whole history fails this test (TypeError)
        worker.next_step = 5  # training from step 4
        assert worker.groups_to_train() is None  # one fresh group of the two a step takes
        assert worker.store.get_group("old")["skipped"] == "stale: sampled by step 0, training from step 4"
    finally:
        worker.close()


def test_a_half_of_a_bisected_batch_that_went_stale_is_skipped_not_trained(tmp_path, monkeypatch):
    # Each half of a failed batch that trains advances the step: the next half is screened for
    # staleness as the first selection was, so no group trains past --max-staleness.
    settings = trainer_settings(tmp_path, engine="local", max_staleness=0, groups_per_step=4)
    recorder = Recorder(settings)
    for gid in ("g1", "g2", "g3", "g4"):
        recorder.group(gid, [1.0, 0.0], step=0)
    recorder.close()
    worker = TrainerWorker(settings)
    worker.start()
    try:
        batch = [g["id"] for g in worker.groups_to_train()]  # step 1, trained from step 0: fresh
        assert len(batch) == 4
        real, failures = worker_module.train_and_record, [1]

        def fails_once(*args, **kwargs):
            if failures[0]:
                failures[0] -= 1
                raise RuntimeError("CUDA out of memory (simulated)")
            return real(*args, **kwargs)

        monkeypatch.setattr(worker_module, "train_and_record", fails_once)
        assert worker.train_once([worker.store.get_group(gid) for gid in batch]) is None
        first = worker.groups_to_train()
        assert [g["id"] for g in first] == batch[:2]
        assert worker.train_once(first) is not None and worker.next_step == 2  # step 1: trained from step 0
        # The other half would now train from step 1, sampled by step 0: more than --max-staleness 0.
        assert worker.groups_to_train() is None
        for gid in batch[2:]:
            group = worker.store.get_group(gid)
            assert group["trained_step"] is None
            assert group["skipped"] == "stale: sampled by step 0, training from step 1"
        assert [s["step"] for s in worker.store.steps("agent")] == [0, 1]
    finally:
        worker.close()


def test_a_checkpoint_that_cannot_be_written_leaves_the_weights_as_they_were(worker):
    # The update happened in memory; the checkpoint write fails: the next attempt must start
    # from the same adapter, not from one updated twice.
    before = lora_weights(worker)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    worker._save = disk_full
    groups = worker.groups_to_train()
    with pytest.raises(StoreFull):  # the disk's fault: the run loop waits for it, as for the store
        worker.train_once(groups)
    assert all((a == b).all() for a, b in zip(before, lora_weights(worker), strict=False))
    assert worker.attempts.since_step == 0 and [s["step"] for s in worker.store.steps("agent")] == [0]
    # Not counted against the groups: a full disk must not bring them nearer to being set aside.
    assert [worker.store.get_group(g["id"])["attempts"] for g in groups] == [0] * len(groups)
