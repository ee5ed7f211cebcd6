"""The local engine's worker: the one thread that touches the model.

`LocalEngine` (gateway/engines/local.py) renders and tokenises requests on the event loop and
puts `Job`s and `Control`s in its inbox; `Worker.run` drains that inbox and runs a continuous
batch:

- every step it admits waiting requests while the batch has room (`max_batch_size`
  sequences; a request with `n` choices is `n` sequences), prefills them together (left
  padding, one prompt row per request, then repeated `n` times), and merges their KV
  cache into the running one;
- one decode step feeds every sequence its last token; rows that finish leave the batch;
- requests for different adapters share a batch through peft's mixed-adapter forward
  (`adapter_names=[...]`, "__base__" for the base model);
- adapter loads and unloads run on the worker between steps; an unload waits until no
  queued or running request uses the adapter.

Sampling is per request (its own `torch.Generator` from `seed`), in vLLM's order
(vllm/v1/sample/sampler.py): repetition, frequency and presence penalties on the logits,
then temperature, then min_p, then top-k, then top-p, renormalised. The logprob recorded
for each sampled token is its *behaviour* logprob: log mu(token) under exactly that
processed distribution, the one the token was drawn from (what vLLM reports with
`--logprobs-mode processed_logprobs`). The trainer's importance weights divide by it, so
it must be the sampler's, not the raw model's. Greedy rows (temperature 0) report the
penalised distribution at temperature 1, as vLLM does. Tokens that top-k/top-p/min_p
removed have probability 0: their logprob (in `top_logprobs`) is -inf, sent as -9999.0
like vLLM.
Completion ids include the final `<|im_end|>` when the model stops by itself, so
prompt + completion is a prefix of the next turn's rendering.

Results go back to each request's event loop as events on its `Job.events` queue:
("delta", [(index, text, ids, logprobs, top), ...]) while streaming, ("finish", ChoiceResult)
per choice, or ("error", RLProxyError). Text that could still become a stop string or an
incomplete UTF-8 character is held back from deltas.

The worker reads and writes the engine's model state (`model`, `_peft`, `_adapters`) and
reads its settings; it gets the engine as an argument, so this module never imports local.py.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import random
import threading
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.errors import Conflict, EngineUnavailable, InvalidRequest, NotFound, RLProxyError, UpstreamError

if TYPE_CHECKING:
    from gateway.engines.local import LocalEngine

log = logging.getLogger(__name__)

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed-adapter batch


# ---------------------------------------------------------------- jobs and rows


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
    ):
        import torch

        self.prompt_ids = prompt_ids
        self.n = n
        self.adapter = adapter
        self.sampling = sampling
        self.stream = stream
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed if seed is not None else random.getrandbits(63))
        self.cancelled = threading.Event()
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()  # ("delta" | "finish" | "error", payload)


@dataclass
class _Row:
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


@dataclass
class Control:
    """An adapter load or unload, run on the worker between steps."""

    kind: str  # "load" | "unload"
    name: str
    path: Path | None
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

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


# ---------------------------------------------------------------- the worker


class Worker:
    """Runs on the engine's thread; the only code that touches the model.

    From the engine it reads `tokenizer`, `device`, `max_batch_size`, `inbox`, `eos_ids` and
    `pad_id`, and it writes `model`, `_peft` and `_adapters` (adapter loads and unloads) and
    `step_batch_sizes`.
    """

    def __init__(self, engine: LocalEngine):
        import torch

        self.torch = torch
        self.engine = engine
        self.tokenizer = engine.tokenizer
        # transformers renamed `past_key_values` to `cache` (5.2x warns on the old name, 5.40
        # drops it); the model class's own signature says which this version takes.
        forward = inspect.signature(type(engine.model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward else "past_key_values"
        self._backend = getattr(engine.tokenizer, "backend_tokenizer", None)
        if getattr(engine.tokenizer, "clean_up_tokenization_spaces", False):
            self._backend = None  # the Python side would change spaces the backend keeps
        self.device = engine.device
        self.pending: deque[Job] = deque()
        self.controls: list[Control] = []
        self.rows: list[_Row] = []
        self.cache = None  # DynamicCache over `rows`, left-padded to a common length
        self.mask_BT = None  # 1 for real tokens, 0 for padding
        self.next_B = None  # each row's last sampled token, not yet in the cache
        self.outbox: list[tuple[Job, str, Any]] = []  # events of this step, sent together
        self.stopping = False

    def run(self) -> None:
        while not self.stopping or self.rows or self.pending:
            idle = not self.rows and not self.pending and not self.controls
            self._drain(block=idle and not self.stopping)
            if self.stopping:
                self._fail_everything(EngineUnavailable("the local engine is shutting down"))
                break
            self._run_controls()
            try:
                with self.torch.inference_mode():
                    self._admit()
                    if self.rows:
                        self._decode_step()
            except Exception as error:  # keep serving: fail what was running, start clean
                log.exception("local engine step failed")
                self._fail_running(UpstreamError(f"the local model failed while generating: {error}"))
            self._send()
        self._send()
        for control in self.controls:
            control.resolve(EngineUnavailable("the local engine is shutting down"))

    def _post(self, job: Job, kind: str, payload: Any) -> None:
        self.outbox.append((job, kind, payload))

    def _send(self) -> None:
        """Hand this step's events to their event loops: one wake-up per loop, not per event."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for job, kind, payload in self.outbox:
            by_loop.setdefault(job.loop, []).append((job, (kind, payload)))
        self.outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody is listening
                for job, _ in items:
                    job.cancelled.set()

    def _drain(self, block: bool) -> None:
        while True:
            try:
                item = self.engine.inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if item is None:
                self.stopping = True
            elif isinstance(item, Control):
                self.controls.append(item)
            else:
                self.pending.append(item)

    # ------------------------------------------------------------ adapters

    def _run_controls(self) -> None:
        waiting = []
        for control in self.controls:
            if control.kind == "unload" and self._in_use(control.name):
                waiting.append(control)  # unload once no queued or running request needs it
                continue
            try:
                if control.kind == "load":
                    self._load_adapter(control)
                else:
                    self._unload_adapter(control.name)
            except RLProxyError as error:
                control.resolve(error)
            except Exception as error:
                control.resolve(InvalidRequest(f"cannot {control.kind} adapter '{control.name}': {error}"))
            else:
                control.resolve(None)
        self.controls = waiting

    def _in_use(self, name: str) -> bool:
        return any(row.job.adapter == name for row in self.rows) or any(job.adapter == name for job in self.pending)

    def _load_adapter(self, control: Control) -> None:
        from peft import PeftModel

        engine = self.engine
        if control.name in engine._adapters:
            raise Conflict(f"adapter '{control.name}' is already loaded")
        device = str(self.device)
        if not engine._peft:
            engine.model = PeftModel.from_pretrained(
                engine.model, str(control.path), adapter_name=control.name, is_trainable=False, torch_device=device
            )
            engine._peft = True
        else:
            engine.model.load_adapter(
                str(control.path), adapter_name=control.name, is_trainable=False, torch_device=device
            )
        engine.model.eval()
        engine._adapters.add(control.name)

    def _unload_adapter(self, name: str) -> None:
        engine = self.engine
        if name not in engine._adapters:
            raise NotFound(f"adapter '{name}' is not loaded")
        if len(engine._adapters) == 1:
            engine.model = engine.model.unload().eval()  # drop the LoRA layers: back to the plain base model
            engine._peft = False
        else:
            with warnings.catch_warnings():  # "adapter X was active": we never use the active adapter
                warnings.simplefilter("ignore")
                engine.model.delete_adapter(name)
        engine._adapters.discard(name)

    # ------------------------------------------------------------ batching

    def _admit(self) -> None:
        torch = self.torch
        new: list[Job] = []
        rows = len(self.rows)
        while self.pending:
            job = self.pending[0]
            if job.cancelled.is_set():
                self.pending.popleft()
                continue
            if job.adapter is not None and job.adapter not in self.engine._adapters:
                self.pending.popleft()
                self._post(job, "error", NotFound(f"adapter '{job.adapter}' is not loaded in the local engine"))
                continue
            if rows and rows + job.n > self.engine.max_batch_size:
                break
            new.append(self.pending.popleft())
            rows += job.n
        if not new:
            return
        # prefill: one row per job, left-padded
        width = max(len(job.prompt_ids) for job in new)
        ids_JT = torch.full((len(new), width), self.engine.pad_id, dtype=torch.long)
        mask_JT = torch.zeros((len(new), width), dtype=torch.long)
        for j, job in enumerate(new):
            ids_JT[j, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
            mask_JT[j, width - len(job.prompt_ids) :] = 1
        ids_JT, mask_JT = ids_JT.to(self.device), mask_JT.to(self.device)
        cache = self._new_cache()
        logits_JV = self._forward(ids_JT, mask_JT, cache, [job.adapter for job in new], logits_to_keep=1)
        # n choices of a job share its prompt: repeat its row n times
        repeat_R = torch.tensor([j for j, job in enumerate(new) for _ in range(job.n)], device=self.device)
        cache.batch_select_indices(repeat_R)
        new_rows = [_Row(job, index) for job in new for index in range(job.n)]
        tokens_R, chosen_R, top = self._sample(logits_JV[repeat_R], new_rows)
        mask_RT = mask_JT[repeat_R]
        keep = self._record(new_rows, tokens_R, chosen_R, top)
        if not keep:
            return
        keep_R = torch.tensor(keep, device=self.device)
        cache.batch_select_indices(keep_R)
        self._merge([new_rows[i] for i in keep], cache, mask_RT[keep_R], tokens_R[keep_R])

    def _merge(self, rows: list[_Row], cache, mask_RT, next_R) -> None:
        """Add prefilled rows to the running batch, left-padding the shorter side's cache."""
        torch = self.torch
        if not self.rows:
            self.rows, self.cache, self.mask_BT, self.next_B = rows, cache, mask_RT, next_R
            return
        width = max(self.mask_BT.shape[1], mask_RT.shape[1])

        def pad(t, dim_from_end: int):
            missing = width - t.shape[-dim_from_end]
            if missing == 0:
                return t
            spec = [0, 0] * (dim_from_end - 1) + [missing, 0]
            return torch.nn.functional.pad(t, spec)

        layers = []
        for old, new in zip(self.cache.layers, cache.layers, strict=False):
            layers.append(
                (torch.cat([pad(old.keys, 2), pad(new.keys, 2)]), torch.cat([pad(old.values, 2), pad(new.values, 2)]))
            )
        self.cache = self._new_cache(layers)
        self.mask_BT = torch.cat([pad(self.mask_BT, 1), pad(mask_RT, 1)])
        self.next_B = torch.cat([self.next_B, next_R])
        self.rows = self.rows + rows

    def _decode_step(self) -> None:
        torch = self.torch
        alive = [i for i, row in enumerate(self.rows) if not row.job.cancelled.is_set()]
        if len(alive) < len(self.rows):
            self._select(alive)
            if not self.rows:
                return
        self.mask_BT = torch.cat([self.mask_BT, torch.ones_like(self.mask_BT[:, :1])], dim=1)
        logits_BV = self._forward(
            self.next_B[:, None], self.mask_BT, self.cache, [row.job.adapter for row in self.rows]
        )
        tokens_B, chosen_B, top = self._sample(logits_BV, self.rows)
        keep = self._record(self.rows, tokens_B, chosen_B, top)
        self.next_B = tokens_B
        if len(keep) < len(self.rows):
            self._select(keep)

    def _select(self, keep: list[int]) -> None:
        """Keep only these rows; drop cache columns that are padding in every remaining row."""
        if not keep:
            self._clear_batch()
            return
        keep_K = self.torch.tensor(keep, device=self.device)
        self.rows = [self.rows[i] for i in keep]
        self.cache.batch_select_indices(keep_K)
        self.mask_BT, self.next_B = self.mask_BT[keep_K], self.next_B[keep_K]
        first = int(self.mask_BT.any(dim=0).nonzero()[0])
        if first > 0:
            self.mask_BT = self.mask_BT[:, first:]
            self.cache = self._new_cache(
                [(layer.keys[:, :, first:], layer.values[:, :, first:]) for layer in self.cache.layers]
            )

    def _clear_batch(self) -> None:
        self.rows, self.cache, self.mask_BT, self.next_B = [], None, None, None

    def _new_cache(self, layers: list | None = None):
        from transformers import DynamicCache

        return DynamicCache(layers) if layers is not None else DynamicCache()

    def _forward(self, ids_BT, mask_BT, cache, adapters: list[str | None], logits_to_keep: int = 1):
        """Logits of the last position of every row, float32: [B, V]."""
        torch = self.torch
        position_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)[:, -ids_BT.shape[1] :]
        kwargs = {}
        if self.engine._peft:
            kwargs["adapter_names"] = [name or BASE_ADAPTER for name in adapters]
        self.engine.step_batch_sizes.append(ids_BT.shape[0])
        kwargs[self._cache_kwarg] = cache
        out = self.engine.model(
            input_ids=ids_BT,
            attention_mask=mask_BT,
            position_ids=position_BT,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
        return out.logits[:, -1, :].to(torch.float32)

    # ------------------------------------------------------------ sampling

    def _sample(self, logits_BV, rows: list[_Row]):
        """Sample one token per row. Returns tokens [B], their behaviour logprobs [B] and, if
        any row asked for them, the top (id, logprob) pairs of every row (same distribution)."""
        torch = self.torch
        logprobs_BV = processed_logprobs(
            logits_BV,
            [row.job.sampling for row in rows],
            [row.job.prompt_ids for row in rows],
            [row.ids for row in rows],
        )
        probs_BV = logprobs_BV.exp()
        # inverse-CDF sampling, vectorised; each job draws its uniforms from its own generator,
        # so what a seed samples does not depend on the rest of the batch
        uniform_B = torch.zeros(len(rows), device=self.device)
        members: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            members.setdefault(id(row.job), []).append(i)
        for group in members.values():
            job = rows[group[0]].job
            if job.sampling.temperature > 0:
                uniform_B[group] = torch.rand(len(group), generator=job.generator, device=self.device)
        cdf_BV = probs_BV.cumsum(dim=-1)
        tokens_B = torch.searchsorted(cdf_BV, (uniform_B * cdf_BV[:, -1])[:, None], right=True).squeeze(1)
        tokens_B = tokens_B.clamp(max=probs_BV.shape[1] - 1)
        greedy = [i for i, row in enumerate(rows) if row.job.sampling.temperature == 0]
        if greedy:
            tokens_B[greedy] = logprobs_BV[greedy].argmax(dim=-1)
        chosen_B = logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)
        top = None
        want_top = max(row.job.sampling.top_logprobs for row in rows)
        if want_top:
            values_BK, indices_BK = logprobs_BV.topk(want_top, dim=-1)
            values_BK = values_BK.clamp(min=MASKED_LOGPROB)  # JSON has no -inf; vLLM sends -9999.0
            top = [
                list(zip(ids, values, strict=True))
                for ids, values in zip(indices_BK.tolist(), values_BK.tolist(), strict=True)
            ]
        return tokens_B, chosen_B, top

    def _record(self, rows: list[_Row], tokens_B, chosen_B, top) -> list[int]:
        """Append the sampled tokens; finish rows that stop; stream deltas. Returns the rows that go on."""
        tokens, logprobs = tokens_B.tolist(), chosen_B.tolist()
        keep: list[int] = []
        deltas: dict[int, tuple[Job, list]] = {}
        for i, row in enumerate(rows):
            job, sampling = row.job, row.job.sampling
            row.ids.append(tokens[i])
            row.logprobs.append(logprobs[i])
            if sampling.top_logprobs:
                row.top.append(top[i][: sampling.top_logprobs])
            track_text = job.stream or bool(sampling.stops)
            if tokens[i] in self.engine.eos_ids:
                row.finish_reason = "stop"
            elif track_text:
                self._advance_text(row)
                if sampling.stops and self._cut_at_stop(row):
                    row.finish_reason = "stop"
            if row.finish_reason is None and len(row.ids) >= sampling.max_new_tokens:
                row.finish_reason = "length"
            if row.finish_reason is not None:
                row.text = self._decode(row.ids)  # the whole text, including any held-back bytes
                if job.stream and row.sent_tokens < len(row.ids):  # logprobs not streamed yet
                    deltas.setdefault(id(job), (job, []))[1].append(self._delta(row, "", len(row.ids)))
                self._flush(deltas.pop(id(job), None))  # keep this job's events in order
                self._post(
                    job,
                    "finish",
                    ChoiceResult(
                        row.index, row.text, row.ids, row.logprobs, row.top or [[] for _ in row.ids], row.finish_reason
                    ),
                )
                continue
            keep.append(i)
            if job.stream:
                chars, count = self._streamable(row)
                text = row.text[row.sent : chars] if chars > row.sent else ""
                row.sent = max(row.sent, chars)
                if text or count > row.sent_tokens:
                    deltas.setdefault(id(job), (job, []))[1].append(self._delta(row, text, count))
        for entry in deltas.values():
            self._flush(entry)
        return keep

    def _delta(self, row: _Row, text: str, upto: int) -> tuple:
        """A stream event for one row: new text, and the tokens [sent_tokens, upto) with their logprobs."""
        start, row.sent_tokens = row.sent_tokens, max(row.sent_tokens, upto)
        return (row.index, text, row.ids[start:upto], row.logprobs[start:upto], row.top[start:upto])

    def _flush(self, entry) -> None:
        if entry is not None:
            job, items = entry
            self._post(job, "delta", items)

    def _advance_text(self, row: _Row) -> None:
        """Extend `row.text` by the newest token, holding back an incomplete UTF-8 character."""
        before = self._decode(row.ids[row.prefix : row.read])
        after = self._decode(row.ids[row.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            row.text += after[len(before) :]
            row.prefix, row.read = row.read, len(row.ids)
        row.offsets.append(len(row.text))

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:  # the Rust tokenizer directly: half the cost, same text
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _cut_at_stop(self, row: _Row) -> bool:
        """If the text holds a stop string, cut text and tokens before it. Returns whether it did."""
        stops = row.job.sampling.stops
        longest = max(len(s) for s in stops)
        previous = row.offsets[-2] if len(row.offsets) > 1 else 0
        search_from = max(0, previous - longest + 1)
        hits = [p for p in (row.text.find(s, search_from) for s in stops) if p >= 0]
        if not hits:
            return False
        cut = min(hits)
        # keep the tokens whose text ends at or before the stop string
        kept = 0
        for k, offset in enumerate(row.offsets, start=1):
            if offset <= cut:
                kept = k
        del row.ids[kept:], row.logprobs[kept:], row.top[kept:], row.offsets[kept:]
        row.text = self._decode(row.ids)
        row.sent = min(row.sent, len(row.text))
        return True

    def _streamable(self, row: _Row) -> tuple[int, int]:
        """How much of the row can be streamed now, as (characters, tokens): never part of a
        possible stop string (with stop strings, only whole tokens before the held-back tail,
        so a later cut never takes back what was sent)."""
        limit = len(row.text)
        stops = row.job.sampling.stops
        if not stops:
            return limit, len(row.ids)
        limit = min(limit, len(row.text) - (max(len(s) for s in stops) - 1))
        chars = count = 0
        for k, offset in enumerate(row.offsets, start=1):
            if offset <= limit:
                chars, count = max(chars, offset), k
        return chars, count

    # ------------------------------------------------------------ failure

    def _fail_running(self, error: RLProxyError) -> None:
        for job in {id(row.job): row.job for row in self.rows}.values():
            self._post(job, "error", error)
        self._clear_batch()

    def _fail_everything(self, error: RLProxyError) -> None:
        self._fail_running(error)
        while self.pending:
            self._post(self.pending.popleft(), "error", error)


# ---------------------------------------------------------------- helpers


MASKED_LOGPROB = -9999.0
"""What a token that top-k/top-p/min_p removed reports as its logprob (vLLM's stand-in for -inf)."""


def processed_logprobs(logits_BV, samplings: list[Sampling], prompts: list[list[int]], outputs: list[list[int]]):
    """log mu: the log-probabilities of the distribution each row samples from, [B, V] float32.

    vLLM's order: penalties on the logits (repetition over prompt and output tokens,
    frequency and presence over output tokens), temperature, min_p, top-k, top-p; the
    kept tokens renormalised, the removed ones -inf. Temperature 0 (greedy) is taken as 1
    here, as vLLM's processed logprobs do for greedy requests.
    """
    import torch

    B, V = logits_BV.shape
    scores_BV = logits_BV.float()
    penalised = [
        i
        for i, s in enumerate(samplings)
        if s.repetition_penalty != 1.0 or (outputs[i] and (s.presence_penalty or s.frequency_penalty))
    ]
    if penalised:
        scores_BV = scores_BV.clone()
        for i in penalised:
            s = samplings[i]
            if s.repetition_penalty != 1.0:
                seen_V = torch.zeros(V, dtype=torch.bool, device=scores_BV.device)
                seen = [t for t in (*prompts[i], *outputs[i]) if t < V]
                if seen:
                    seen_V[torch.tensor(seen, device=scores_BV.device)] = True
                row_V = scores_BV[i]
                scaled_V = torch.where(row_V > 0, row_V / s.repetition_penalty, row_V * s.repetition_penalty)
                scores_BV[i] = torch.where(seen_V, scaled_V, row_V)
            if outputs[i] and (s.presence_penalty or s.frequency_penalty):
                counts_V = torch.bincount(torch.tensor(outputs[i], device=scores_BV.device), minlength=V)[:V]
                counts_V = counts_V.to(scores_BV.dtype)
                scores_BV[i] -= s.frequency_penalty * counts_V + s.presence_penalty * (counts_V > 0)
    temperature_B = torch.tensor(
        [s.temperature if s.temperature > 0 else 1.0 for s in samplings], device=scores_BV.device
    )
    logprobs_BV = torch.log_softmax(scores_BV / temperature_B[:, None], dim=-1)
    keep_BV = None
    for i, s in enumerate(samplings):
        if s.min_p <= 0 and not 0 < s.top_k < V and s.top_p >= 1.0:
            continue
        if keep_BV is None:
            keep_BV = torch.ones_like(logprobs_BV, dtype=torch.bool)
        keep_BV[i] = _kept_tokens(logprobs_BV[i], s)
    if keep_BV is not None:
        logprobs_BV = torch.log_softmax(logprobs_BV.masked_fill(~keep_BV, float("-inf")), dim=-1)
    return logprobs_BV


def _kept_tokens(logprobs_V, s: Sampling):
    """The tokens min_p, then top-k, then top-p leave in (the best one always stays)."""
    import torch

    probs_V = logprobs_V.exp()
    keep_V = torch.ones_like(probs_V, dtype=torch.bool)
    if s.min_p > 0:
        keep_V &= probs_V >= s.min_p * probs_V.max()
    if 0 < s.top_k < probs_V.shape[0]:
        kth = probs_V.masked_fill(~keep_V, -1.0).topk(s.top_k).values[-1]
        keep_V &= probs_V >= kth
    if s.top_p < 1.0:
        kept_V = probs_V.masked_fill(~keep_V, 0.0)
        kept_V = kept_V / kept_V.sum()
        sorted_V, order_V = kept_V.sort(descending=True)
        before_V = sorted_V.cumsum(0) - sorted_V  # mass of the better tokens
        in_nucleus_V = torch.zeros_like(keep_V)
        in_nucleus_V[order_V] = before_V < s.top_p
        keep_V &= in_nucleus_V
    return keep_V


def _deliver(items: list) -> None:
    """On a request's event loop: put the worker's events in their jobs' queues."""
    for job, event in items:
        job.events.put_nowait(event)
