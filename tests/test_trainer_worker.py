"""The worker on the tiny model: one step from a store of hand-made rewarded groups."""

import asyncio
import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from gateway.errors import ConfigError
from gateway.models.registry import resolve_base_model
from gateway.store.sqlite import SQLiteStore
from tests.helpers_trainer import Recorder, trainer_settings
from trainer.data import NO_SPREAD
from trainer.worker import TrainerWorker, run_worker


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A store with two groups to learn from and one without a reward spread; one step."""
    settings = trainer_settings(tmp_path_factory.mktemp("state"))
    recorder = Recorder(settings)
    recorder.group("g1", [1.0, 0.0, 0.5])
    recorder.group("flat", [0.5, 0.5])
    recorder.group("g2", [0.0, 1.0])
    recorder.close()
    assert run_worker(settings, max_steps=1) == 1
    store = SQLiteStore(settings.db_path)
    yield settings, store


def test_checkpoint_is_a_peft_adapter_that_loads(trained):
    settings, _ = trained
    root = settings.checkpoints_dir()
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["0000", "0001"]
    step1 = root / "0001"
    for name in (
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.pt",
        "settings.json",
        "trainer_state.json",
    ):
        assert (step1 / name).is_file(), name
    assert json.loads((step1 / "settings.json").read_text())["lora_rank"] == 4

    base = AutoModelForCausalLM.from_pretrained(resolve_base_model(settings.base_model, settings.state_dir))
    model = PeftModel.from_pretrained(base, step1)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # trained: B left zero
    fresh = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(resolve_base_model(settings.base_model, settings.state_dir)), root / "0000"
    )
    assert all(p.abs().sum() == 0 for n, p in fresh.named_parameters() if "lora_B" in n)


def test_step_row_with_metrics_and_groups_marked(trained):
    settings, store = trained
    steps = store.steps("agent")
    assert [s["step"] for s in steps] == [0, 1]
    step1 = steps[1]
    assert step1["path"] == str((settings.checkpoints_dir() / "0001").resolve())
    assert sorted(step1["groups"]) == ["g1", "g2"]
    metrics = step1["metrics"]
    for key in (
        "loss",
        "reward_mean",
        "reward_std",
        "kl",
        "tokens",
        "seconds",
        "groups",
        "skipped_groups",
        "clip_fraction",
    ):
        assert key in metrics, key
    assert metrics["groups"] == 2 and metrics["skipped_groups"] == 1
    assert metrics["reward_mean"] == pytest.approx(2.5 / 5)
    # Old logprobs came from the same weights: every ratio is 1 at the first pass.
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["clip_fraction"] == 0.0
    assert store.get_group("g1")["trained_step"] == 1 and store.get_group("g2")["trained_step"] == 1
    flat = store.get_group("flat")
    assert flat["trained_step"] is None and flat["skipped"] == NO_SPREAD
    assert store.ready_groups("agent") == []


def test_each_trained_session_records_the_reward_it_trained_with(trained):
    """What a reward's 200 (or 409) answer is checked against: the reward the step read after its claim."""
    _, store = trained
    for group_id, rewards in (("g1", [1.0, 0.0, 0.5]), ("g2", [0.0, 1.0]), ("flat", [None, None])):
        assert [s["trained_reward"] for s in store.get_group(group_id)["sessions"]] == rewards, group_id


def test_restart_resumes_weights_and_optimizer_and_locks_out_a_second_worker(trained):
    settings, _ = trained
    worker = TrainerWorker(settings)
    try:
        worker.start()
        assert worker.next_step == 2
        saved = torch.load(settings.checkpoints_dir() / "0001" / "optimizer.pt", weights_only=True)
        assert worker.backend.optimizer.state_dict()["state"][0]["step"] == saved["state"][0]["step"] == 1
        with pytest.raises(ConfigError, match="another trainer worker"):
            TrainerWorker(settings).start()
    finally:
        worker.close()


