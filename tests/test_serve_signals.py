"""`rlproxy serve --trainer auto` stopped by a signal: the gateway shuts down and stops its
trainer child before it exits, so no trainer goes on alone with the GPU and the state dir."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from tests.helpers import gateway_process


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(line) for line in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_the_trainer_child_before_the_gateway_exits(tmp_path):
    # uvicorn re-raises the SIGTERM after its shutdown, which ended the process before
    # `rlproxy serve` stopped its trainer: the trainer went on alone, mid-step.
    flags = ["--engine", "local", "--trainer", "auto", "--state-dir", str(tmp_path), "--insecure-no-api-key"]
    with gateway_process(flags, startup_timeout=300) as (proc, _url):
        while not (tmp_path / "models" / "agent" / "checkpoints" / "0000").exists():  # the trainer's loop runs
            assert proc.poll() is None
            time.sleep(0.2)
        (trainer,) = children(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)  # to the gateway alone, as `kill PID` or systemd's stop
        assert proc.wait(timeout=120) == -signal.SIGTERM  # shut down, then the signal re-raised (uvicorn)
        assert not alive(trainer)
