"""Hot-swap: new training steps are loaded and served while requests keep flowing.

The registry's rules are checked against a fake engine (what loads, what moves, what
waits for idle); the live test runs a real gateway on the tiny model, with steps
published the way the trainer does it (a PEFT checkpoint under the models directory,
then `Store.insert_step` from another connection).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import openai
import pytest

from gateway import adapters as adapters_module
from gateway.adapters import AdapterRegistry, checked_adapter_path
from gateway.app import create_app
from gateway.engines.base import Engine
from gateway.errors import EngineUnavailable, NotFound, StoreUnavailable
from gateway.settings import Settings
from gateway.store import Store
from gateway.store.sqlite import SQLiteStore
from tests.helpers import ThreadServer

MESSAGES = [{"role": "user", "content": "Say something."}]

# The adapters here put a LoRA on the tiny model's tied output head, as the trainer does for
# it; peft warns about merging such adapters, which nothing here does.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*tie_word_embeddings"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing"),
]


# ------------------------------------------------------------------ registry rules (fake engine)


class FakeEngine(Engine):
    kind = "fake"
    supports_adapters = True

    def __init__(self) -> None:
        self.adapters: dict[str, Path] = {}
        self.fail_loads: dict[str, int] = {}  # adapter -> loads that fail before one succeeds
        self.log: list[tuple[str, str]] = []

    @property
    def base_model_id(self) -> str:
        return "base"

    async def complete(self, request):  # pragma: no cover - not used here
        raise NotImplementedError

    def stream(self, request):  # pragma: no cover - not used here
        raise NotImplementedError

    async def load_adapter(self, name: str, path: Path) -> None:
        if self.fail_loads.get(name, 0) > 0:
            self.fail_loads[name] -= 1
            raise EngineUnavailable(f"simulated failure loading {name}")
        self.adapters[name] = path
        self.log.append(("load", name))

    async def unload_adapter(self, name: str) -> None:
        del self.adapters[name]
        self.log.append(("unload", name))


def fake_checkpoint(settings: Settings, step: int) -> str:
    path = settings.checkpoints_dir() / f"{step:04d}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.setattr(adapters_module, "_UNLOAD_GRACE_SECONDS", 0.0)
    settings = Settings(state_dir=tmp_path, keep_adapters=2, poll_interval=30)  # refresh() by hand
    store = SQLiteStore(settings.db_path)
    engine = FakeEngine()
    yield settings, store, engine, AdapterRegistry(engine, store, settings)
    asyncio.run(store.close())


def publish_fake(settings: Settings, store: Store, step: int, path: str | None = None) -> None:
    store.insert_step(settings.model_name, step, path or fake_checkpoint(settings, step), {}, [])


async def test_start_serves_the_newest_steps_and_base_before_any(fake):
    settings, store, engine, registry = fake
    assert registry.resolve("agent").step is None  # nothing trained yet: the base model answers
    assert registry.resolve("agent").adapter is None
    for step in range(4):
        publish_fake(settings, store, step)
    await registry.start()
    try:
        assert sorted(registry.loaded) == [2, 3]  # keep_adapters newest
        assert registry.current == 3
        assert registry.resolve("agent").adapter == "agent@3"
        assert registry.resolve("agent@2").step == 2
        with pytest.raises(NotFound):
            registry.resolve("agent@1")
        assert registry.served_names() == ["agent", "agent@2", "agent@3"]
    finally:
        await registry.close()


async def test_alias_moves_and_old_adapters_unload_only_when_idle(fake):
    settings, store, engine, registry = fake
    publish_fake(settings, store, 0)
    await registry.refresh()
    async with registry.use("agent") as held:  # a request in flight on step 0
        assert held.step == 0
        publish_fake(settings, store, 1)
        publish_fake(settings, store, 2)
        await registry.refresh()
        assert registry.current == 2 and registry.resolve("agent").step == 2
        assert 0 in registry.loaded, "an adapter in use must not be unloaded"
        assert ("unload", "agent@0") not in engine.log
    await registry.refresh()  # idle now: beyond keep_adapters, so it goes
    assert sorted(registry.loaded) == [1, 2]
    assert engine.log[-1] == ("unload", "agent@0")
    assert set(engine.adapters) == {"agent@1", "agent@2"}


async def test_failed_load_keeps_the_previous_step_and_retries(fake, caplog):
    settings, store, engine, registry = fake
    publish_fake(settings, store, 0)
    await registry.refresh()
    engine.fail_loads["agent@1"] = 1
    publish_fake(settings, store, 1)
    await registry.refresh()
    assert registry.current == 0  # still serving what worked
    assert "simulated failure" in registry.load_errors[1]
    assert any("loading agent@1 failed" in r.getMessage() for r in caplog.records)
    await registry.refresh()  # next poll: it loads
    assert registry.current == 1 and registry.load_errors == {}


async def test_any_step_with_a_checkpoint_loads_on_demand_and_lru_unloads(fake):
    settings, store, engine, registry = fake  # keep_adapters=2
    for step in range(11):
        publish_fake(settings, store, step)
    await registry.refresh()
    assert sorted(registry.loaded) == [9, 10] and registry.current == 10
    async with registry.use("agent@0") as target:  # ten steps on: step 0 still answers
        assert (target.adapter, target.step) == ("agent@0", 0)
        assert ("load", "agent@0") in engine.log
        assert ("unload", "agent@9") in engine.log  # least recently used, idle: it made room
    assert sorted(registry.loaded) == [0, 10]
    async with registry.use("agent@3"):  # step 0 was used more recently than... nothing else: LRU order
        pass
    assert sorted(registry.loaded) == [3, 10]  # the alias's step always stays; 0 was the LRU
    await registry.ensure("agent@3")  # loaded: nothing to do
    assert engine.log.count(("load", "agent@3")) == 1
    with pytest.raises(NotFound) as missing:
        await registry.ensure("agent@11")
    assert "has no checkpoint" in missing.value.message and "steps 0-10" in missing.value.message
    await registry.ensure("gpt-4o")  # not a pinned name: left to resolve()


async def test_a_404_for_a_pinned_step_offers_the_steps_keep_checkpoints_left(fake):
    """`--keep-checkpoints 2`: steps 0-3 keep their rows, their checkpoints are gone. NAME@N of a step
    that does not exist, or of a removed one, names the steps that still load: it said 'has steps
    0-5', and a client that took agent@1 from it got a second 404."""
    from trainer import checkpoints as ckpts
    from trainer.resume import prune_checkpoints

    settings, store, engine, registry = fake
    for step in range(6):
        path = Path(fake_checkpoint(settings, step))
        for name in (*ckpts.ADAPTER_FILES, ckpts.STATE_FILE):
            (path / name).write_text("{}")
        publish_fake(settings, store, step, str(path))
        prune_checkpoints(store, settings.model_name, settings.checkpoints_dir(), 2, step)
    await registry.refresh()
    with pytest.raises(NotFound) as missing:
        await registry.ensure("agent@9")
    assert missing.value.message == "model 'agent@9' has no checkpoint: model 'agent' has checkpoints for steps 4-5"
    engine.fail_loads["agent@1"] = 2  # as an engine fails on files that are not there
    with pytest.raises(
        NotFound, match=r"step 1 is recorded, but its adapter files are gone .*\(checkpoints: steps 4-5\)$"
    ):
        await registry.ensure("agent@1")


