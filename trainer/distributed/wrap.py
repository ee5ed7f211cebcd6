"""How the ranks share one model: DDP (`--shard none`) or FSDP2's `fully_shard` (`--shard full`).

Both reduce the LoRA gradients themselves (an all-reduce under DDP, a reduce-scatter under FSDP2)
and both average them over the ranks; the trainer's loss is a sum over the whole batch divided by
batch-wide counts, so each rank scales its loss by the world size (`loss_scale`) and the average
becomes that sum. Gradients accumulate over a rank's rows without communication; the last
backward of the step (`sync(last=True)`) reduces them once.

Files stay those of one process: `full_state` gathers the adapter and the AdamW moments whole on
rank 0, in the order and format `torch.optim.Optimizer.state_dict` gives one process, and
`set_full_state` puts such a state back on every rank (each keeping its shard under FSDP2), so a
checkpoint resumes with any number of ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from trainer.distributed.team import Team


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly sharded) tensor this rank holds."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a sharded one), detached, on the CPU."""
    full_tensor = getattr(tensor, "full_tensor", None)
    whole = full_tensor() if full_tensor is not None else tensor
    return whole.detach().to("cpu", copy=True)


def _like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `param` is: this rank's shard of it for a sharded parameter (each rank
    cuts its own from its copy: no communication)."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return full.to(param.device, dtype=param.dtype if full.is_floating_point() else full.dtype)
    from torch.distributed.tensor import distribute_tensor

    value = full.to(_local(param).device, dtype=param.dtype if full.is_floating_point() else full.dtype)
    return distribute_tensor(value, mesh, param.placements, src_data_rank=None)  # type: ignore[attr-defined]


def _timed_allreduce(team: Team, bucket: Any) -> Any:
    """DDP's own all-reduce (the average over the ranks), its seconds counted on `team`."""
    import time

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    started = time.perf_counter()

    def done(future: Any) -> Any:
        team.count("allreduce", time.perf_counter() - started)
        return future.value()

    return allreduce_hook(None, bucket).then(done)  # type: ignore[arg-type]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, `--shard full`'s units: the `nn.ModuleList` holding the most
    weights (`model.layers` in Llama, Qwen2, Mistral; `transformer.h` in GPT-2)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    weights = [sum(p.numel() for p in m.parameters()) for m in lists]
    if not lists or max(weights) == 0:
        from gateway.errors import ConfigError

        raise ConfigError(
            f"--shard full splits a model layer by layer, and {type(model).__name__} has no list of layers "
            "(an nn.ModuleList of blocks) to split: use --shard none (DDP), which holds the whole model on each rank"
        )
    return list(lists[weights.index(max(weights))])


class Replication:
    """One model on every rank of `team`: `forward_model` runs the trained forwards, `sync` says
    when gradients are reduced."""

    def __init__(self, model: torch.nn.Module, team: Team) -> None:
        self.team = team
        self.model = model
        if team.shard == "full":
            self.forward_model = self._fully_shard(model, team)
        else:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [team.device.index] if team.device.type == "cuda" else None
            # Buffers (rotary tables) are the same on every rank: no broadcast before each forward.
            self.forward_model = DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)
            # A lambda: DDP checks a hook's annotations against its own types, and this module's are strings.
            self.forward_model.register_comm_hook(team, lambda state, bucket: _timed_allreduce(state, bucket))

    @staticmethod
    def _fully_shard(model: torch.nn.Module, team: Team) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(team.device.type, (team.world_size,))
        # One unit per decoder layer (its weights gathered just before its forward and freed after),
        # then the rest (embeddings, norm, head) at the root. The LoRA weights must be in those units:
        # FSDP2 keeps the root's weights gathered from one forward to the next, so a root gathered in
        # the no-grad forward (pi_old) gives the trained forward weights without autograd.
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    @property
    def loss_scale(self) -> float:
        """What each rank's loss is multiplied by so that the library's average is the batch's sum."""
        return float(self.team.world_size)

    @contextlib.contextmanager
    def sync(self, last: bool) -> Iterator[None]:
        """Reduce gradients in this backward only when it is the rank's last of the step."""
        if self.team.shard == "full":
            self.forward_model.set_requires_gradient_sync(last)  # type: ignore[operator]
            yield
            return
        with contextlib.nullcontext() if last else self.forward_model.no_sync():  # type: ignore[operator]
            yield

    # -- the state, whole
    def full_state(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict | None:
        """The adapter's parameters and the optimizer state, whole, on rank 0 (None elsewhere).
        A collective: every rank calls it."""
        with self.team.collective("gathering the adapter"):
            weights = [_full(p) for p in params]
            state: dict[int, dict[str, Any]] = {}
            for index, param in enumerate(params):
                saved = optimizer.state.get(param, {})
                state[index] = {key: _full(value) for key, value in saved.items()}
        if not self.team.is_leader:
            return None
        groups = optimizer.state_dict()["param_groups"]
        return {
            "params": weights,
            "optimizer": {"state": {i: s for i, s in state.items() if s}, "param_groups": groups},
        }

    def set_full_state(
        self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, weights: list, saved: dict | None
    ) -> None:
        """Put back a state `full_state` (or one process's `optimizer.state_dict()`) describes."""
        import torch

        with torch.no_grad():
            for param, value in zip(params, weights, strict=True):
                _local(param).copy_(_local(_like(value, param)))
        optimizer.state.clear()
        if saved is None:
            return
        for index, values in saved.get("state", {}).items():
            param = params[int(index)]
            optimizer.state[param] = {
                key: (_like(value, param) if value.dim() > 0 else value.clone()) for key, value in values.items()
            }