def test_dedicated_gpu_mode_skips_groups_sampled_too_long_ago(tmp_path):
    settings = trainer_settings(tmp_path, engine="vllm", gpu_mode="dedicated", max_staleness=1)
    recorder = Recorder(settings)
    recorder.group("old", [1.0, 0.0], step=None)  # the base model answered: step 0
    recorder.group("recent", [1.0, 0.0], step=2)
    recorder.close()
    worker = TrainerWorker(settings)  # not started: no model needed to choose groups
    try:
        worker.next_step = 4  # training from step 3
        worker.settings = worker.settings.model_copy(update={"groups_per_step": 1})
        assert [g["id"] for g in worker.groups_to_train()] == ["recent"]
        assert worker.store.get_group("old")["skipped"].startswith("stale: sampled by step 0")
    finally:
        worker.close()


def test_serve_hands_its_settings_to_the_trainer_and_starts_none_where_pointless(caplog):
    from gateway.cli import build_parser, settings_from_args
    from gateway.trainer_process import settings_argv, start_trainer

    serve = build_parser().parse_args(
        [
            "serve",
            "--port",
            "9",
            "--model-name",
            "m",
            "--beta",
            "0.05",
            "--vllm-arg=--enforce-eager",
            "--api-key",
            "sk-secret-5d2a9e7c41b0",
            "--loss-type",
            "dapo",
        ]
    )
    argv = settings_argv(serve)
    assert "sk-secret" not in argv and "--api-key" not in argv
    train = build_parser().parse_args(["train", *argv])
    expected = settings_from_args(serve).public_dict()
    assert settings_from_args(train).public_dict() == {**expected, "api_key": None}

    with caplog.at_level("INFO", logger="rlproxy"):
        openai = build_parser().parse_args(["serve", "--engine", "openai", "--upstream-url", "http://127.0.0.1:9"])
        assert start_trainer(openai, settings_from_args(openai)) is None
        off = build_parser().parse_args(["serve", "--trainer", "off"])
        assert start_trainer(off, settings_from_args(off)) is None
    assert "openai engine serves no adapters" in caplog.text


def test_a_secret_inside_a_setting_reaches_the_trainer_by_environment_not_argv(monkeypatch, tmp_path):
    # argv is visible to every user (`ps`), and wandb records it with the run (--report-to).
    from gateway.cli import build_parser, settings_from_args
    from gateway.trainer_process import trainer_command

    serve = build_parser().parse_args(
        [
            "serve",
            "--state-dir",
            str(tmp_path),
            "--vllm-url",
            "http://rl:Vllm-pw-17@127.0.0.1:9",
            "--vllm-url",
            "http://127.0.0.1:10",
            "--vllm-arg=--hf-token=Hf-secret-11",
            "--judge-model",
            "judge",
            "--judge-api-base",
            "https://judge.example/v1?key=Judge-q-3",
            "--beta",
            "0.05",
        ]
    )
    cmd, env = trainer_command(serve, settings_from_args(serve))
    assert not any(secret in " ".join(cmd) for secret in ("Vllm-pw-17", "Hf-secret-11", "Judge-q-3"))
    assert "--beta" in cmd and "--judge-model=judge" in cmd  # the rest still on the command line
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    train = build_parser().parse_args(cmd[cmd.index("train") :])
    child, parent = settings_from_args(train), settings_from_args(serve)
    assert (child.vllm_url, child.vllm_arg, child.judge_api_base) == (
        parent.vllm_url,
        parent.vllm_arg,
        parent.judge_api_base,
    )


