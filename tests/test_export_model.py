"""`rlproxy export-model`: a step trained on the built-in model, taken out as a PEFT adapter
and as a merged model, checked against peft's own base + adapter computation and served."""

import asyncio
import json
import subprocess
import sys

import openai
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from gateway.models.registry import resolve_base_model
from gateway.store import CallRecord
from tests.helpers import gateway_process
from tests.helpers_trainer import Recorder, trainer_settings
from trainer.worker import run_worker


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two steps of the worker on the tiny model, and one val session answered by step 1."""
    settings = trainer_settings(tmp_path_factory.mktemp("state"))
    recorder = Recorder(settings)
    for gid in ("g1", "g2", "g3", "g4"):
        recorder.group(gid, [1.0, 0.0, 0.5])
    for sid, step, reward in (("val-s0", 1, 0.75), ("val-s1", 1, None), ("val-s2", 2, 0.5)):
        recorder.store.record_call_sync(
            CallRecord(  # scored on the val split: shown on the card, never trained
                id=f"{sid}-call",
                session_id=sid,
                group_id="val-g",
                split="val",
                model="agent",
                served=f"agent@{step}",
                step=step,
                engine="local",
                stream=False,
                status="ok",
                request={"messages": []},
                response={"choices": []},
                latency_ms=1.0,
            )
        )
        if reward is not None:
            asyncio.run(recorder.store.set_reward(sid, reward))
    recorder.close()
    assert run_worker(settings, max_steps=2) == 2
    return settings


def cli(*args):
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True)


def base_model(settings):
    return AutoModelForCausalLM.from_pretrained(
        resolve_base_model(settings.base_model, settings.state_dir), dtype=torch.float32
    ).eval()


PROMPTS = [[1, 5, 9, 22, 40, 7, 300, 12], [3, 3, 100, 250, 17]]


@torch.no_grad()
def logits(model):
    return [model(input_ids=torch.tensor([ids])).logits[0] for ids in PROMPTS]


@pytest.fixture(scope="module")
def merged_dir(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "merged"
    done = cli("export-model", "agent@1", "--out", str(out), "--merged", "--state-dir", str(trained.state_dir))
    assert done.returncode == 0, done.stderr
    return out


def test_adapter_export_loads_with_peft_and_names_its_base(trained, tmp_path):
    out = tmp_path / "adapter"
    done = cli("export-model", "agent", "--out", str(out), "--state-dir", str(trained.state_dir))
    assert done.returncode == 0, done.stderr
    assert "agent@2" in done.stderr  # NAME alone: the newest step
    files = {p.name for p in out.iterdir()}
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "training_settings.json",
        "trainer_state.json",
        "README.md",
        "reward_curve.png",
    } <= files
    assert "optimizer.pt" not in files
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "rlproxy/tiny-qwen2"
    assert json.loads((out / "training_settings.json").read_text())["lora_rank"] == 4

    model = PeftModel.from_pretrained(base_model(trained), out).eval()
    saved = load_file(trained.checkpoints_dir() / "0002" / "adapter_model.safetensors")
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(loaded) == len(saved) > 0
    for name, tensor in saved.items():
        match = [p for n, p in loaded.items() if n.replace(".default", "") == name]
        assert len(match) == 1 and torch.equal(match[0], tensor), name
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_card_holds_the_training_record(trained, merged_dir):
    card = (merged_dir / "README.md").read_text()
    state = json.loads((trained.checkpoints_dir() / "0001" / "trainer_state.json").read_text())
    assert "base_model: rlproxy/tiny-qwen2" in card and "# agent@1" in card
    assert "- groups trained: 2" in card and "- sessions trained: 6" in card
    assert f"- tokens trained: {state['metrics']['tokens']}" in card
    reward_row = (
        f"| 1 | {state['metrics']['reward_mean']:.4g} | {state['metrics']['reward_std']:.4g} | "
        f"{state['metrics']['loss']:.4g} |"
    )
    assert reward_row in card
    assert "| 1 | 0.75 | 1 |" in card  # the val session answered by step 1
    assert "| `lora_rank` | 4 |" in card and "| `loss_type` | grpo |" in card
    rows = [
        line for line in card.split("## Reward")[1].split("## Settings")[0].splitlines() if line.startswith("| 2 |")
    ]
    assert rows == []  # step 2, and val sessions it answered, are not part of agent@1


def test_merged_logits_equal_base_plus_adapter_through_peft(trained, merged_dir):
    reference = PeftModel.from_pretrained(base_model(trained), trained.checkpoints_dir() / "0001").eval()
    want = logits(reference)
    base_logits = logits(base_model(trained))
    # The adapter moves logits (or this test would prove nothing), through the projections alone.
    assert max((w - b).abs().max().item() for w, b in zip(want, base_logits, strict=False)) > 1e-2
    assert not any("lm_head" in n for n, _ in reference.named_parameters() if "lora" in n)

    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    for got, expected in zip(logits(merged), want, strict=False):
        assert (got - expected).abs().max().item() < 1e-4
    # No LoRA on the head or the embeddings: the merged model keeps them tied, and unchanged.
    assert merged.config.tie_word_embeddings is True
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
    assert torch.equal(merged.model.embed_tokens.weight, base_model(trained).model.embed_tokens.weight)
    files = {p.name for p in merged_dir.iterdir()}
    assert "model.safetensors" in files and "adapter_config.json" not in files
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    base_tokenizer = AutoTokenizer.from_pretrained(resolve_base_model(trained.base_model, trained.state_dir))
    assert tokenizer.chat_template == base_tokenizer.chat_template and len(tokenizer) == len(base_tokenizer)


def test_merged_model_serves_the_same_greedy_completion_as_the_step(trained, merged_dir, tmp_path):
    messages = [{"role": "user", "content": "What is the weather in Paris today?"}]

    def greedy(url, model):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=16)
        return reply.choices[0].message.content

    with gateway_process(
        ["--state-dir", str(trained.state_dir), "--trainer", "off", "--lora-rank", "4", "--lora-alpha", "8"]
    ) as (_, url):
        served = [m.id for m in openai.OpenAI(base_url=url + "/v1", api_key="unused").models.list().data]
        assert "agent@1" in served, served
        from_step = greedy(url, "agent@1")
    with gateway_process(
        ["--state-dir", str(tmp_path / "fresh"), "--trainer", "off", "--base-model", str(merged_dir)]
    ) as (_, url):
        from_merged = greedy(url, str(merged_dir))
    assert from_step and from_merged == from_step


def test_bad_references_say_what_to_pass(trained, tmp_path):
    done = cli("export-model", "agent@9", "--out", str(tmp_path / "x"), "--state-dir", str(trained.state_dir))
    assert done.returncode == 2 and "no checkpoint for step 9" in done.stderr and "0, 1, 2" in done.stderr
    done = cli("export-model", "../etc", "--out", str(tmp_path / "y"), "--state-dir", str(trained.state_dir))
    assert done.returncode == 2 and "not a model name" in done.stderr
    done = cli("export-model", "other", "--out", str(tmp_path / "z"), "--state-dir", str(trained.state_dir))
    assert done.returncode == 2 and "--state-dir" in done.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    done = cli("export-model", "agent@1", "--out", str(tmp_path / "full"), "--state-dir", str(trained.state_dir))
    assert done.returncode == 2 and "not empty" in done.stderr
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def _kept_two_of(state_dir, steps: int):
    """A run of `steps` steps (a reward mean of step/10 each) under `--keep-checkpoints 2`."""
    from gateway.settings import Settings
    from gateway.store.sqlite import SQLiteStore
    from trainer import checkpoints as ckpts
    from trainer.resume import prune_checkpoints

    settings = Settings(state_dir=state_dir)
    store, root = SQLiteStore(settings.db_path), settings.checkpoints_dir("agent")
    for step in range(steps):
        metrics = {"reward_mean": step / 10, "tokens": 100} if step else {}
        written = ckpts.write_checkpoint(
            root,
            step,
            lambda d: [(d / name).write_text("{}") for name in ckpts.ADAPTER_FILES],
            settings={},
            metrics=metrics,
            groups=[],
        )
        store.insert_step("agent", step, str(written.path), metrics, [])
        prune_checkpoints(store, "agent", root, 2, step)
    asyncio.run(store.close())
    assert [c.step for c in ckpts.list_checkpoints(root)] == [steps - 2, steps - 1]
    return settings


def test_a_step_keep_checkpoints_removed_is_said_so_with_the_steps_there_are(tmp_path):
    """`--keep-checkpoints 2` removed steps 0 and 1 from disk; their rows stay. Exporting one says it
    was removed and names the steps that can be exported, not every step recorded (which offered
    steps 0 and 1, as for a step the store never had)."""
    state = ("--state-dir", str(_kept_two_of(tmp_path / "state", 4).state_dir))
    done = cli("export-model", "agent@0", "--out", str(tmp_path / "x"), *state)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "step 0 of model 'agent' is recorded, but its checkpoint is not in" in done.stderr
    assert "(--keep-checkpoints removes old ones); steps with a checkpoint: 2, 3\n" in done.stderr
    done = cli("export-model", "agent@9", "--out", str(tmp_path / "x"), *state)
    assert done.returncode == 2 and "has no checkpoint for step 9" in done.stderr
    assert "(steps with one: 2, 3)" in done.stderr


def test_the_model_card_counts_the_steps_whose_checkpoints_were_removed(tmp_path):
    """The card's training record comes from the step rows, which --keep-checkpoints leaves: it read
    the checkpoints on disk, so a step 5 kept with step 4 said 'steps: 2 (1 to 5)' and drew two points."""
    settings = _kept_two_of(tmp_path / "state", 6)
    done = cli("export-model", "agent@5", "--out", str(tmp_path / "out"), "--state-dir", str(settings.state_dir))
    assert done.returncode == 0, done.stderr
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- steps: 5 (1 to 5)" in card and "- tokens trained: 500" in card
    assert [
        line.split(" | ")[1] for line in card.splitlines() if line.startswith("| 1 |") or line.startswith("| 5 |")
    ] == [
        "0.1",
        "0.5",
    ]


def test_an_export_stopped_half_way_leaves_nothing_that_looks_like_a_model(trained, tmp_path, monkeypatch):
    # The files were written straight into --out: an export killed before its card (a merge
    # takes minutes) left the adapter files there, loadable, and the next run was refused.
    from gateway.export import card
    from gateway.export.model import export_model

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    out = tmp_path / "agent-1"
    monkeypatch.setattr(card, "write_card", killed)
    with pytest.raises(KeyboardInterrupt):
        export_model(trained, "agent@1", out)
    assert list(tmp_path.iterdir()) == []

    monkeypatch.undo()
    export_model(trained, "agent@1", out)
    assert {"adapter_model.safetensors", "README.md"} <= {p.name for p in out.iterdir()}
    assert [p.name for p in tmp_path.iterdir()] == ["agent-1"]


def test_a_step_recorded_in_postgres_exports_on_a_machine_without_its_checkpoint(trained, tmp_path, postgres_db):
    """`--store postgresql://`: the step's files come from the store (checksums verified),
    not from a state dir this machine never had."""
    from gateway.store.postgres import PostgresStore

    store = PostgresStore(postgres_db)
    store.insert_step("agent", 2, str(trained.checkpoints_dir() / "0002"), {}, [])  # uploads the files
    asyncio.run(store.close())
    elsewhere = tmp_path / "other-machine"
    out = tmp_path / "adapter"
    done = cli("export-model", "agent", "--out", str(out), "--store", postgres_db, "--state-dir", str(elsewhere))
    assert done.returncode == 0, done.stderr
    assert "agent@2" in done.stderr
    saved = load_file(trained.checkpoints_dir() / "0002" / "adapter_model.safetensors")
    exported = load_file(out / "adapter_model.safetensors")
    assert saved.keys() == exported.keys() and all(torch.equal(saved[k], exported[k]) for k in saved)
    # the fetched copy went with the command: nothing of it stays on this machine
    assert not (elsewhere / "models" / "agent" / "store").exists()
    # a step the store does not record is still a clear 404, naming the steps there are
    done = cli(
        "export-model", "agent@7", "--out", str(tmp_path / "x"), "--store", postgres_db, "--state-dir", str(elsewhere)
    )
    assert done.returncode == 2 and "step 7" in done.stderr and "2" in done.stderr


def test_an_adapter_on_a_tied_head_is_merged_into_a_head_of_its_own(trained, tmp_path):
    # Adapters trained elsewhere may carry a LoRA on the output head. Folding its delta into a
    # matrix the head shares with the input embeddings would change the inputs too: the head
    # gets its own copy first, and the merged model computes what the adapter did.
    from peft import LoraConfig, get_peft_model

    from gateway.export.model import untie_if_adapted

    torch.manual_seed(0)
    adapted = get_peft_model(base_model(trained), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    want = logits(adapted.eval())
    base = base_model(trained)
    assert untie_if_adapted(base, {"target_modules": ["q_proj", "lm_head"]})
    assert not untie_if_adapted(base_model(trained), {"target_modules": ["q_proj", "v_proj"]})
    merged = PeftModel.from_pretrained(base, _save(adapted, tmp_path / "adapter")).merge_and_unload().eval()
    for got, expected in zip(logits(merged), want, strict=False):
        assert (got - expected).abs().max().item() < 1e-4
    assert merged.config.tie_word_embeddings is False
    assert torch.equal(merged.model.embed_tokens.weight, base_model(trained).model.embed_tokens.weight)


def _save(model, directory):
    model.save_pretrained(directory, save_embedding_layers=False)
    return directory
