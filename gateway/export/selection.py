"""Which recorded sessions an export covers.

The filters are ANDed. `since_step` looks at the policy that produced the data, not at
when it was trained: a session is kept when every one of its calls was answered by adapter
step `since_step` or later (the base model counts as step 0), the way one takes "what
`agent@40` and its successors did" for distillation.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
from collections.abc import Iterator
from pathlib import Path

from gateway.errors import ConfigError, NotFound
from gateway.store import SessionFilter, Store
from gateway.store.open import SQLITE_SCHEME, is_postgres_url, looks_like_url, open_for_reading
from trainer.data import answered_since


def store_exists(target: Path | str) -> bool:
    """A PostgreSQL URL (`--store`: its server says whether it is one), or an SQLite file that is
    there (`sqlite:///PATH` too: opening a missing one would create an empty store and export nothing)."""
    text = str(target)
    if is_postgres_url(text):
        return True
    if text.startswith(SQLITE_SCHEME):
        text = text[len(SQLITE_SCHEME) :]
    elif looks_like_url(text):
        return True  # `open_store` names the kinds it takes
    return Path(text).is_file()


def open_store(target: Path | str) -> Store:
    """The store at `target`: an SQLite file, or a postgresql:// URL (`--store`). Export only
    reads: a file on read-only media opens read-only (`gateway.store.read_only`)."""
    if not store_exists(target):
        raise NotFound(f"no store at {target}: pass the --state-dir (or --store) the gateway ran with")
    return open_for_reading(target)


def close_store(store: Store) -> None:
    """Close a store opened for reading (no writer task was started: this closes connections)."""
    asyncio.run(store.close())


def select_sessions(store: Store, where: SessionFilter) -> Iterator[dict]:
    """Sessions (`Store.get_session` dicts, calls included) that pass `where`, oldest first."""
    ids = store.select_session_ids(where)
    for session_id in ids:
        session = store.get_session(session_id)
        if where.since_step is not None and not answered_since(session["calls"], where.since_step):
            continue
        yield session


# ------------------------------------------------------------------ the flags


def add_selection_flags(command: argparse.ArgumentParser, title: str) -> None:
    """The session filters `rlproxy export` and `rlproxy train --objective sft` share
    (`gateway.store.SessionFilter`), defined once so both select the same sessions."""
    group = command.add_argument_group(title)
    group.add_argument("--split", choices=["train", "val"], default=None, help="only this split")
    group.add_argument("--rewarded", action="store_true", help="only sessions with a reward")
    group.add_argument("--min-reward", type=finite, default=None, help="only sessions rewarded at least this")
    group.add_argument(
        "--since-step",
        type=int,
        default=None,
        help="only sessions answered entirely by this adapter step or a later one",
    )
    group.add_argument("--group", action="append", metavar="GROUP_ID", help="only this group (repeatable)")
    group.add_argument(
        "--model", default=None, metavar="NAME", help="only sessions recorded under this model name (the client's)"
    )
    group.add_argument(
        "--since",
        type=_moment,
        default=None,
        metavar="TIME",
        help="only sessions started at or after TIME "
        "(ISO 8601 such as 2026-11-25 or 2026-11-25T14:00, UTC unless it says otherwise, or Unix seconds)",
    )
    group.add_argument("--until", type=_moment, default=None, metavar="TIME", help="only sessions started before TIME")


def finite(text: str) -> float:
    """A number on the command line; nan and inf are refused (every comparison with nan is
    false: `--min-reward nan` selected nothing, and said nothing). The demo's numbers use it too."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_int(text: str) -> int:
    """A count on the command line that must be 1 or more (`--epochs`, `--sft-sessions-per-step`):
    refused as the flags are read, before the trainer loads the model and saves a step 0."""
    return _whole_number(text, least=1)


def count(text: str) -> int:
    """A count on the command line that may be 0 (`rlproxy train --max-steps 0`: start, save step 0,
    stop) but is never negative: `--max-steps -1` was taken, trained nothing and exited 0."""
    return _whole_number(text, least=0)


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r} must be {least} or more")
    return value


def _moment(text: str) -> float:
    """A time on the command line: Unix seconds, or ISO 8601 (UTC when it names no zone)."""
    try:
        float(text)
    except ValueError:
        pass
    else:
        return finite(text)
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a time: give 2026-11-25, 2026-11-25T14:00 or Unix seconds"
        ) from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)).timestamp()


def selection_from_args(args: argparse.Namespace) -> SessionFilter:
    """The `SessionFilter` the flags of `add_selection_flags` describe."""
    return SessionFilter(
        split=args.split,
        rewarded=args.rewarded,
        min_reward=args.min_reward,
        since_step=args.since_step,
        groups=tuple(args.group or ()),
        model=args.model,
        since=args.since,
        until=args.until,
    )


# (the argparse dest, the flag): set to anything but its default, it selects
_SELECTION_FLAGS = (
    ("split", "--split"),
    ("rewarded", "--rewarded"),
    ("min_reward", "--min-reward"),
    ("since_step", "--since-step"),
    ("group", "--group"),
    ("model", "--model"),
    ("since", "--since"),
    ("until", "--until"),
)


def sft_selection(args: argparse.Namespace) -> SessionFilter | None:
    """`rlproxy train`'s selection: the sessions an `--objective sft` run distils, or None for
    GRPO, which trains every ready group; there a selection flag is refused, not ignored (a
    `--group g1` run trained all the others too)."""
    if args.objective == "sft":
        return selection_from_args(args)
    given = [flag for dest, flag in _SELECTION_FLAGS if getattr(args, dest, None) not in (None, False, [])]
    if given:
        raise ConfigError(
            f"{' and '.join(given)} {'selects' if len(given) == 1 else 'select'} the sessions of `--objective "
            "sft`; GRPO trains every ready group: add --objective sft, or leave the selection out"
        )
    return None
