"""What the local engine and its worker thread hand each other.

`LocalEngine` (gateway/engines/local/engine.py) renders and tokenises a request (beside the event loop) and
puts a `Job` (or, for an adapter load or unload, a `Control`) in the worker's inbox; the worker
(gateway/engines/local/worker.py) runs each job as `n` `Row`s of its batch.

Results go back to each request's event loop as events on its `Job.events` queue:
("delta", [(index, text, ids, logprobs, top), ...]) while streaming, ("finish", ChoiceResult)
per choice, or ("error", RLProxyError). The worker hands a step's events over together
(`deliver` runs on the request's loop).
"""

from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.errors import InvalidRequest, RLProxyError
from gateway.settings import is_greedy

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed-adapter batch


@dataclass
class Sampling:
    """How one request samples, fixed when it is submitted."""

    max_new_tokens: int
    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    stops: list[str]
    top_logprobs: int  # top entries to record per token (0: none)
    top_k: int = 0  # 0 or -1: off (vLLM's convention)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # vLLM's: an eos token does not end the choice, max_new_tokens does

    def __post_init__(self) -> None:
        if is_greedy(self.temperature):  # 1e-6 is greedy too, as on vLLM (`gateway.settings.GREEDY_BELOW`)
            self.temperature = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def in_force(self) -> dict:
        """The parameters that shaped the distribution, all explicit (TokenRecord.sampling)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k if self.top_k > 0 else -1,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "max_tokens": self.max_new_tokens,
        }


@dataclass
class ChoiceResult:
    """One finished choice, sent from the worker to the request's coroutine."""

    index: int
    text: str  # decode(completion_ids, skip_special_tokens=True), cut at a stop string
    completion_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per token, (id, logprob) best first; empty lists if not asked
    finish_reason: str  # "stop" | "length"
    stop_reason: str | None = None  # the stop string the text was cut at (vLLM's `stop_reason`)


class Job:
    """One request on the worker: `n` rows, a generator, a queue of events back to its coroutine."""

    def __init__(
        self,
        prompt_ids: list[int],
        n: int,
        adapter: str | None,
        sampling: Sampling,
        seed: int | None,
        stream: bool,
        device: Any,
        background: bool = False,
    ):
        import torch

        self.prompt_ids = prompt_ids
        self.n = n
        # A background job (shadow samples) runs only while no foreground row is in the batch;
        # set aside for one, its unfinished choices are parked with what they generated and
        # later continue from there.
        self.background = background and not stream
        self.unfinished: list[int] = list(range(n))  # choice indices still to generate
        self.parked: dict[int, Row] = {}  # choice index -> its row, set aside mid-generation
        self.adapter = adapter
        self.sampling = sampling
        self.stream = stream
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed if seed is not None else random.getrandbits(63))
        self.cancelled = threading.Event()
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()  # ("delta" | "finish" | "error", payload)


@dataclass
class Row:
    """One sequence (one choice of one job) in the running batch."""

    job: Job
    index: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    # Text, tracked incrementally when streaming or watching for stop strings (vLLM's
    # detokenizer: decode a short window ids[prefix:] and keep what lies past ids[prefix:read]).
    text: str = ""
    prefix: int = 0
    read: int = 0
    offsets: list[int] = field(default_factory=list)  # len(text) after each token
    sent: int = 0  # characters of `text` already streamed
    sent_tokens: int = 0  # tokens whose logprobs were already streamed
    finish_reason: str | None = None
    stop_reason: str | None = None  # the stop string that finished it, if one did


@dataclass
class Control:
    """An adapter load or unload, run on the worker between steps."""

    kind: str  # "load" | "unload"
    name: str
    path: Path | None
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def run(self, model) -> None:
        """Load or unload on the worker's `LocalModel`, between steps; tell the caller how it went."""
        try:
            if self.kind == "load":
                model.load_adapter(self.name, self.path)
            else:
                model.unload_adapter(self.name)
        except RLProxyError as error:
            self.resolve(error)
        except Exception as error:
            self.resolve(InvalidRequest(f"cannot {self.kind} adapter '{self.name}': {error}"))
        else:
            self.resolve(None)

    def resolve(self, error: BaseException | None) -> None:
        def _set() -> None:
            if self.future.done():
                return
            if error is None:
                self.future.set_result(None)
            else:
                self.future.set_exception(error)

        try:
            self.loop.call_soon_threadsafe(_set)
        except RuntimeError:  # the caller's loop is closed; nobody is waiting
            pass


def deliver(items: list) -> None:
    """On a request's event loop: put the worker's events in their jobs' queues."""
    for job, event in items:
        job.events.put_nowait(event)
