"""`rlproxy serve --trainer auto` stopped by a signal: the gateway shuts down and stops its
trainer child before it exits, so no trainer goes on alone with the GPU and the state dir."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from tests.fake_upstream import FakeUpstream
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
        assert proc.wait(timeout=120) == 0  # shut down cleanly: not -15 (uvicorn re-raised the signal)
        assert not alive(trainer)


def test_a_clean_shutdown_on_sigterm_exits_with_0(tmp_path):
    """`kill PID`, systemd's stop, `docker stop`, a Kubernetes rolling update: SIGTERM, a graceful
    shutdown, then status 0, as after Ctrl-C. uvicorn re-raised the signal and the process ended
    with -15 (143 in a shell), which they count as a failure."""
    with FakeUpstream() as upstream:
        flags = ["--engine", "openai", "--upstream-url", upstream.url, "--trainer", "off", "--state-dir", str(tmp_path)]
        for sig in (signal.SIGTERM, signal.SIGINT):
            with gateway_process(flags) as (proc, _url):
                os.kill(proc.pid, sig)
                assert proc.wait(timeout=60) == 0
                assert "Application shutdown complete" in proc.stdout.read().decode(errors="replace")