async def test_a_step_written_in_other_digits_is_a_404_not_a_500_nor_another_step(fake):
    # `str.isdigit` takes "²" (which `int` refuses) and "٣" (which `int` reads as 3): neither names a step.
    settings, store, engine, registry = fake
    for step in range(4):
        publish_fake(settings, store, step)
    await registry.refresh()
    for name in ("agent@²", "agent@٣"):
        with pytest.raises(NotFound) as missing:
            async with registry.use(name):
                pass
        assert missing.value.code == "model_not_found" and "agent@N" in missing.value.message
    async with registry.use("agent@3") as target:  # the same step in ASCII digits answers
        assert target.step == 3


async def test_a_pinned_step_whose_files_are_gone_is_a_404_not_a_503_to_retry(fake):
    settings, store, engine, registry = fake
    for step in range(3):
        publish_fake(settings, store, step)  # step 0's directory holds no adapter: its files were removed
    await registry.refresh()
    engine.fail_loads["agent@0"] = 2  # as an engine fails on files that are not there
    with pytest.raises(NotFound, match="step 0 is recorded, but its adapter files are gone") as gone:
        await registry.ensure("agent@0")
    assert gone.value.code == "model_not_found"
    (Path(fake_checkpoint(settings, 0)) / "adapter_config.json").write_text("{}")
    with pytest.raises(EngineUnavailable, match="try again"):  # its files are there: a later try may load it
        await registry.ensure("agent@0")


