"""The flags that take rlproxy past one engine and one GPU: vLLM replicas (gateway/engines/vllm/
replicas.py), the devices of each process (gateway/devices.py) and the distributed trainer
(trainer/distributed/). Mixins of `gateway.settings.Settings`, kept apart for its size."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from gateway.settings_bounds import A_WEEK


class ReplicaSettings(BaseModel):
    """Several vLLM replicas behind one gateway (gateway/engines/vllm/replicas.py) and which devices
    each process gets (gateway/devices.py): flags of `Settings`, in a class of their own for its size."""

    vllm_replicas: int = Field(
        1, ge=1, le=64, description="vLLM servers rlproxy starts (each its own process, socket or port, and log)"
    )
    vllm_devices: str | None = Field(
        None,
        description="the GPUs of each vLLM rlproxy starts, replicas split by ';' (0,1;2,3: two replicas of two "
        "GPUs); default: the GPU --gpu-mode picks, for one replica",
    )
    trainer_devices: str | None = Field(
        None,
        description="the trainer's GPUs (0 or 2,3), its CUDA_VISIBLE_DEVICES whether the gateway starts it or "
        "`rlproxy train` runs by hand; checked against --vllm-devices",
    )
    routing: Literal["affinity", "least-loaded", "round-robin"] = Field(
        "affinity",
        description="how calls pick a vLLM replica: affinity keeps a session on one (its prompt prefix is cached "
        "there) within a load bound; least-loaded and round-robin ignore the session",
    )


class TrainingScaleSettings(BaseModel):
    """The trainer on several processes (`trainer.distributed`): one device each, rank 0 alone
    talks to the store."""

    nproc: int = Field(
        1,
        ge=1,
        le=1024,
        description="training processes on this machine (torch.distributed: gloo on CPU, NCCL on CUDA), one "
        "device each; under torchrun the launcher's WORLD_SIZE wins",
    )
    shard: Literal["none", "full"] = Field(
        "none",
        description="with several training processes: none (DDP, every rank holds the whole model) or full "
        "(FSDP2: the base model's weights split across ranks, for models that do not fit one device)",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="recompute each decoder layer's activations in the backward pass instead of keeping them "
        "(--backend peft; unsloth always does): much less memory for long rows, about a third more compute",
    )
    dist_timeout: float = Field(
        900.0,
        gt=0,
        le=A_WEEK,
        description="seconds a training rank waits for the others (a step, or the next command) before it ends "
        "the run with the reason; above the colocated GPU lease's 600 s wait",
    )
