"""`rlproxy export`: recorded sessions as files other tools read.

- `rlproxy`: one session per line, as `GET /v1/sessions/{id}` returns it (calls included).
- `openai`: one trained sample per line, as a conversation in OpenAI's chat fine-tuning
  format (`openai_format`), for SFT or distillation elsewhere.
- `parquet`: one row per trained sample, with the trainer's token ids, loss mask and
  behaviour logprobs (`PARQUET_SCHEMA`).
"""

from __future__ import annotations

import errno
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import orjson

from gateway.errors import ConfigError, InvalidRequest
from gateway.export.openai_format import conversation, wire_messages
from gateway.export.samples import ExportedSample, LazyRenderer, exported_samples
from gateway.export.selection import close_store, open_store, select_sessions
from gateway.store import SessionFilter
from gateway.store.open import SQLITE_SCHEME, is_postgres_url

FORMATS = ("rlproxy", "openai", "parquet")
PARQUET_BATCH_ROWS = 1024
"""Samples held in memory before they go to the parquet file as one row group."""


@dataclass(frozen=True)
class ExportResult:
    sessions: int
    """Sessions that passed the filters."""
    rows: int
    """Lines or rows written: sessions (rlproxy) or samples (openai, parquet)."""


def check_output(path: str) -> None:
    """Refuse an --output that cannot be written as a file before any work is done (a
    directory, a parent that is a file): a clear line, not a traceback after the export ran."""
    if path == "-":
        return
    target = Path(path)
    try:
        if target.is_dir():
            raise IsADirectoryError(errno.EISDIR, "it is a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"cannot write --output {path}: a folder on its path is a file") from None
    except OSError as exc:
        raise ConfigError(
            f"cannot write --output {path}: {exc.strerror or exc}; give a file path (or - for stdout)"
        ) from None


def _not_the_store(output: str, db_path: Path | str) -> None:
    """Refuse an --output that is the SQLite store itself (or its WAL): writing the export
    over it destroyed every recorded call and reward."""
    text = str(db_path)
    if output == "-" or is_postgres_url(text):
        return
    database = Path(text.removeprefix(SQLITE_SCHEME)).resolve()
    target = Path(output).resolve()
    if target in {database, *(database.with_name(database.name + end) for end in ("-wal", "-shm", "-journal"))}:
        raise ConfigError(f"--output {output} is the store itself: give another file (or - for stdout)")


# What a disk answers a write it cannot take: said as the --output's (--out's) fault, in one line.
WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS}


@contextmanager
def _output(path: str) -> Iterator[IO[bytes]]:
    """The --output, open for writing. Stdout (`-`) whose reader stops reading ends the command
    quietly, as coreutils do (exit 141). A file is written beside itself and renamed over it once
    complete: an export that failed half-way (a full disk) left a truncated file, over the
    previous export, that read as a whole one. A device or a pipe (/dev/null, a FIFO) is written
    as it is. A write the disk refuses is one line naming the file and the cause."""
    if path == "-":
        try:
            yield sys.stdout.buffer
            sys.stdout.buffer.flush()
        except BrokenPipeError:  # `rlproxy export | head`: the reader stopped reading; it was a traceback
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit fails too
            raise SystemExit(128 + 13) from None  # SIGPIPE's: what `seq 1 1000000 | head -1` exits with
        return
    check_output(path)
    target = Path(os.path.realpath(path))  # a link to the file keeps pointing at the new export
    # In place where no file can be made beside it (a writable file in a directory that is not).
    whole = (not target.exists() or target.is_file()) and os.access(target.parent, os.W_OK)
    written = target.with_name(f".{target.name}.{os.getpid()}.partial") if whole else target
    try:
        out = open(written, "wb")
    except OSError as exc:
        raise ConfigError(f"cannot write --output {path}: {exc.strerror or exc}") from None
    try:
        with out:
            yield out
        if whole:
            if target.exists():  # the file keeps its mode (one made private stays private)
                os.chmod(written, target.stat().st_mode & 0o7777)
            os.replace(written, target)
    except BaseException as exc:
        if whole:
            written.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in WRITE_ERRORS:
            kept = f"; {path} is as it was" if whole and target.exists() else ""
            raise ConfigError(f"cannot write --output {path}: {exc.strerror or exc}{kept}") from None
        raise


