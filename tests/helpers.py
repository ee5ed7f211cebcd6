"""Shared test helpers: real servers on loopback ports the OS picks."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Server(uvicorn.Server):
    """uvicorn's server, keeping the loop it runs on: a server that does not stop says what holds it."""

    loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)


def _what_holds(server: _Server, thread: threading.Thread) -> str:
    """The server thread's stack and its loop's tasks: what a shutdown waits for."""

    async def task_stacks() -> str:
        return "\n".join(_awaits(task) for task in asyncio.all_tasks() if task is not asyncio.current_task())

    frame = sys._current_frames().get(thread.ident or 0)
    where = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)"
    try:
        assert server.loop is not None
        tasks = asyncio.run_coroutine_threadsafe(task_stacks(), server.loop).result(timeout=5)
    except Exception as exc:  # noqa: BLE001 - the loop itself is blocked: its thread's stack says where
        tasks = f"(tasks not read: {exc!r})"
    connections, running = len(server.server_state.connections), len(server.server_state.tasks)
    return f"{connections} connection(s), {running} task(s) open\nthread:\n{where}\ntasks:\n{tasks}"


def _awaits(task: asyncio.Task) -> str:
    """Where a task waits, down its chain of awaits (Task.print_stack shows only the outermost frame)."""
    lines, awaited = [repr(task)[:200]], task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        frame = frame or getattr(awaited, "ag_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        following = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        following = following or getattr(awaited, "ag_await", None)
        if following is not None and type(following).__name__ in ("async_generator_athrow", "async_generator_asend"):
            # an @asynccontextmanager's exit (a lifespan's `finally`): its generator, named by the caller
            following = getattr(frame.f_locals.get("self") if frame is not None else None, "gen", following)
        awaited = following
    return "\n".join(lines)


class ThreadServer:
    """Runs an ASGI app under uvicorn in a thread; `url` is its base URL. Leaving it stops the server,
    and fails when it has not stopped within `STOP_WITHIN` seconds, saying what holds it: such a
    server went on in the background and cost every test after it."""

    STOP_WITHIN = 60.0

    def __init__(self, app, port: int | None = None):
        self.port = port or free_port()
        self.server = _Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("server thread died during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start in 120 s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=self.STOP_WITHIN)
        if self.thread.is_alive():
            held = _what_holds(self.server, self.thread)
            self.server.force_exit = True
            self.thread.join(timeout=10)
            raise AssertionError(f"the server on port {self.port} did not stop in {self.STOP_WITHIN:.0f} s: {held}")


@contextlib.contextmanager
def gateway_process(
    args: list[str],
    env: dict | None = None,
    port: int | None = None,
    startup_timeout: float = 120.0,
    python_args: tuple[str, ...] = ("-m", "gateway.cli"),
) -> Iterator[tuple[subprocess.Popen, str]]:
    """`rlproxy serve ARGS --port P` as a child process; yields (process, base_url) once /healthz
    answers. `python_args`: how Python runs the CLI (`-c CODE` to set a module's constant first)."""
    port = port or free_port()
    cmd = [sys.executable, *python_args, "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd,
        env=full_env,
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                output = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                raise RuntimeError(f"gateway exited with {proc.returncode}:\n{output[-4000:]}")
            try:
                if httpx.get(url + "/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("gateway did not become healthy in time")
            time.sleep(0.1)
        yield proc, url
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """Stop a child and its process group (trainer workers included); never leave one behind."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Shown in the run's warnings summary: a child that SIGTERM did not stop cost its test this
            # wait (a gateway whose shutdown hangs is a defect of its own).
            command = " ".join(map(str, proc.args))[:200]
            warnings.warn(f"{command} did not stop {timeout:.0f} s after SIGTERM", stacklevel=2)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(timeout=timeout)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
    if proc.stdout:
        proc.stdout.close()


def call_row(call_id: str, session: str, group: str | None, split: str = "train", **fields):
    """A call row as a gateway records it, for the store's own checks (as another replica's call,
    which never went through this process's)."""
    from gateway.store import CallRecord

    values = dict(
        model="m",
        served=None,
        step=None,
        engine="openai",
        stream=False,
        status="ok",
        request={},
        response=None,
        latency_ms=1.0,
    )
    return CallRecord(id=call_id, session_id=session, group_id=group, split=split, **{**values, **fields})


class DropReusedProxy:
    """A TCP proxy to `target_port` that closes a keep-alive connection when a second request
    comes on it, before passing it on: as a server whose idle timeout closed the connection just
    as the client wrote (uvicorn's, so vLLM's: 5 s). The server never sees that request.
    `dropped` counts them; `url` is the proxy's base URL."""

    def __init__(self, target_port: int):
        self.target_port, self.port, self.dropped = target_port, free_port(), 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        answered = asyncio.Event()

        async def back() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await up_reader.read(65536):
                    answered.set()
                    writer.write(data)
                    await writer.drain()
            writer.close()

        relay = asyncio.ensure_future(back())
        try:
            while data := await reader.read(65536):
                if answered.is_set():  # a request on a reused connection: closed, unsent
                    self.dropped += 1
                    break
                up_writer.write(data)
                await up_writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client left, or the proxy stops
        finally:
            relay.cancel()
            writer.close()
            up_writer.close()

    def __enter__(self) -> DropReusedProxy:
        self.thread.start()
        start = asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.server = asyncio.run_coroutine_threadsafe(start, self.loop).result(timeout=30)
        return self

    async def _stop(self) -> None:
        self.server.close()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()