async def test_a_pinned_step_in_use_is_not_unloaded_to_make_room(fake):
    settings, store, engine, registry = fake  # keep_adapters=2
    for step in range(4):
        publish_fake(settings, store, step)
    await registry.refresh()
    async with registry.use("agent@0"), registry.use("agent@1"):
        assert sorted(registry.loaded) == [0, 1, 3]  # over the bound while all are busy
    await registry.refresh()  # idle now: back within keep_adapters, the LRU one gone
    assert sorted(registry.loaded) == [1, 3]


async def test_a_step_first_loaded_by_name_on_part_of_the_engine_is_loaded_everywhere_before_it_serves(fake):
    # Engine replicas load NAME@N only where its calls go (`partial_loads`): were the registry to
    # take that load for the step's, NAME would move to a step some replicas do not have.
    settings, store, _, registry = fake

    class Replicas(FakeEngine):
        partial_loads = True

        async def load_adapter_on_demand(self, name: str, path: Path) -> None:
            self.log.append(("on demand", name))

    engine = registry.engine = Replicas()
    publish_fake(settings, store, 0)
    await registry.refresh()
    publish_fake(settings, store, 1)
    await registry.ensure("agent@1")  # a client pins the new step before the poll sees it
    assert engine.log == [("load", "agent@0"), ("on demand", "agent@1")]
    assert 1 in registry.loaded and not registry.loaded_everywhere(1) and registry.current == 0
    await registry.refresh()
    assert engine.log[-1] == ("load", "agent@1") and registry.loaded_everywhere(1)
    assert registry.current == 1
    await registry.ensure("agent@1", everywhere=True)  # loaded everywhere now: nothing more to do
    assert engine.log.count(("load", "agent@1")) == 1


def test_step_ranges_in_messages():
    from gateway.pinned import ranges

    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert ranges([4]) == "4"
    assert ranges([]).startswith("none")


async def test_checkpoint_paths_outside_the_models_dir_are_refused(fake, tmp_path):
    settings, store, engine, registry = fake
    outside = tmp_path / "elsewhere" / "0000"
    outside.mkdir(parents=True)
    publish_fake(settings, store, 0, str(outside))
    await registry.refresh()
    assert registry.current is None and engine.log == []
    assert "outside the models directory" in registry.load_errors[0]
    sneaky = settings.models_dir / ".." / "elsewhere" / "0000"  # inside only before resolving
    with pytest.raises(adapters_module.AdapterPathError):
        checked_adapter_path(str(sneaky), settings.models_dir)
    assert checked_adapter_path(fake_checkpoint(settings, 5), settings.models_dir).name == "0005"


async def test_engines_without_adapters_pass_names_through(tmp_path):
    class Upstream(FakeEngine):
        supports_adapters = False

    settings = Settings(state_dir=tmp_path, poll_interval=0.01)
    store = SQLiteStore(settings.db_path)
    publish_fake(settings, store, 0)
    registry = AdapterRegistry(Upstream(), store, settings)
    await registry.start()
    try:
        await asyncio.sleep(0.05)
        assert registry.loaded == {} and registry.served_names() == []
        target = registry.resolve("gpt-4o-mini")
        assert (target.model, target.adapter, target.step) == ("gpt-4o-mini", None, None)
    finally:
        await registry.close()
        await store.close()


# ------------------------------------------------------------------ live: real gateway, tiny model


def save_adapter(base_dir: Path, path: Path, seed: int) -> None:
    """A PEFT checkpoint for the tiny model, as the trainer writes one. seed 0: the fresh
    adapter (B = 0, same as the base model); others: random B, a visibly different policy."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"])
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name and seed:
                param.normal_(0.0, 0.5)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, save_embedding_layers=False)  # LoRA weights only, like the trainer
    os.rename(tmp, path)  # whole checkpoints only, like the trainer


class Publisher:
    """Plays the trainer: checkpoint files, then the step row, through its own connection."""

    def __init__(self, settings: Settings):
        from gateway.models.registry import resolve_base_model

        self.settings = settings
        self.base_dir = Path(resolve_base_model(settings.base_model, settings.state_dir))
        self.store = SQLiteStore(settings.db_path)

    def publish(self, step: int) -> None:
        path = self.settings.checkpoints_dir() / f"{step:04d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_adapter(self.base_dir, path, seed=step)
        self.store.insert_step(self.settings.model_name, step, str(path.resolve()), {"loss": 0.0}, [])

    async def close(self) -> None:
        await self.store.close()


async def _call(client: openai.AsyncOpenAI, model: str, stream: bool, session: str) -> tuple[str, str | None, str]:
    """One chat completion; returns (request id, X-Model-Step, text)."""
    headers = {"X-Session-Id": session, "X-Group-Id": "hotswap"}
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=8, stream=stream, extra_headers=headers
    )
    if stream:
        text = ""
        async for chunk in raw.parse():  # with_raw_response: parse() is not awaited
            for choice in chunk.choices:
                text += choice.delta.content or ""
    else:
        text = raw.parse().choices[0].message.content or ""
    return raw.headers["x-request-id"], raw.headers.get("x-model-step"), text


async def _until(predicate, what: str, timeout: float = 120.0) -> None:
    """Wait for a condition (a hang guard, not a speed requirement)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.05)