def export_trajectories(
    db_path: Path | str,
    output: str,
    *,
    fmt: str = "rlproxy",
    where: SessionFilter | None = None,
    base_model: str | None = None,
    state_dir: Path | None = None,
    chat_template: str | None = None,
) -> ExportResult:
    """Write the sessions `where` selects from the store at `db_path` to `output` (a path,
    or "-" for stdout) in format `fmt`. `base_model` renders calls recorded without token
    ids (the `openai` engine) for the sample formats, with `chat_template` (`--chat-template`) if given."""
    if fmt not in FORMATS:
        raise InvalidRequest(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "parquet" and output == "-":
        raise InvalidRequest("parquet is a binary file format: give a file with --output")
    where = where or SessionFilter()
    if state_dir is None and is_postgres_url(str(db_path)):
        raise InvalidRequest("exporting from --store postgresql://... needs the --state-dir the trainer wrote to")
    state_dir = Path(state_dir) if state_dir is not None else Path(db_path).parent
    check_output(output)
    _not_the_store(output, db_path)
    store = open_store(db_path)
    try:
        # One session (calls included) at a time, from the store to the file: a store of a
        # million sessions exports in the memory of its largest one.
        sessions = _Counted(select_sessions(store, where))
        if fmt == "rlproxy":
            with _output(output) as out:
                for session in sessions:
                    out.write(orjson.dumps(session, default=str) + b"\n")
            return ExportResult(sessions.count, sessions.count)
        from gateway.settings import TINY_MODEL_ID

        render = LazyRenderer(base_model or TINY_MODEL_ID, state_dir, chat_template)
        samples = exported_samples(store, sessions, render, state_dir / "models")
        if fmt == "openai":
            rows = _write_openai(samples, output)
        else:
            rows = _write_parquet(samples, output)
        return ExportResult(sessions.count, rows)
    finally:
        close_store(store)


class _Counted:
    """The sessions of a selection, passed on one by one and counted on the way."""

    def __init__(self, sessions: Iterator[dict]):
        self._sessions = sessions
        self.count = 0

    def __iter__(self) -> Iterator[dict]:
        for session in self._sessions:
            self.count += 1
            yield session


def _write_openai(samples: Iterator[ExportedSample], output: str) -> int:
    rows = 0
    with _output(output) as out:
        for item in samples:
            line = conversation(item.call.get("request") or {}, item.call.get("response") or {}, set(item.trained))
            if line is not None:
                out.write(orjson.dumps(line) + b"\n")
                rows += 1
    return rows


def parquet_schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("session_id", pa.string()),
            ("group_id", pa.string()),
            ("split", pa.string()),
            ("model", pa.string()),
            ("sample_index", pa.int32()),  # position among the session's samples
            ("step", pa.int32()),  # the step that trained it; null if never trained
            ("sampled_by_step", pa.int32()),  # the adapter step that answered the sample's last call
            ("reward", pa.float64()),
            ("advantage", pa.float64()),  # as trained; null if never trained
            ("token_ids", pa.list_(pa.int32())),  # prompt + completion, what the trainer's row holds
            ("loss_mask", pa.list_(pa.bool_())),  # True on the sampled tokens the loss covers
            ("old_logprobs", pa.list_(pa.float64())),  # behaviour logprobs; null where unknown (prompt tokens)
            ("temperatures", pa.list_(pa.float64())),  # the temperature each token was sampled (and is scored) at
            ("prompt_ids", pa.list_(pa.int32())),  # token_ids before the first trained token
            ("completion_ids", pa.list_(pa.int32())),  # token_ids from the first trained token on
            ("messages", pa.string()),  # JSON: request messages + reply (a prefill and its continuation: one)
            ("tools", pa.string()),  # JSON: the request's tools, or null
        ]
    )


def _row(item: ExportedSample) -> dict:
    sample, session, call = item.sample, item.session, item.call
    first = sample.loss_mask.index(True)
    request = call.get("request") or {}
    messages = wire_messages(request, call.get("response") or {}) or list(request.get("messages") or [])
    return {
        "session_id": session["id"],
        "group_id": session.get("group_id"),
        "split": session.get("split"),
        "model": session.get("model"),
        "sample_index": item.index,
        "step": item.step,
        "sampled_by_step": call.get("step"),
        "reward": session.get("reward"),
        "advantage": item.advantage,
        "token_ids": list(sample.token_ids),
        "loss_mask": list(sample.loss_mask),
        "old_logprobs": [None if math.isnan(x) else x for x in sample.old_logprobs],
        "temperatures": list(sample.temperatures) if sample.temperatures is not None else [1.0] * len(sample.token_ids),
        "prompt_ids": list(sample.token_ids[:first]),
        "completion_ids": list(sample.token_ids[first:]),
        "messages": orjson.dumps(messages).decode(),
        "tools": orjson.dumps(request["tools"]).decode() if request.get("tools") else None,
    }


def _write_parquet(samples: Iterator[ExportedSample], output: str) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("--format parquet needs pyarrow: pip install 'rlproxy[export]'") from None
    schema = parquet_schema()
    written = 0
    batch: list[dict] = []
    # An empty selection still writes the schema. The writer leaves `out` open: `_output` closes it.
    with _output(output) as out, pq.ParquetWriter(out, schema) as writer:
        for item in samples:
            batch.append(_row(item))
            if len(batch) == PARQUET_BATCH_ROWS:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                written, batch = written + len(batch), []
        if batch:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
    return written + len(batch)
