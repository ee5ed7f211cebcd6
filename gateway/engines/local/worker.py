"""The local engine's worker: the one thread that touches the model.

`LocalEngine` (gateway/engines/local/engine.py) renders and tokenises requests (beside the event loop) and
puts `Job`s and `Control`s (gateway/engines/local/jobs.py) in its inbox; `Worker.run` drains
that inbox and runs a continuous batch (gateway/engines/local/batch.py):

- every step it admits waiting requests while the batch has room (`max_batch_size`
  sequences; a request with `n` choices is `n` sequences), prefills them together and
  merges their KV cache into the running one;
- one decode step feeds every sequence its last token; rows that finish leave the batch;
- requests for different adapters share a batch through peft's mixed-adapter forward
  (`adapter_names=[...]`, "__base__" for the base model);
- adapter loads and unloads run on the worker between steps; an unload waits until no
  queued or running request uses the adapter;
- background jobs (shadow samples: no client waits for them) run only while no foreground
  request is in the batch or waiting; when one arrives they are set aside: their rows leave the
  batch with the tokens and logprobs they have, and once the foreground is done each continues
  from prompt + its tokens (a prefill of them, vLLM's recompute preemption), so a shadow is
  drawn from the same distribution however often live load interrupts it. Live calls never
  share a step with them.

Each step samples one token per row (gateway/engines/local/sampling.py: vLLM's order, and
the behaviour logprob of the token under the distribution it was drawn from) and records it:
completion ids include the final `<|im_end|>` when the model stops by itself, so
prompt + completion is a prefix of the next turn's rendering; streaming rows send deltas of
the text that can no longer change (gateway/engines/local/text.py).

The worker gets the `LocalModel` it serves, the inbox and the batch size; it never sees the
engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections import deque
from collections.abc import Callable
from typing import Any

from gateway.engines.local.batch import Batch, prefill
from gateway.engines.local.jobs import ChoiceResult, Control, Job, Row, deliver
from gateway.engines.local.model import LocalModel
from gateway.engines.local.sampling import sample
from gateway.engines.local.text import Detokenizer, delta, streamable
from gateway.errors import EngineUnavailable, NotFound, RLProxyError, UpstreamError

log = logging.getLogger(__name__)


class Worker:
    """Runs on the engine's thread; the only code that touches the model.

    It reads `Job`s, `Control`s and None (stop) from `inbox`, runs the model's forward and its
    adapter loads and unloads, and sends each job's events back to its event loop.
    """

    def __init__(self, model: LocalModel, inbox: queue.SimpleQueue, max_batch_size: int):
        import torch

        self.torch = torch
        self.model = model
        self.inbox = inbox
        self.max_batch_size = max_batch_size
        self.device = model.device
        self.detokenizer = Detokenizer(model.tokenizer)
        self.pending: deque[Job] = deque()
        self.background: deque[Job] = deque()  # waiting background jobs, oldest first
        self.set_aside = 0  # background jobs taken out of the batch for a foreground one (tests)
        # Called on this thread after every step (tests: they script arrivals by token counts).
        self.after_step: Callable[[], None] | None = None
        self.controls: list[Control] = []
        self.batch = Batch(model.device)
        self.outbox: list[tuple[Job, str, Any]] = []  # events of this step, sent together
        self.stopping = False

    def run(self) -> None:
        batch = self.batch
        while not self.stopping or batch.rows or self.pending or self.background:
            idle = not batch.rows and not self.pending and not self.background and not self.controls
            self._drain(block=idle and not self.stopping)
            if self.stopping:
                self._fail_everything(EngineUnavailable("the local engine is shutting down"))
                break
            self._run_controls()
            try:
                with self.torch.inference_mode():
                    self._set_aside_background()
                    self._admit()
                    if batch.rows:
                        self._decode_step()
            except Exception as error:  # keep serving: fail what was running, start clean
                log.exception("local engine step failed")
                self._fail_running(UpstreamError(f"the local model failed while generating: {error}"))
            self._send()
            if self.after_step is not None:
                self.after_step()
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
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:  # that loop is closed: nobody is listening
                for job, _ in items:
                    job.cancelled.set()

    def _drain(self, block: bool) -> None:
        while True:
            try:
                item = self.inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if item is None:
                self.stopping = True
            elif isinstance(item, Control):
                self.controls.append(item)
            elif item.background:
                self.background.append(item)
            else:
                self.pending.append(item)

    # ------------------------------------------------------------ adapters

    def _run_controls(self) -> None:
        waiting = []
        for control in self.controls:
            if control.kind == "unload" and self._in_use(control.name):
                waiting.append(control)  # unload once no queued or running request needs it
                continue
            control.run(self.model)
        self.controls = waiting

    def _in_use(self, name: str) -> bool:
        return any(row.job.adapter == name for row in self.batch.rows) or any(
            job.adapter == name for waiting in (self.pending, self.background) for job in waiting
        )

    # ------------------------------------------------------------ batching

    def _set_aside_background(self) -> None:
        """A foreground request is waiting: background rows leave the batch, parked in their
        jobs with what they generated, and the jobs go back to the front of the background
        queue. A row's cache is dropped, not its tokens: they are prefilled again when it
        continues (`prefill`), so no choice is re-drawn, and long ones are not selected out."""
        rows = self.batch.rows
        if not self.pending or not any(row.job.background for row in rows):
            return
        aside: dict[int, Job] = {}
        for row in rows:
            if row.job.background:
                row.job.parked[row.index] = row
                aside[id(row.job)] = row.job
        self.batch.select([i for i, row in enumerate(rows) if not row.job.background])
        self.background.extendleft(reversed(list(aside.values())))
        self.set_aside += len(aside)

    def _admit(self) -> None:
        rows = len(self.batch.rows)
        new = self._take(self.pending, rows)
        if not new and not self.pending and not any(not row.job.background for row in self.batch.rows):
            new = self._take(self.background, rows)  # nothing in the foreground: background work may run
        if not new:
            return
        # Until they are merged, the new jobs are in no batch row: if their prefill fails (out of
        # memory on a long prompt or a large n), `_fail_running` would not reach them and their
        # callers would wait forever. The running batch is untouched by a failed prefill.
        try:
            new_rows, logits_RV, cache, mask_RT = prefill(self.model, new)
            tokens_R, chosen_R, top = sample(logits_RV, new_rows, self.device)
            keep = self._record(new_rows, tokens_R, chosen_R, top)
        except Exception as error:
            log.exception("local engine prefill failed")
            self._fail_jobs(new, error)
            return
        if not keep:
            return
        try:
            self.batch.merge(new_rows, keep, cache, mask_RT, tokens_R)
        except Exception as error:  # the running batch may be half merged: the run loop fails it too
            self._fail_jobs(new, error)
            raise

    def _take(self, waiting: deque[Job], rows: int) -> list[Job]:
        """Jobs from the front of `waiting` that fit in the batch beside its `rows` rows."""
        new: list[Job] = []
        while waiting:
            job = waiting[0]
            if job.cancelled.is_set():
                waiting.popleft()
                continue
            if job.adapter is not None and job.adapter not in self.model.adapters:
                waiting.popleft()
                self._post(job, "error", NotFound(f"adapter '{job.adapter}' is not loaded in the local engine"))
                continue
            if rows and rows + len(job.unfinished) > self.max_batch_size:
                break
            new.append(waiting.popleft())
            rows += len(job.unfinished)
        return new

    def _decode_step(self) -> None:
        batch = self.batch
        alive = [i for i, row in enumerate(batch.rows) if not row.job.cancelled.is_set()]
        if len(alive) < len(batch.rows):
            batch.select(alive)
            if not batch.rows:
                return
        logits_BV = batch.step_logits(self.model)
        tokens_B, chosen_B, top = sample(logits_BV, batch.rows, self.device)
        keep = self._record(batch.rows, tokens_B, chosen_B, top)
        batch.next_B = tokens_B
        if len(keep) < len(batch.rows):
            batch.select(keep)

    def _record(self, rows: list[Row], tokens_B, chosen_B, top) -> list[int]:
        """Append the sampled tokens; finish rows that stop; stream deltas. Returns the rows that go on."""
        tokens, logprobs = tokens_B.tolist(), chosen_B.tolist()
        detok, eos_ids = self.detokenizer, self.model.eos_ids
        keep: list[int] = []
        deltas: dict[int, tuple[Job, list]] = {}
        for i, row in enumerate(rows):
            job, sampling = row.job, row.job.sampling
            row.ids.append(tokens[i])
            row.logprobs.append(logprobs[i])
            if sampling.top_logprobs:
                row.top.append(top[i][: sampling.top_logprobs])
            track_text = job.stream or bool(sampling.stops)
            if tokens[i] in eos_ids and not sampling.ignore_eos:
                row.finish_reason = "stop"
            elif track_text:
                detok.advance(row)
                if sampling.stops and (matched := detok.cut_at_stop(row)) is not None:
                    row.finish_reason, row.stop_reason = "stop", matched
            if row.finish_reason is None and len(row.ids) >= sampling.max_new_tokens:
                row.finish_reason = "length"
            if row.finish_reason is not None:
                if job.background:
                    job.unfinished.remove(row.index)  # set aside later, it is not continued
                detok.finish(row)
                if job.stream and row.sent_tokens < len(row.ids):  # logprobs not streamed yet
                    deltas.setdefault(id(job), (job, []))[1].append(delta(row, "", len(row.ids)))
                self._flush(deltas.pop(id(job), None))  # keep this job's events in order
                self._post(
                    job,
                    "finish",
                    ChoiceResult(
                        row.index,
                        row.text,
                        row.ids,
                        row.logprobs,
                        row.top or [[] for _ in row.ids],
                        row.finish_reason,
                        row.stop_reason,
                    ),
                )
                continue
            keep.append(i)
            if job.stream:
                chars, count = streamable(row)
                text = row.text[row.sent : chars] if chars > row.sent else ""
                row.sent = max(row.sent, chars)
                if text or count > row.sent_tokens:
                    deltas.setdefault(id(job), (job, []))[1].append(delta(row, text, count))
        for entry in deltas.values():
            self._flush(entry)
        return keep

    def _flush(self, entry) -> None:
        if entry is not None:
            job, items = entry
            self._post(job, "delta", items)

    # ------------------------------------------------------------ failure

    def _fail_jobs(self, jobs: list[Job], error: Exception) -> None:
        for job in jobs:
            self._post(job, "error", UpstreamError(f"the local model failed while generating: {error}"))

    def _fail_running(self, error: RLProxyError) -> None:
        for job in {id(row.job): row.job for row in self.batch.rows}.values():
            self._post(job, "error", error)
        self.batch.clear()

    def _fail_everything(self, error: RLProxyError) -> None:
        self._fail_running(error)
        for waiting in (self.pending, self.background):
            while waiting:
                self._post(waiting.popleft(), "error", error)
