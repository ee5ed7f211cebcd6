"""`--load-in-4bit` with `--engine vllm` is refused at start, because the pinned vLLM cannot
serve a bitsandbytes model: the refusal through the CLI, before any vLLM is launched, and the
reason itself checked on the real CPU vLLM (the same 0.32 code line as the GPU pin)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from gateway.models.tiny import ensure_tiny_model
from gateway.settings import FOUR_BIT_WITH_VLLM, Settings
from tests.helpers_real_vllm import vllm_python


def test_settings_refuse_4_bit_with_vllm_and_say_what_to_do_instead(tmp_path):
    with pytest.raises(ValidationError, match="Unknown quantization method: bitsandbytes"):
        Settings(state_dir=tmp_path, engine="vllm", load_in_4bit=True)
    assert "Drop --load-in-4bit" in FOUR_BIT_WITH_VLLM and "--gpu-mode dedicated" in FOUR_BIT_WITH_VLLM
    # 4-bit training stays an option where the engine can serve the same checkpoint
    assert Settings(state_dir=tmp_path, engine="local", load_in_4bit=True).load_in_4bit
    assert not Settings(state_dir=tmp_path, engine="vllm").load_in_4bit  # the default: 16-bit LoRA


@pytest.mark.parametrize("command", ["serve", "train"])
def test_the_cli_refuses_it_at_start_before_launching_vllm(tmp_path, command):
    # A stand-in `vllm` that records being launched: it must never run.
    launched = tmp_path / "launched"
    stand_in = tmp_path / "vllm-python"
    stand_in.write_text(f"#!/bin/sh\ntouch {launched}\nexit 1\n")
    stand_in.chmod(0o755)
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", command, "--state-dir", str(tmp_path / "state"), "--engine", "vllm"]
        + ["--vllm-python", str(stand_in), "--load-in-4bit"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "--load-in-4bit cannot run with --engine vllm" in done.stderr and "Traceback" not in done.stderr
    assert not launched.exists() and not (tmp_path / "state" / "rlproxy.db").exists()


def test_the_real_vllm_has_no_bitsandbytes_quantization(tmp_path):
    # The reason for the refusal, on the real engine: should a later vLLM serve bitsandbytes
    # again, this fails and the refusal can go.
    model = ensure_tiny_model(tmp_path)
    done = subprocess.run(
        [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        + ["--quantization", "bitsandbytes", "--dtype", "float32", "--host", "127.0.0.1", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode != 0
    assert "Unknown quantization method: bitsandbytes" in done.stdout + done.stderr
