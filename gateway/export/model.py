"""`rlproxy export-model NAME@N --out DIR`: a trained step as files other servers load.

Without `--merged` DIR holds the step's PEFT adapter (`adapter_config.json`,
`adapter_model.safetensors`: what `PeftModel.from_pretrained` and vLLM's `--lora-modules`
read), with `base_model_name_or_path` naming the base it was trained on. With `--merged`
DIR holds the base model with the adapter folded into its weights (safetensors, the base's
tokenizer, chat template and generation config): a plain model any server loads.
Either way DIR also gets `training_settings.json` (the settings the step was trained
with, secrets excluded), `trainer_state.json`, the model card `README.md` and
`reward_curve.png`.

Tied embeddings: a model whose output head shares its matrix with the input embeddings
(the built-in tiny model, many small models) and whose adapter has a LoRA on the head
(the tiny model's does, see `trainer.backends.peft.lora_targets`) must be untied before
merging. Folding the head's delta into the shared matrix would change the input
embeddings too, and the merged model would no longer compute what was trained. The merged
model gets its own head and `tie_word_embeddings: false`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gateway.errors import ConfigError, InvalidRequest, NotFound
from gateway.export.records import WRITE_ERRORS
from gateway.models.templates import ORIGINAL
from gateway.redact import masked
from gateway.settings import Settings
from trainer import checkpoints as ckpts
from trainer.backends.base import ADAPTER_FILES

log = logging.getLogger("rlproxy.export")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SETTINGS_FILE = "training_settings.json"


@dataclass(frozen=True)
class ModelExport:
    name: str
    step: int
    out: Path
    merged: bool
    checkpoint: Path


def parse_model_ref(ref: str) -> tuple[str, int | None]:
    """`NAME` (newest step) or `NAME@N`; the name must be a plain model name, since it
    becomes part of a path."""
    name, sep, step = ref.partition("@")
    if not _NAME.fullmatch(name):
        raise InvalidRequest(f"'{name}' is not a model name (letters, digits, '.', '_', '-'): give NAME or NAME@STEP")
    if not sep:
        return name, None
    if not (step.isascii() and step.isdigit()):  # `str.isdigit` also takes "²", which `int` refuses
        raise InvalidRequest(f"'{ref}': the step after @ must be a number, as in {name}@3")
    return name, int(step)


def _recorded_steps(settings: Settings, name: str) -> tuple[set[int], set[int]]:
    """Steps the store records for `name`, and those whose files it keeps (PostgreSQL); both empty
    without a store beside the checkpoints."""
    from gateway.export.selection import close_store, open_store, store_exists

    target = settings.store or settings.db_path
    if not store_exists(target):
        return set(), set()
    store = open_store(target)
    try:
        return {row["step"] for row in store.steps(name)}, store.stored_steps(name)
    finally:
        close_store(store)


def _fetched_from_store(settings: Settings, name: str, step: int, into: Path) -> ckpts.Checkpoint | None:
    """Step `step` of `name` from a PostgreSQL store (`--store`), for a machine that is not the
    trainer's: its files into `into`/NNNN (the export's temporary directory: a copy left in the
    state dir served nothing once the export ended), checksums verified, as replicas fetch
    adapters. None when the store keeps no files (SQLite, or a step without them)."""
    from gateway.export.selection import close_store, open_store

    if not settings.store:
        return None
    store = open_store(settings.store)
    try:
        fetched = store.restore_checkpoint(name, step, ckpts.checkpoint_dir(into, step), ckpts.read_without_optimizer)
    finally:
        close_store(store)
    return ckpts.Checkpoint(step, fetched) if fetched and ckpts.is_complete(fetched) else None


def find_checkpoint(settings: Settings, name: str, step: int | None, fetch_into: Path) -> ckpts.Checkpoint:
    """Step `step` of `name`, or its newest. With a store beside the checkpoints, only steps it
    records count: a checkpoint written by a worker killed before recording it may still be
    discarded when the worker restarts (`trainer.worker`). A step recorded in a PostgreSQL
    store but not on this machine is fetched from the store into `fetch_into`."""
    root = settings.checkpoints_dir(name)
    available = ckpts.list_checkpoints(root)
    recorded, stored = _recorded_steps(settings, name)
    if recorded:
        available = [c for c in available if c.step in recorded]
        wanted = max(recorded) if step is None else step
        if wanted in recorded and all(c.step != wanted for c in available):
            fetched = _fetched_from_store(settings, name, wanted, fetch_into)
            if fetched is not None:
                available = sorted([*available, fetched], key=lambda c: c.step)
    if step is not None:
        for checkpoint in available:
            if checkpoint.step == step:
                return checkpoint
    elif available:
        return available[-1]
    if step is None or not (available or recorded):
        raise NotFound(
            f"no checkpoints of model '{name}' in {root}: pass the --state-dir the trainer ran with"
            " (or the --store it recorded its steps in)"
        )
    # What can be exported: the steps with a checkpoint here or in the store, not every step recorded
    # (those --keep-checkpoints removed keep their rows).
    steps = ", ".join(str(s) for s in sorted({c.step for c in available} | (stored & recorded))) or "none"
    if step in recorded:
        raise NotFound(
            f"step {step} of model '{name}' is recorded, but its checkpoint is not in {root}"
            + (" nor in the store" if settings.store else "")
            + f" (--keep-checkpoints removes old ones); steps with a checkpoint: {steps}"
        )
    raise NotFound(f"model '{name}' has no checkpoint for step {step} in {root} (steps with one: {steps})")


def _prepare_out(out: Path) -> Path:
    """The hidden sibling of `out` the files are written into, renamed to `out` once all are
    there: an export killed half-way (a merge takes minutes) leaves no directory that looks
    like a model to load, nor one that blocks the export from running again."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not empty: choose a new --out directory")
    work = out.parent / f".tmp-{out.name}-{os.getpid()}"
    try:  # a folder on the path that is a file, a read-only disk: one line, not mkdir's traceback
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"cannot write --out {out}: a folder on its path is a file") from None
    except OSError as exc:
        raise ConfigError(f"cannot write --out {out}: {exc.strerror or exc}") from None
    return work


