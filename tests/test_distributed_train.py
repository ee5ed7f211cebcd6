"""`rlproxy train --nproc 2`: two ranks (gloo on CPU, the rendezvous on loopback) train the step one process
trains, write the same step rows and checkpoints, resume with another number of processes, and end
the run cleanly when a rank dies mid-step: the claim is given back with the attempt counted, and a
restart trains the groups.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import free_port
from tests.helpers_trainer import Recorder, tiny_gpt2, trainer_settings

FLAGS = [
    "--groups-per-step", "2", "--lora-rank", "4", "--lora-alpha", "8", "--learning-rate", "1e-3",
    "--max-tokens-per-row", "256", "--poll-interval", "0.05",
]  # fmt: skip


def fill(state_dir: Path, names: tuple[str, ...]) -> None:
    """Closed, rewarded groups of uneven sizes, recorded as the local engine records them."""
    recorder = Recorder(trainer_settings(state_dir))
    try:
        for index, name in enumerate(names):
            recorder.group(name, [1.0, 0.0, 0.5, 0.2, 0.9][: 3 + index % 3])
    finally:
        recorder.close()


def train(state_dir: Path, *extra: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "train", "--state-dir", str(state_dir), *FLAGS, *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def checkpoint(state_dir: Path, step: int) -> Path:
    return state_dir / "models" / "agent" / "checkpoints" / f"{step:04d}"


def assert_same_adapter(got: Path, want: Path) -> None:
    got_weights, want_weights = (
        load_file(got / "adapter_model.safetensors"),
        load_file(want / "adapter_model.safetensors"),
    )
    assert got_weights.keys() == want_weights.keys()
    for key in want_weights:
        torch.testing.assert_close(got_weights[key], want_weights[key], atol=1e-5, rtol=0, msg=key)


def rows(state_dir: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(state_dir / "rlproxy.db") as conn:
        return conn.execute(sql).fetchall()


def test_two_processes_train_the_step_one_process_trains_and_either_resumes_the_other(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for state_dir in (one, two):
        fill(state_dir, ("alpha", "beta"))

    alone = train(one, "--max-steps", "1")
    assert alone.returncode == 0, alone.stderr[-3000:]
    together = train(two, "--max-steps", "1", "--nproc", "2")
    assert together.returncode == 0, together.stderr[-3000:]
    assert "trainer rank 1 of 2" in together.stderr

    assert_same_adapter(checkpoint(two, 1), checkpoint(one, 1))
    steps = rows(two, "SELECT step, json_extract(metrics, '$.ranks') FROM steps ORDER BY step")
    assert steps == [(0, None), (1, 2.0)]  # one row per step, the one trained by two ranks
    assert rows(one, "SELECT step FROM steps ORDER BY step") == [(0,), (1,)]
    assert sorted(os.listdir(checkpoint(two, 1))) == sorted(os.listdir(checkpoint(one, 1)))

    # The next step, on the other number of processes each: the files are the same, so are the steps.
    for state_dir in (one, two):
        fill(state_dir, ("gamma", "delta"))
    assert train(one, "--max-steps", "1", "--nproc", "2").returncode == 0
    assert train(two, "--max-steps", "1").returncode == 0
    assert_same_adapter(checkpoint(two, 2), checkpoint(one, 2))


def listening_addresses(launcher_pid: int) -> list[str]:
    """The addresses the launcher and its ranks listen on (TCP)."""
    tree = [psutil.Process(launcher_pid), *psutil.Process(launcher_pid).children(recursive=True)]
    return [c.laddr.ip for p in tree for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]


def test_a_rank_killed_mid_step_ends_the_run_and_a_restart_continues(tmp_path):
    state_dir = tmp_path / "state"
    fill(state_dir, ("alpha", "beta"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "train", "--state-dir", str(state_dir), *FLAGS, "--nproc", "2"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RLPROXY_TEST_PAUSE_AT": "follower", "RLPROXY_TEST_PAUSE_SECONDS": "300"},
    )
    try:
        log = []
        assert proc.stderr is not None
        for line in proc.stderr:  # rank 1 pauses as its first step begins; rank 0 waits for it inside the step
            log.append(line)
            if line.startswith("rlproxy-test-pause: follower"):
                listening = listening_addresses(proc.pid)
                os.kill(int(line.rsplit("pid ", 1)[1].rstrip(")\n")), signal.SIGKILL)
                break
        else:
            pytest.fail("rank 1 never reached its step:\n" + "".join(log[-40:]))
        log.append(proc.stderr.read())
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(log)
    # The rendezvous store and gloo's sockets: on loopback only, none reachable from another machine.
    assert listening and all(host == "127.0.0.1" for host in listening), listening
    assert code != 0
    assert "the team broke" in output  # rank 0's reason
    assert "rank 1 exit code -9" in output  # the launcher's summary
    claimed, attempts, error = rows(
        state_dir, "SELECT COUNT(claimed_step), SUM(attempts), MAX(last_error) FROM groups"
    )[0]
    assert claimed == 0  # given back ...
    assert attempts == 2  # ... with the attempt counted, one per group
    assert "the team broke" in error
    assert rows(state_dir, "SELECT COUNT(*) FROM steps WHERE step > 0") == [(0,)]

    again = train(state_dir, "--max-steps", "1", "--nproc", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert rows(state_dir, "SELECT step FROM steps ORDER BY step") == [(0,), (1,)]
    assert rows(state_dir, "SELECT COUNT(*) FROM groups WHERE trained_step = 1") == [(2,)]


def test_under_torchrun_each_rank_joins_the_run_torchrun_started(tmp_path):
    """The many-machine recipe (deploy/README.md) on one machine: torchrun sets the ranks, no --nproc."""
    state_dir = tmp_path / "state"
    fill(state_dir, ("alpha", "beta"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "gateway.cli", "train"]
    done = subprocess.run(
        [*cmd, "--state-dir", str(state_dir), *FLAGS, "--max-steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trainer rank 1 of 2" in done.stderr
    assert rows(state_dir, "SELECT step, json_extract(metrics, '$.ranks') FROM steps ORDER BY step") == [
        (0, None),
        (1, 2.0),
    ]


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_ADDR, MASTER_PORT are not set"),
        ({"WORLD_SIZE": "2"}, "RANK, MASTER_ADDR, MASTER_PORT are not set"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "RANK=2 is not a rank"),
    ],
)
def test_a_torchrun_environment_set_by_half_is_refused_with_what_is_missing(tmp_path, env, says):
    """WORLD_SIZE exported by hand (a copied torchrun line, a leftover variable): a clear error, no traceback."""
    done = train(tmp_path / "state", "--max-steps", "1", env=env, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert says in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("rank", ["0", "1"])
def test_ranks_that_never_meet_end_with_the_address_not_a_traceback(tmp_path, rank):
    """Rank 0 with no one else coming, or rank 1 with no one at the address: a clear error after --dist-timeout."""
    env = {"WORLD_SIZE": "2", "RANK": rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = train(tmp_path / "state", "--max-steps", "1", "--dist-timeout", "2", env=env, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"training rank {rank} of 2: the ranks did not all meet at 127.0.0.1:{env['MASTER_PORT']}" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_gloo_interface_this_machine_lacks_is_named_not_blamed_on_the_rendezvous(tmp_path):
    """GLOO_SOCKET_IFNAME set to an interface this machine does not have: each rank says so at once,
    where it said the ranks "did not all meet at 127.0.0.1 within --dist-timeout 900 s"."""
    done = train(tmp_path / "state", "--max-steps", "1", "--nproc", "2", env={"GLOO_SOCKET_IFNAME": "nosuch0"})
    assert done.returncode == 2, done.stderr[-3000:]
    # the rank that fails first says it; the launcher may stop the other before it does
    assert "of 2: GLOO_SOCKET_IFNAME='nosuch0' names no network interface of this machine" in done.stderr
    assert "did not all meet" not in done.stderr and "Traceback" not in done.stderr


# What gloo said in a run of two ranks on two network namespaces (two machines joined by a veth
# pair; the rendezvous at rank 0's veth address), with GLOO_SOCKET_IFNAME unset on hosts whose
# hostname resolves to 127.0.0.1: each rank advertised loopback, so neither reached the other.
GLOO_ACROSS_LOOPBACK = {
    0: "Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] "
    "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:14771$0",
    1: "Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.h:311] "
    "Connect timeout [none]",
}


@pytest.mark.parametrize("rank", [0, 1])
def test_ranks_that_met_but_cannot_connect_are_told_to_set_the_interface(rank, monkeypatch):
    import socket

    from trainer.distributed.team import not_met

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "trainer-1")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # Debian's /etc/hosts line
    broken = not_met(RuntimeError(GLOO_ACROSS_LOOPBACK[rank]), rank, 2, "10.77.0.1:29411", 30)
    assert broken.message.startswith(f"training rank {rank} of 2: the ranks met at 10.77.0.1:29411 but could not")
    assert "listened on 127.0.1.1, where hostname 'trainer-1' resolves: a loopback address" in broken.message
    assert "set GLOO_SOCKET_IFNAME (and, on GPUs, NCCL_SOCKET_IFNAME) on every machine" in broken.message

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")  # an interface that exists, but not the one they share
    broken = not_met(RuntimeError(GLOO_ACROSS_LOOPBACK[rank]), rank, 2, "10.77.0.1:29411", 30)
    assert "listened on GLOO_SOCKET_IFNAME=eth1's address" in broken.message


def test_sigterm_ends_a_rank_still_waiting_for_the_others(tmp_path):
    """A rank waits for the others inside torch (up to --dist-timeout) where the trainer's own handler,
    which lets a step finish, never runs: a stop (systemd, Kubernetes, the launcher) ends it there at once."""
    env = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, "-m", "gateway.cli", "train", "--state-dir", str(tmp_path / "state"), "--max-steps", "1"]
    proc = subprocess.Popen(
        [*cmd, "--dist-timeout", "600"], stderr=subprocess.PIPE, text=True, env={**os.environ, **env}
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "meeting the others at" in line:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == -signal.SIGTERM  # not after the 600 s --dist-timeout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_shard_full_trains_a_model_whose_layers_are_not_named_layers(tmp_path):
    """FSDP2's units are the model's blocks wherever it keeps them: `--shard full` on GPT-2 trains what DDP trains."""
    model = tiny_gpt2(tmp_path)
    ddp, full = tmp_path / "ddp", tmp_path / "full"
    for state_dir, shard in ((ddp, "none"), (full, "full")):
        fill(state_dir, ("alpha", "beta"))
        done = train(state_dir, "--base-model", str(model), "--max-steps", "1", "--nproc", "2", "--shard", shard)
        assert done.returncode == 0, done.stderr[-3000:]
    assert_same_adapter(checkpoint(full, 1), checkpoint(ddp, 1))


def test_shard_full_refuses_a_model_without_layers_to_split():
    from gateway.errors import ConfigError
    from trainer.distributed.wrap import decoder_layers

    with pytest.raises(ConfigError, match="has no list of layers"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
