"""The LoRA adapters a vLLM must serve, and loading them into it.

`POST /v1/load_lora_adapter {"lora_name": "NAME@N", "lora_path": DIR}` and
`POST /v1/unload_lora_adapter {"lora_name": ...}` (vLLM needs
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`). vLLM serves an adapter under its lora_name, so a
request for an adapter is sent with `model = EngineRequest.adapter`.

The set is kept on this side too, so that a vLLM that restarted (or slept) gets every adapter
again: after a restart all of them, after a wake-up those asked for while it slept.
"""

from __future__ import annotations

import logging
from pathlib import Path

import orjson

from gateway.engines.vllm.client import VLLMClient
from gateway.engines.vllm.wire import error_message, maybe_json
from gateway.errors import ConfigError, RLProxyError, UpstreamError

log = logging.getLogger("rlproxy.engines.vllm")

# Modules a LoRA may target for vLLM to load it: the projections. vLLM answers a 500
# ("expected target modules in {q_proj, ...}") to anything else, the output head included.
UNSERVABLE_TARGETS = ("lm_head", "embed_tokens")


class VLLMAdapters:
    """Which adapters vLLM must serve (name -> path), and the loads and unloads that make it so."""

    def __init__(self, client: VLLMClient):
        self.client = client
        self.paths: dict[str, Path] = {}  # name -> path: what must be loaded (re-loaded after a restart)
        self.pending: set[str] = set()  # adapters asked for while asleep
        self.failed: dict[str, str] = {}  # name -> why its last load failed (a replica set routes around it)
        # Known, not loaded: a replica set's step asked for by name loads where a call for it goes.
        self.on_demand: set[str] = set()

    def expect(self, name: str, path: Path) -> None:
        """Know `name` without loading it: the first call for it here loads it (`reload_missing`)."""
        if name not in self.paths:
            self.on_demand.add(name)
        self.paths[name] = path

    def holds(self) -> set[str]:
        """The adapters this vLLM has loaded, as far as the gateway knows."""
        return set(self.paths) - set(self.failed) - self.on_demand - self.pending

    async def load(self, name: str, path: Path, *, ready: bool, asleep: bool) -> None:
        path = Path(path).resolve()
        refuse_unservable_targets(name, path)
        self.paths[name] = path
        self.on_demand.discard(name)  # wanted here now, not only where a call for it goes
        if not ready:
            log.info("vLLM is down; adapter %s will be loaded when it is back", name)
            return
        if asleep:
            # Loading needs the GPU the trainer has now; wake_up() loads it before serving resumes.
            self.pending.add(name)
            return
        await self.post_load(name, path)

    async def unload(self, name: str, *, ready: bool) -> None:
        self.paths.pop(name, None)
        self.failed.pop(name, None)
        self.on_demand.discard(name)
        if name in self.pending:  # asked for while asleep and never loaded
            self.pending.discard(name)
            return
        if not ready:
            return
        status, payload = await self.client.post("/v1/unload_lora_adapter", {"lora_name": name})
        if status not in (200, 404):  # 404: vLLM does not have it (a restart dropped it): already unloaded
            raise UpstreamError(
                f"vLLM could not unload adapter {name} ({status}): {error_message(maybe_json(payload))}"
            )

    async def post_load(self, name: str, path: Path) -> None:
        status, payload = await self.client.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        message = error_message(maybe_json(payload)) or payload.decode(errors="replace")
        if status == 400 and "already been loaded" in message:
            self.failed.pop(name, None)
            self.on_demand.discard(name)
            return  # idempotent: a re-load after a restart race
        if status != 200:
            self.failed[name] = load_error(name, path, status, message)
            raise UpstreamError(self.failed[name])
        self.failed.pop(name, None)
        self.on_demand.discard(name)
        log.info("vLLM at %s loaded adapter %s from %s", self.client.url, name, path)

    async def reload_all(self, *, asleep: bool) -> None:
        """After a restart: load every adapter again (a sleeping vLLM gets them on wake-up), those
        known on demand only when a call asks. Until no new one came meanwhile: a step named while
        this ran is loaded too before the vLLM is ready. One that fails is `failed` (a replica set
        routes around it and retries it)."""
        if asleep:
            # Its LoRA slots are unmapped at sleep level 1: never load into a sleeping vLLM.
            self.pending.update(set(self.paths) - self.on_demand)
            return
        tried: set[str] = set()
        while todo := [name for name in self.paths if name not in tried and name not in self.on_demand]:
            for name in todo:
                tried.add(name)
                if name not in self.paths:  # unloaded meanwhile
                    continue
                try:
                    await self.post_load(name, self.paths[name])
                except RLProxyError as exc:
                    self.failed.setdefault(name, exc.message)
                    log.error("could not re-load adapter %s after a vLLM restart: %s", name, exc.message)

    async def reload_missing(self, adapter: str | None, *, asleep: bool) -> bool:
        """vLLM said 404 for an adapter we loaded: it restarted behind our back. Load it again."""
        if adapter is None or adapter not in self.paths or asleep:
            return False
        if adapter in self.on_demand:
            log.info("loading %s into the vLLM at %s for its first call there", adapter, self.client.url)
        else:
            log.warning("vLLM no longer knows adapter %s (restarted?); loading it again", adapter)
        try:
            await self.post_load(adapter, self.paths[adapter])
        except RLProxyError:
            return False
        return True

    def take_pending(self) -> set[str]:
        """The adapters asked for while vLLM slept; the set starts empty again."""
        pending, self.pending = self.pending, set()
        return pending

    async def load_named(self, names: set[str]) -> None:
        """Load these, in name order, where they are still wanted; each is tried (one that fails is
        `failed`), then the first failure is raised."""
        errors: list[RLProxyError] = []
        for name in sorted(names):
            if name in self.paths:
                try:
                    await self.post_load(name, self.paths[name])
                except RLProxyError as exc:
                    self.failed.setdefault(name, exc.message)
                    errors.append(exc)
        if errors:
            raise errors[0]


