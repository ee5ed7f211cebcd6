"""Test helpers for the vllm engine: the fake vLLM in a thread or as a process, adapters, a gateway."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from gateway.engines.vllm.engine import VLLMEngine
from gateway.engines.vllm.server import socket_of
from gateway.settings import Settings
from tests.fake_vllm import FakeState, create_fake_vllm
from tests.helpers import ThreadServer, free_port, stop_process

BASE = "Qwen/Qwen2.5-0.5B-Instruct"
FAKE_VLLM = Path(__file__).resolve().parent / "fake_vllm.py"
# `vllm` replaced by the fake: the engine runs `python tests/fake_vllm.py serve BASE --port ...`.
FAKE_LAUNCHER = [sys.executable, str(FAKE_VLLM)]


@contextlib.contextmanager
def fake_vllm_thread(**state) -> Iterator[tuple[ThreadServer, FakeState]]:
    fake = FakeState(base_model=BASE, **state)
    with ThreadServer(create_fake_vllm(fake)) as server:
        yield server, fake


@contextlib.contextmanager
def fake_vllm_process(port: int, *, sleep_mode: bool = True, log_path: Path | None = None) -> Iterator[str]:
    """`fake vllm serve` as a child process set up like rlproxy sets up vLLM; yields its URL."""
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    if sleep_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    cmd = [
        *FAKE_LAUNCHER,
        "serve",
        BASE,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--generation-config",
        "vllm",
        "--logprobs-mode",
        "processed_logprobs",
        *(["--enable-sleep-mode"] if sleep_mode else []),
    ]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        stop_process(proc)
        if log_path:
            out.close()


def vllm_http(url: str) -> httpx.Client:
    """An httpx client for the vLLM at `url`: http://HOST:PORT, or unix:PATH (its socket)."""
    path = socket_of(url)
    if path is None:
        return httpx.Client(base_url=url)
    return httpx.Client(base_url="http://localhost", transport=httpx.HTTPTransport(uds=path))


def fake_vllm_on_path(bin_dir: Path) -> str:
    """A `vllm` executable in `bin_dir` that is the fake server; returns a PATH that finds it first."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "vllm").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_VLLM}" "$@"\n')
    (bin_dir / "vllm").chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"fake vLLM exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError), vllm_http(url) as client:
            if client.get("/health", timeout=1.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"fake vLLM at {url} did not become healthy")
        time.sleep(0.05)


def fake_state(url: str) -> dict:
    with vllm_http(url) as client:
        return client.get("/fake/state", timeout=5).json()


def script_fake(url: str, **script) -> None:
    with vllm_http(url) as client:
        client.post("/fake/script", json=script, timeout=5).raise_for_status()


def make_adapter(root: Path, name: str, rank: int = 16) -> Path:
    """A directory vLLM's loader (here: the fake) accepts as a PEFT adapter."""
    path = root / name.replace("@", "_at_")
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "base_model_name_or_path": BASE})
    )
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


def vllm_settings(tmp_path: Path, **overrides) -> Settings:
    values = dict(
        engine="vllm",
        base_model=BASE,
        state_dir=tmp_path / "state",
        model_name="agent",
        gpu_mode="dedicated",
        trainer="off",
        poll_interval=0.1,
    )
    values.update(overrides)
    return Settings(**values)


def attached_engine(url: str, **kwargs) -> VLLMEngine:
    engine = VLLMEngine(BASE, url=url, **kwargs)
    engine.supervisor.health_interval = 0.1
    return engine


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.05, what: str = "condition"):
    """Poll `predicate` until it returns something truthy (a bound on waiting, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


__all__ = [
    "BASE",
    "FAKE_LAUNCHER",
    "fake_vllm_thread",
    "fake_vllm_process",
    "fake_vllm_on_path",
    "fake_state",
    "script_fake",
    "make_adapter",
    "vllm_settings",
    "attached_engine",
    "wait_until",
    "wait_healthy",
    "vllm_http",
    "free_port",
]
