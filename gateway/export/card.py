"""The model card written beside an exported step: `README.md` and `reward_curve.png`.

Train figures come from the store's step rows (each holds its step's metrics and groups, and
stays when --keep-checkpoints removes the checkpoint), or without a store from the checkpoints
themselves (each `trainer_state.json` holds them too), so a card can be written from a copied
checkpoint directory; val figures (sessions sent with `X-Split: val`, scored and never trained)
come from the store when it is there, grouped by the adapter step that answered them.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from pathlib import Path

from gateway.errors import NotFound
from gateway.settings import Settings
from trainer import checkpoints as ckpts

CURVE_FILE = "reward_curve.png"
_SETTINGS_SHOWN = (
    "loss_type",
    "learning_rate",
    "groups_per_step",
    "epsilon",
    "epsilon_high",
    "beta",
    "scale_rewards",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "max_tokens_per_row",
    "epochs_per_step",
    "max_grad_norm",
    "seed",
    "backend",
)


def train_history(settings: Settings, name: str, up_to: int) -> list[dict]:
    """Metrics of steps 1..up_to: from the store's step rows where a store records them (they stay
    when --keep-checkpoints removes the checkpoints, and a machine that fetched the step from a
    PostgreSQL store has no others), else from the checkpoints on disk."""
    recorded = _recorded_history(settings, name, up_to)
    if recorded:
        return recorded
    rows = []
    for checkpoint in ckpts.list_checkpoints(settings.checkpoints_dir(name)):
        if 1 <= checkpoint.step <= up_to:
            state = checkpoint.state()
            rows.append({"step": checkpoint.step, **state.get("metrics", {}), "group_ids": state.get("groups", [])})
    return rows


def _recorded_history(settings: Settings, name: str, up_to: int) -> list[dict]:
    """What `train_history` reads from the step rows (the same metrics and groups each checkpoint saved)."""
    from gateway.export.selection import close_store, open_store, store_exists

    target = settings.store or settings.db_path
    if not store_exists(target):
        return []
    store = open_store(target)
    try:
        steps = store.steps(name)
    finally:
        close_store(store)
    return [{"step": r["step"], **r["metrics"], "group_ids": r["groups"]} for r in steps if 1 <= r["step"] <= up_to]


def store_figures(settings: Settings, name: str, up_to: int, trained_groups: set[str]) -> dict:
    """Sessions trained on and val rewards by the step that answered them (empty without a store)."""
    from gateway.export.selection import close_store, open_store, select_sessions, store_exists
    from gateway.store import SessionFilter
    from trainer.data import sampling_step

    target = settings.store or settings.db_path
    if not store_exists(target):
        return {}
    store = open_store(target)
    try:
        trained_sessions = 0
        for group_id in trained_groups:
            with contextlib.suppress(NotFound):  # a group this store does not hold counts none
                trained_sessions += store.get_group(group_id)["n_sessions"]
        val: dict[int, list[float]] = defaultdict(list)
        for session in select_sessions(store, SessionFilter(split="val", rewarded=True)):
            if session["model"] != name:
                continue
            step = sampling_step([c for c in session["calls"] if c.get("status") == "ok"])
            if step <= up_to:
                val[step].append(float(session["reward"]))
    finally:
        close_store(store)
    return {"trained_sessions": trained_sessions, "val": dict(sorted(val.items()))}


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def plot_curve(history: list[dict], val: dict[int, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history]
    means = [h.get("reward_mean", float("nan")) for h in history]
    stds = [h.get("reward_std", 0.0) or 0.0 for h in history]
    ax.plot(steps, means, marker="o", label="train reward (mean of the step's groups)")
    lows = [m - s for m, s in zip(means, stds, strict=True)]
    highs = [m + s for m, s in zip(means, stds, strict=True)]
    ax.fill_between(steps, lows, highs, alpha=0.2)
    if val:
        ax.plot(list(val), [sum(v) / len(v) for v in val.values()], marker="s", label="val reward (by answering step)")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_card(
    out: Path, settings: Settings, *, name: str, step: int, base_model: str, trained_with: dict, merged: bool
) -> None:
    history = train_history(settings, name, step)
    groups = {g for h in history for g in h["group_ids"]}
    figures = store_figures(settings, name, step, groups)
    val = figures.get("val", {})
    plot_curve(history, val, out / CURVE_FILE, f"{name}@{step} on {base_model}")

    tokens = sum(int(h.get("tokens", 0) or 0) for h in history)
    what = "the base model with the adapter merged into its weights" if merged else "a PEFT LoRA adapter"
    lines = [
        "---",
        f"base_model: {base_model}",
        "library_name: " + ("transformers" if merged else "peft"),
        "tags: [rlproxy, grpo, lora, reinforcement-learning]",
        "---",
        "",
        f"# {name}@{step}",
        "",
        f"{what.capitalize()}: step {step} of model `{name}`, trained by rlproxy (GRPO with LoRA) "
        f"on `{base_model}` from its own recorded agent traffic.",
        "",
        "## Training data",
        "",
        f"- steps: {len(history)} (1 to {step})" if history else "- steps: none (the untrained step 0 adapter)",
        f"- groups trained: {len(groups)}",
        f"- sessions trained: {figures['trained_sessions']}"
        if "trained_sessions" in figures
        else "- sessions trained: (no store found beside the checkpoints)",
        f"- tokens trained: {tokens}",
        f"- val sessions scored: {sum(len(v) for v in val.values())}",
        "",
        "## Reward",
        "",
        f"![reward curve]({CURVE_FILE})",
        "",
        "| step | reward mean | reward std | loss | kl | clip fraction | groups | tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for h in history:
        lines.append(
            "| "
            + " | ".join(
                _fmt(h.get(k))
                for k in ("step", "reward_mean", "reward_std", "loss", "kl", "clip_fraction", "groups", "tokens")
            )
            + " |"
        )
    if val:
        lines += [
            "",
            "Val (sessions sent with `X-Split: val`, never trained on), by the step that answered them:",
            "",
            "| step | val reward mean | sessions |",
            "|---|---|---|",
        ]
        lines += [f"| {s} | {_fmt(sum(v) / len(v))} | {len(v)} |" for s, v in val.items()]
    lines += ["", "## Settings", "", "| setting | value |", "|---|---|"]
    lines += [f"| `{k}` | {_fmt(trained_with.get(k))} |" for k in _SETTINGS_SHOWN if k in trained_with]
    lines += [
        "",
        "All settings: `training_settings.json`; the step's own metrics: `trainer_state.json`.",
        "",
        "## Use",
        "",
    ]
    if merged:
        lines += [
            "```bash",
            "vllm serve ./THIS_DIR            # or any OpenAI-compatible server",
            "rlproxy serve --base-model ./THIS_DIR",
            "```",
        ]
    else:
        lines += [
            "```bash",
            f"vllm serve {base_model} --enable-lora --lora-modules {name}=./THIS_DIR",
            "```",
            "",
            "```python",
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM",
            f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('{base_model}'), './THIS_DIR')",
            "```",
        ]
    (out / "README.md").write_text("\n".join(lines) + "\n")
