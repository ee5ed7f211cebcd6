"""The vLLM supervisor's own tasks, against stand-ins for vLLM's process, client and adapters:
nothing it started outlives `stop()` (a restart begun by a lost connection included)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.engines.vllm.supervisor import VLLMSupervisor


class Process:
    """A managed vLLM that died, and whose restart waits until the test lets it go on."""

    def __init__(self):
        self.running, self.returncode, self.log_path = False, 1, Path("vllm.log")
        self.restarting, self.go_on = asyncio.Event(), asyncio.Event()
        self.closed, self.started_after_close = False, 0

    async def start(self, healthy) -> None:
        self.restarting.set()
        await self.go_on.wait()
        self.started_after_close += self.closed
        self.running = True

    async def stop(self) -> None:
        self.running = False

    async def close(self) -> None:
        self.closed, self.running = True, False


class Client:
    url = "http://127.0.0.1:9"

    async def healthy(self) -> bool:
        return False


class Adapters:
    paths: dict = {}

    async def reload_all(self, asleep: bool) -> None:
        return None


async def test_a_restart_a_lost_connection_began_is_stopped_with_the_supervisor():
    process = Process()
    supervisor = VLLMSupervisor(Client(), process, Adapters(), health_interval=3600, max_restarts=1)
    supervisor.serve()
    error = supervisor.connection_lost(ConnectionError("reset by peer"))
    assert "restarting" in error.message
    await process.restarting.wait()  # the recovery is under way: vLLM is being started again

    await supervisor.stop()
    process.go_on.set()  # had the restart outlived stop(), it would now start a vLLM nobody stops
    for _ in range(5):
        await asyncio.sleep(0)
    assert process.closed and not process.running and process.started_after_close == 0
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