def refuse_unservable_targets(name: str, path: Path) -> None:
    """Refuse, with the reason, an adapter vLLM would refuse with a bare 500."""
    try:
        targets = orjson.loads((path / "adapter_config.json").read_bytes()).get("target_modules") or []
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return  # no readable config: vLLM's own answer says what is wrong
    if isinstance(targets, str):
        targets = [targets]
    bad = sorted({t.rsplit(".", 1)[-1] for t in targets} & set(UNSERVABLE_TARGETS))
    if bad:
        raise ConfigError(
            f"adapter {name} ({path}) has a LoRA on {', '.join(bad)}, which vLLM cannot serve (it loads LoRAs on "
            "the attention and MLP projections only); it was trained for the local engine: train with "
            "--engine vllm, whose adapters leave the output head alone"
        )


def load_error(name: str, path: Path, status: int, message: str) -> str:
    """What a failed `/v1/load_lora_adapter` means, in vLLM's terms (vllm/lora/request.py and
    the serving_models load handler): 404 with "No adapter found" is a bad path; a 404 without
    vLLM's error body is the route missing; a 500 naming the rank is `--max-lora-rank`."""
    head = f"vLLM could not load adapter {name} from {path} ({status}): {message}"
    lowered = message.lower()
    if status == 404 and ("no adapter found" in lowered or "loading lora" in lowered):
        return (
            head + "; the path must be a PEFT adapter directory (adapter_config.json + "
            "adapter_model.safetensors) that the vLLM process can read: same machine or a shared path"
        )
    if status in (404, 405):
        return head + (
            "; vLLM has no runtime LoRA routes: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"
        )
    if status >= 500 and "rank" in lowered:
        return head + (
            "; the adapter's rank is above vLLM's --max-lora-rank: restart vLLM with a "
            "--max-lora-rank at least --lora-rank (rlproxy sets it when it starts vLLM)"
        )
    return head