def test_a_trainer_child_that_exits_is_started_again_and_healthz_shows_it(caplog):
    # `serve --trainer auto`: a trainer that died (a crash, killed) used to stay dead while
    # /healthz said ok; it is brought back, with the exit code logged and shown.
    import sys
    import tempfile
    import time

    import httpx

    from gateway.trainer_process import TrainerChild

    runs = []
    code = "import sys, time; sys.exit(3) if len(sys.argv) < 2 else time.sleep(60)"
    child = TrainerChild([sys.executable, "-c", code], {})
    real_spawn = child._spawn

    def spawn():  # the first run exits with 3, the next one keeps running
        child.cmd = [sys.executable, "-c", code] + (["run"] if runs else [])
        runs.append(1)
        real_spawn()

    child._spawn = spawn
    with caplog.at_level("ERROR", logger="rlproxy"):
        child.start()
        deadline = time.monotonic() + 60
        while child.status()["state"] != "running" or child.restarts < 1:
            assert time.monotonic() < deadline, child.status()
            time.sleep(0.05)
    assert child.status() == {"state": "running", "restarts": 1, "last_exit": 3}
    assert "the trainer exited (code 3)" in caplog.text
    proc = child.proc
    child.stop(timeout=10)
    assert proc is not None and proc.poll() is not None  # stopped with the gateway,
    time.sleep(2.5)  # past the next restart's delay (2 s): not started again
    assert child.proc is proc and child.restarts == 1 and child.status()["state"] == "stopped"

    from gateway.app import create_app
    from gateway.settings import Settings
    from tests.fake_upstream import FakeUpstream
    from tests.helpers import ThreadServer

    with FakeUpstream() as upstream, tempfile.TemporaryDirectory() as state:
        app = create_app(Settings(engine="openai", upstream_url=upstream.url, state_dir=state, trainer="off"))
        app.state.trainer = child
        with ThreadServer(app) as server:
            health = httpx.get(server.url + "/healthz", timeout=30)
    assert health.status_code == 200 and health.json()["trainer"] == {"state": "stopped", "restarts": 1, "last_exit": 3}


def test_a_group_of_one_is_skipped_for_its_size_not_for_its_rewards(tmp_path):
    # One session has no spread either, but "every rollout scored the same" misled: it was one.
    import asyncio

    from trainer.data import too_few
    from trainer.selection import without_spread

    settings = trainer_settings(tmp_path)
    recorder = Recorder(settings)
    recorder.group("lone", [1.0])
    recorder.group("flat", [0.5, 0.5])
    recorder.close()
    store = SQLiteStore(settings.db_path)
    try:
        keep, skipped = without_spread(store, store.ready_groups("agent"))
        assert keep == [] and skipped == 2
        assert store.get_group("lone")["skipped"] == too_few(1, 1)
        assert store.get_group("lone")["skipped"].startswith("too few sessions to compare: 1 of its 1")
        assert store.get_group("flat")["skipped"] == NO_SPREAD
    finally:
        asyncio.run(store.close())


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_a_sample_longer_than_the_base_models_context_trains_its_prefix_instead_of_failing(tmp_path, caplog, positions):
    # An upstream (the openai engine) answers in longer contexts than the base model reads: this
    # model reads 512 positions, rows take 1024 tokens. GPT-2 learned a table of 512: a 600-token
    # sample fed whole read positions past it, which have no embedding (IndexError): the step
    # failed, and bisecting set the groups aside. The rotary Qwen2 computes any position, and
    # trained 88 it was never configured for, nor ever serves (the engines refuse past 512).
    # Either is cut to the model's context, as one longer than a row is, and the log says so.
    import asyncio

    from tests.helpers import call_row
    from tests.helpers_trainer import tiny_gpt2, tiny_qwen2_reading

    model_dir = tiny_gpt2(tmp_path) if positions == "learned" else tiny_qwen2_reading(tmp_path, 512)
    settings = trainer_settings(
        tmp_path / "state", base_model=str(model_dir), max_tokens_per_row=1024, groups_per_step=1
    )
    store = SQLiteStore(settings.db_path)
    for i, reward in enumerate([1.0, 0.0]):
        store.record_call_sync(
            call_row(
                f"c{i}",
                f"s{i}",
                "g",
                model="agent",
                served="agent@0",
                step=0,
                engine="local",
                request={"model": "agent", "messages": [{"role": "user", "content": "long"}]},
                response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}]},
                prompt_ids=[3 + (7 * t + i) % 700 for t in range(400)],
                completion_ids=[[3 + (5 * t + i) % 700 for t in range(200)]],
            )
        )
        asyncio.run(store.set_reward(f"s{i}", reward))
    asyncio.run(store.close_group("g"))
    caplog.set_level("INFO", logger="rlproxy.trainer")
    worker = TrainerWorker(settings, store)
    worker.start()
    try:
        metrics = worker.train_once(worker.groups_to_train())
    finally:
        worker.close()
    assert metrics is not None and metrics["cut_samples"] == 2
    assert store.get_group("g")["trained_step"] == 1
    assert "the base model reads 512 positions" in caplog.text
    asyncio.run(store.close())


