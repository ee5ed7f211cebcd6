"""Shadow samples follow the policy under live load (issue 38, item 1): on the local engine a
background (shadow) choice that a live request sets aside keeps its tokens and logprobs and
later continues from prompt + those tokens, so live load changes neither what it samples nor
the logprobs it records; and the shadow sampler drops a shadow only once its step went stale,
never because it took long, counting drops per task key.

Live load is scripted by token counts, not by the clock: the worker's `after_step` hook sends
a live request through the engine whenever a background row has generated `k` tokens since
the last one, so every shadow is interrupted at the same points on every run."""

from __future__ import annotations

import asyncio
import math
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM

from gateway.engines.base import EngineRequest
from gateway.engines.local.engine import LocalEngine
from gateway.models.tiny import ensure_tiny_model

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = LocalEngine(str(model_dir), "rlproxy/tiny-qwen2", max_batch_size=128, default_max_tokens=48)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.close())


MAX_LIVE = 50  # live requests per run at most (these runs need 4 to 12): a run that re-draws ends


class LiveEveryK:
    """The worker's `after_step` hook: once a background row has generated `k` tokens since
    the last live request, send another (one token, through the engine's own API) and wait
    until it is queued, so the worker sets the shadows aside at its very next step. Notes
    each background choice's tokens at that moment (`seen`)."""

    def __init__(self, engine: LocalEngine, loop: asyncio.AbstractEventLoop, k: int):
        self.engine, self.loop, self.k = engine, loop, k
        self.since: dict[int, tuple[object, int]] = {}  # id(row) -> (row, its tokens then)
        self.seen: list[tuple[object, int, list[int]]] = []  # (job, choice, tokens) when set aside
        self.live: list[asyncio.Task] = []

    def __call__(self) -> None:
        rows = [row for row in self.engine.worker.batch.rows if row.job.background]
        if not rows or max(len(row.ids) - self._start(row) for row in rows) < self.k or len(self.live) >= MAX_LIVE:
            return
        self.since = {id(row): (row, len(row.ids)) for row in rows}
        self.seen += [(row.job, row.index, list(row.ids)) for row in rows]
        asyncio.run_coroutine_threadsafe(self._live_request(), self.loop).result()

    def _start(self, row) -> int:
        entry = self.since.get(id(row))
        return entry[1] if entry is not None and entry[0] is row else 0

    async def _live_request(self) -> None:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, "temperature": 1.0}
        request = EngineRequest(body, None, f"live-{time.monotonic_ns()}")
        self.live.append(asyncio.ensure_future(self.engine.complete(request)))
        await asyncio.sleep(0)  # the live call runs up to its first await: it is in the inbox


async def shadows(engine, seeds, k: int | None = None, **sampling) -> tuple[list, LiveEveryK | None]:
    """Background jobs, one per seed, run together; with `k`, a live request every k tokens."""
    worker = engine.worker
    hook = LiveEveryK(engine, asyncio.get_running_loop(), k) if k else None
    worker.after_step = hook
    try:
        body = {"model": "tiny", "messages": MESSAGES, **sampling}
        jobs = [
            engine.complete(EngineRequest({**body, "seed": seed}, None, f"shadow-{seed}", background=True))
            for seed in seeds
        ]
        done = await asyncio.gather(*jobs)
        if hook is not None:
            await asyncio.gather(*hook.live)
    finally:
        worker.after_step = None
    return done, hook


def ks_statistic(a: list[int], b: list[int]) -> float:
    """Two-sample Kolmogorov-Smirnov D: the largest gap between the empirical CDFs."""
    return max(abs(sum(x <= v for x in a) / len(a) - sum(x <= v for x in b) / len(b)) for v in set(a) | set(b))


def ks_critical(alpha: float, n: int, m: int) -> float:
    """D above which the two samples differ at level alpha: c(alpha) * sqrt((n + m) / (n m)),
    c(alpha) = sqrt(-ln(alpha / 2) / 2) (the asymptotic Kolmogorov distribution; conservative
    for lengths, which tie)."""
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


def test_shadow_lengths_do_not_depend_on_live_load(engine):
    """4 shadow jobs of n = 32 with no live load against 4 other seeds' with a live request
    after every k = 4 tokens (n = m = 128 lengths; T = 1, stop "o", which ends the tiny model's
    answers after 1 to 48 tokens, mean ~14). A two-sample Kolmogorov-Smirnov test at
    alpha = 0.001 (critical D = 0.24) must not tell them apart. Before continuations, a set-aside
    choice was re-drawn from its prompt, so only answers shorter than k survived: D was 0.83
    (mean length 1.8 against 14.0); now D is 0.12 (15.6 against 14.0)."""
    sampling = {"n": 32, "max_tokens": 48, "temperature": 1.0, "stop": ["o"]}
    set_aside = engine.worker.set_aside
    quiet, _ = asyncio.run(shadows(engine, range(0, 4), **sampling))
    loaded, hook = asyncio.run(shadows(engine, range(100, 104), k=4, **sampling))
    lengths = [[len(c.completion_ids) for done in run for c in done.tokens.choices] for run in (quiet, loaded)]
    assert len(lengths[0]) == len(lengths[1]) == 128
    assert len(hook.live) >= 8 and engine.worker.set_aside - set_aside >= len(hook.live)  # the load was real
    d, critical = ks_statistic(*lengths), ks_critical(0.001, 128, 128)
    assert d < critical, f"lengths with no load {sorted(lengths[0])} and under load {sorted(lengths[1])}: D {d:.3f}"
    assert sum(length > 3 * 4 for length in lengths[1]) >= 20  # long answers finished through set-asides


def test_a_continued_shadow_keeps_its_tokens_and_records_exact_logprobs(engine, model_dir):
    """A live request after every 5 tokens sets 4 shadows (T = 0.7, 24 tokens) aside four times.
    Each shadow's answer starts with the tokens it had when set aside, and every recorded logprob
    is the token's under the distribution that drew it, as one teacher-forced forward over prompt
    + completion computes it (log_softmax(logits / 0.7)), to 1e-5 (1 + |logprob|)."""
    temperature = 0.7
    (done,), hook = asyncio.run(shadows(engine, [7], k=5, n=4, max_tokens=24, temperature=temperature))
    choices = done.tokens.choices
    assert len(hook.live) >= 4 and len(hook.seen) >= 16
    for _, index, tokens in hook.seen:
        assert choices[index].completion_ids[: len(tokens)] == tokens  # kept, not re-drawn
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = done.tokens.prompt_ids
    for choice in choices:
        assert len(choice.completion_ids) == len(choice.logprobs) == 24
        with torch.no_grad():
            logits_TV = reference(torch.tensor([prompt + choice.completion_ids])).logits[0].float()
        logprobs_TV = torch.log_softmax(logits_TV / temperature, dim=-1)
        expected = [logprobs_TV[len(prompt) - 1 + i, t].item() for i, t in enumerate(choice.completion_ids)]
        # float32 on both sides: ~1e-5, relative to the logprob's size
        assert all(abs(a - b) <= 1e-5 * (1 + abs(b)) for a, b in zip(choice.logprobs, expected, strict=True))