def _model_ids(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}


async def test_requests_keep_flowing_while_two_steps_land(tmp_path):
    settings = Settings(
        engine="local", state_dir=tmp_path, poll_interval=0.1, keep_adapters=3, default_max_tokens=8, max_batch_size=8
    )
    publisher = Publisher(settings)
    publisher.publish(0)  # the trainer saves step 0 (the fresh adapter) when it starts
    seen: list[tuple[str, str | None, str]] = []  # (request id, X-Model-Step, model asked for)
    try:
        with ThreadServer(create_app(settings)) as server:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            stop = asyncio.Event()

            async def agent(worker: int) -> None:
                k = 0
                while not stop.is_set():
                    request_id, step, _ = await _call(client, "agent", stream=k % 2 == 1, session=f"w{worker}-{k}")
                    seen.append((request_id, step, "agent"))
                    k += 1

            def steps_seen() -> set[str | None]:
                return {step for _, step, _ in seen}

            workers = [asyncio.create_task(agent(i)) for i in range(4)]
            try:
                await _until(lambda: "0" in steps_seen(), "requests served by step 0")
                for step in (1, 2):
                    await asyncio.to_thread(publisher.publish, step)
                    await _until(lambda step=step: str(step) in steps_seen(), f"requests served by step {step}")
                count = len(seen)
                await _until(lambda: len(seen) >= count + 8, "more requests after the second swap")
            except BaseException:
                for task in workers:
                    task.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                await client.close()  # idle keep-alive connections would hold up the server's shutdown
                raise
            stop.set()
            await asyncio.gather(*workers)  # any failed request fails the test here

            # The pinned name still answers with its own step (kept: keep_adapters=3).
            for stream in (False, True):
                request_id, step, _ = await _call(client, "agent@0", stream=stream, session=f"pinned-{stream}")
                assert step == "0"
                seen.append((request_id, step, "agent@0"))
            assert _model_ids(server.url) >= {"agent", "agent@0", "agent@1", "agent@2", settings.base_model}

            # A third step goes beyond keep_adapters: the least recently used step (1: step 0
            # was just asked for by name) is unloaded once idle...
            await asyncio.to_thread(publisher.publish, 3)
            await _until(lambda: "agent@1" not in _model_ids(server.url), "step 1 to be unloaded")
            assert _model_ids(server.url) >= {"agent", "agent@0", "agent@2", "agent@3", settings.base_model}
            # ...and loaded again on demand: any step with a checkpoint answers.
            for stream in (True, False):
                request_id, step, _ = await _call(client, "agent@1", stream=stream, session=f"reloaded-{stream}")
                assert step == "1"
                seen.append((request_id, step, "agent@1"))
            with pytest.raises(openai.NotFoundError, match="steps 0-3"):
                await client.chat.completions.create(model="agent@9", messages=MESSAGES, max_tokens=2)
            request_id, step, _ = await _call(client, "agent", stream=False, session="after")
            assert step == "3"
            seen.append((request_id, step, "agent"))
            await client.close()

        # What was recorded: every call ok, each names an existing step, the one its header said.
        calls = {row["id"]: row for row in publisher.store._query("SELECT id, step, status, model FROM calls")}
        existing = {row["step"] for row in publisher.store.steps(settings.model_name)}
        for request_id, header, model in seen:
            call = calls[request_id]
            assert call["status"] == "ok", call
            assert call["step"] in existing
            assert str(call["step"]) == header
            assert call["model"] == model
        assert {str(calls[r]["step"]) for r, _, m in seen if m == "agent"} >= {"0", "1", "2", "3"}
        assert len(seen) >= 20
    finally:
        await publisher.close()