def train_four_steps(settings, recorder) -> None:
    """Four steps of one group each, recorded by `recorder` and trained by a worker of `settings`."""
    worker = TrainerWorker(settings)
    try:
        worker.start()
        for step in range(4):
            recorder.group(f"g{step}", [1.0, 0.0], step=step)
            assert worker.train_once(worker.groups_to_train()) is not None
    finally:
        worker.close()


def test_keep_checkpoints_bounds_the_disk_and_keeps_what_serves_and_its_rollback(tmp_path):
    """Every step writes an adapter and its optimizer state: with `--keep-checkpoints 1` a trainer
    that runs for weeks keeps the newest checkpoint and the one a rollback would serve again (its
    parent); older ones go, their step rows stay."""
    settings = trainer_settings(tmp_path, groups_per_step=1, keep_checkpoints=1)
    recorder = Recorder(settings)
    try:
        train_four_steps(settings, recorder)
    finally:
        recorder.close()
    root = settings.checkpoints_dir()
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["0003", "0004"]
    store = SQLiteStore(settings.db_path)
    assert [row["step"] for row in store.steps("agent")] == [0, 1, 2, 3, 4]


def test_keep_checkpoints_bounds_a_postgres_store_and_a_trainer_moved_elsewhere_resumes(postgres_db, tmp_path):
    """On PostgreSQL every step's checkpoint also goes into the database (blobs): `--keep-checkpoints 1`
    keeps there what it keeps on disk, and a trainer started on a machine without the checkpoints
    still resumes from the newest step, fetched from the store."""
    from gateway.store.postgres import PostgresStore

    settings = trainer_settings(tmp_path / "node-1", groups_per_step=1, keep_checkpoints=1, store=postgres_db)
    recorder = Recorder(settings)
    asyncio.run(recorder.store.close())
    recorder.store = store = PostgresStore(postgres_db)  # the calls and rewards into the shared store
    train_four_steps(settings, recorder)

    def stored() -> list[int]:
        return sorted(store.stored_steps("agent"))

    on_disk = sorted(int(p.name) for p in settings.checkpoints_dir().iterdir() if not p.name.startswith("."))
    assert on_disk == stored() == [3, 4]  # the newest, and its parent (what a rollback serves again)
    blobs = store._query("SELECT sha256 FROM blobs")
    assert {r["sha256"] for r in blobs} == {d for s in (3, 4) for _, d, _ in store.step_files("agent", s)}
    moved = trainer_settings(tmp_path / "node-2", groups_per_step=1, keep_checkpoints=1, store=postgres_db)
    worker = TrainerWorker(moved)
    try:
        worker.start()  # nothing on this disk: step 4 from the store
        recorder.group("g4", [1.0, 0.0], step=4)
        assert worker.train_once(worker.groups_to_train()) is not None
    finally:
        worker.close()
    assert [row["step"] for row in store.steps("agent")] == [0, 1, 2, 3, 4, 5]
    assert stored() == [4, 5]
    recorder.close()


def test_keep_checkpoints_never_removes_the_serving_step_however_old(tmp_path):
    """`--promote manual`, two candidates rejected: NAME still serves step 0, which a gateway loads
    and a restarted trainer goes on from, so it stays while the rejected steps go."""
    settings = trainer_settings(tmp_path, groups_per_step=1, keep_checkpoints=1, promote="manual", max_rejections=5)
    recorder = Recorder(settings)
    worker = TrainerWorker(settings)
    try:
        worker.start()
        for step in (1, 2, 3):
            recorder.group(f"g{step}", [1.0, 0.0], step=0)
            assert worker.run(max_steps=1) == 1
            if step < 3:
                worker.store.decide_step("agent", step, "rejected", {"by": "test"})
    finally:
        worker.close()
        recorder.close()
    root = settings.checkpoints_dir()
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["0000", "0003"]
    assert SQLiteStore(settings.db_path).serving_step("agent") == 0