def export_model(settings: Settings, ref: str, out: Path, *, merged: bool = False) -> ModelExport:
    name, step = parse_model_ref(ref)
    # A step fetched from a PostgreSQL store is read from a temporary directory that goes with the
    # command (it was left in STATE/models/NAME/store/ for good, where only a replica's copies belong).
    with tempfile.TemporaryDirectory(prefix="rlproxy-export-") as fetched:
        return _export(settings, name, find_checkpoint(settings, name, step, Path(fetched)), out, merged)


def _export(settings: Settings, name: str, checkpoint: ckpts.Checkpoint, out: Path, merged: bool) -> ModelExport:
    trained_with = masked(checkpoint.settings())  # one saved before every form was masked may hold secrets
    base_model = trained_with.get("base_model", settings.base_model)
    out = Path(out)
    work = _prepare_out(out)
    try:
        if merged:
            write_merged(checkpoint.path, base_model, settings.state_dir, work, _template_for(settings, trained_with))
        else:
            write_adapter(checkpoint.path, base_model, work)
        (work / SETTINGS_FILE).write_text(json.dumps(trained_with, indent=2, sort_keys=True))
        shutil.copyfile(checkpoint.path / ckpts.STATE_FILE, work / ckpts.STATE_FILE)
        from gateway.export.card import write_card

        write_card(
            work,
            settings,
            name=name,
            step=checkpoint.step,
            base_model=base_model,
            trained_with=trained_with,
            merged=merged,
        )
        if out.is_dir():
            out.rmdir()  # empty (checked above): the rename takes its place
        os.rename(work, out)
    except BaseException as exc:
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in WRITE_ERRORS:  # a full disk: one line, and nothing left
            raise ConfigError(f"cannot write --out {out}: {exc.strerror or exc}; nothing was written") from None
        raise
    return ModelExport(name, checkpoint.step, out, merged, checkpoint.path)


def _template_for(settings: Settings, trained_with: dict) -> str | None:
    """The `--chat-template` given, else the one the step was trained with (its tokenizer is the
    merged model's): a missing one is refused, not silently replaced by the base's own."""
    if settings.chat_template or not trained_with.get("chat_template"):
        return settings.chat_template
    trained = str(trained_with["chat_template"])
    if trained != ORIGINAL and not Path(trained).expanduser().is_file():
        raise ConfigError(
            f"the step was trained with --chat-template {trained}, which is not on this machine: give the "
            "template file as --chat-template FILE (or 'original' for the base model's own)"
        )
    return trained


def write_adapter(checkpoint: Path, base_model: str, out: Path) -> None:
    """The PEFT files, with the base named by its id (the checkpoint records the local
    path the trainer loaded it from); the optimizer state stays behind."""
    config = json.loads((checkpoint / ADAPTER_FILES[0]).read_text())
    config["base_model_name_or_path"] = base_model
    (out / ADAPTER_FILES[0]).write_text(json.dumps(config, indent=2, sort_keys=True))
    shutil.copyfile(checkpoint / ADAPTER_FILES[1], out / ADAPTER_FILES[1])


def _output_and_input_names(model) -> tuple[set[str], set[str]]:
    """Module names of the output head and of the input embeddings."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    heads = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is head and n}
    embeds = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is embed and n}
    return heads, embeds


def untie_if_adapted(model, adapter_config: dict) -> bool:
    """Give the output head its own copy of the tied matrix when the adapter changes the
    head or the embeddings; True if it did. (Merging into a shared matrix would apply
    the head's delta to the inputs as well.)"""
    import torch

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return False
    targets = adapter_config.get("target_modules") or []
    targets = {targets} if isinstance(targets, str) else set(targets)
    heads, embeds = _output_and_input_names(model)
    if not (targets & (heads | embeds)):
        return False
    head.weight = torch.nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    if text_config is not None and text_config is not model.config:
        text_config.tie_word_embeddings = False
    return True


def write_merged(
    checkpoint: Path, base_model: str, state_dir: Path, out: Path, chat_template: str | None = None
) -> None:
    """The base with the adapter merged, in the base's own dtype, with its tokenizer carrying the
    chat template in force (`--chat-template`)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gateway.models.registry import resolve_base_model
    from gateway.models.templates import load_tokenizer

    source = resolve_base_model(base_model, state_dir)
    try:
        tokenizer = load_tokenizer(source, chat_template)
        base = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    except OSError as exc:
        raise ConfigError(
            f"cannot load the base model '{base_model}' to merge into: {exc}. It must be "
            "available here (a local path, or a Hugging Face id in the cache)"
        ) from exc
    adapter_config = json.loads((checkpoint / ADAPTER_FILES[0]).read_text())
    if untie_if_adapted(base, adapter_config):
        log.info("the adapter changes a tied output head: the merged model gets its own head")
    model = PeftModel.from_pretrained(base, str(checkpoint), is_trainable=False)
    merged = model.merge_and_unload()
    merged.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