async def test_a_replica_removes_the_files_it_fetched_for_a_step_it_unloaded(postgres_db, tmp_path, monkeypatch):
    """On PostgreSQL a replica fetches each step's files from the store into MODELS_DIR/NAME/store/NNNN.
    A gateway that runs for weeks fetched every step the trainer published and kept them all; now
    a step's copy goes when the step is unloaded (`--keep-adapters`), and a call for it fetches again."""
    from gateway.store.postgres import PostgresStore

    monkeypatch.setattr(adapters_module, "_UNLOAD_GRACE_SECONDS", 0.0)
    trainer_settings = Settings(state_dir=tmp_path / "trainer", poll_interval=30)
    settings = Settings(state_dir=tmp_path / "replica", keep_adapters=2, poll_interval=30)
    trainer, replica = PostgresStore(postgres_db), PostgresStore(postgres_db)
    engine = FakeEngine()
    registry = AdapterRegistry(engine, replica, settings)
    fetched = settings.models_dir / "agent" / "store"
    try:
        for step in range(6):
            path = Path(fake_checkpoint(trainer_settings, step))
            (path / "adapter_config.json").write_text(f'{{"step": {step}}}')
            publish_fake(trainer_settings, trainer, step, str(path))
            await registry.refresh()
        assert sorted(registry.loaded) == [4, 5]
        assert sorted(p.name for p in fetched.iterdir()) == ["0004", "0005"]
        await registry.ensure("agent@1")  # fetched again, for as long as it stays loaded
        assert (fetched / "0001" / "adapter_config.json").read_text() == '{"step": 1}'
    finally:
        trainer.close_sync()
        replica.close_sync()


async def test_a_restarted_gateway_drops_the_copies_its_previous_run_fetched(postgres_db, tmp_path, monkeypatch):
    """On PostgreSQL a replica fetches each step it loads into STATE/models/NAME/store/NNNN and drops
    the copy when it unloads the step; a gateway that stops unloads nothing, so each restart left
    its loaded steps' copies (optimizer state included) behind for good. A restart keeps only the
    copies of what it loads now."""
    from gateway.store.postgres import PostgresStore

    monkeypatch.setattr(adapters_module, "_UNLOAD_GRACE_SECONDS", 0.0)
    trainer = PostgresStore(postgres_db)

    def publish(step: int) -> None:
        checkpoint = tmp_path / "trainer" / f"{step:04d}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "adapter_config.json").write_text("{}")
        (checkpoint / "adapter_model.safetensors").write_bytes(bytes([step]) * 1000)
        trainer.insert_step("agent", step, str(checkpoint), {}, [])

    settings = Settings(state_dir=tmp_path / "gateway", keep_adapters=2, poll_interval=30)
    fetched = settings.models_dir / "agent" / "store"
    for run, steps in enumerate((range(4), range(4, 8))):
        for step in steps:
            publish(step)
        store = PostgresStore(postgres_db)
        registry = AdapterRegistry(FakeEngine(), store, settings)
        await registry.start()
        await registry.close()
        await store.close()  # stopped: nothing unloaded
        assert sorted(registry.loaded) == ([2, 3], [6, 7])[run]
        assert sorted(p.name for p in fetched.iterdir()) == (["0002", "0003"], ["0006", "0007"])[run]
    await trainer.close()


async def test_a_look_at_the_store_the_disk_never_answers_fails_in_time_and_the_next_one_loads(tmp_path):
    # The adapter poll read the store with an unbounded to_thread: on a hung disk it never looked
    # again, said nothing, and held a thread of the loop's default executor for good.
    settings = Settings(state_dir=tmp_path, keep_adapters=2, poll_interval=30)  # refresh() by hand
    store = SQLiteStore(settings.db_path, busy_timeout=0.2)
    publish_fake(settings, store, 0)
    release, real = threading.Event(), store.recent_steps

    def recent_steps(*args):
        release.wait(120)
        return real(*args)

    store.recent_steps = recent_steps  # type: ignore[method-assign]
    registry = AdapterRegistry(FakeEngine(), store, settings)
    try:
        with pytest.raises(StoreUnavailable, match="a read has waited"):
            await asyncio.wait_for(registry.refresh(), 60)  # the guard: without the bound it waits for ever
        release.set()
        await registry.refresh()
        assert registry.current == 0
    finally:
        release.set()
        await store.close()
