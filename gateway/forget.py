"""`rlproxy forget`: drop recorded traffic older than a cutoff that training no longer needs.

The store keeps every call and session until told otherwise; this is how an operator bounds it.
What goes and what stays is the store's rule (`gateway.store.retention`); this module reads the
flags, opens the store read/write beside any running gateway and trainer, and says what it did.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import re
import shlex
import time
from pathlib import Path

from gateway.errors import ConfigError, NotFound
from gateway.settings import Settings
from gateway.store.open import SQLITE_SCHEME, is_postgres_url, open_store
from gateway.store.retention import Forgotten

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_KEPT = "a group not yet trained or set aside, a candidate step's canary, or a shadow group still pending"


def add_arguments(command: argparse.ArgumentParser) -> None:
    group = command.add_argument_group("what to forget")
    when = group.add_mutually_exclusive_group(required=True)
    when.add_argument(
        "--older-than",
        metavar="DURATION",
        help="forget sessions last active longer ago than this: a number and a unit, s m h d or w (30d, 12h)",
    )
    when.add_argument(
        "--before",
        metavar="TIME",
        help="forget sessions last active before TIME (ISO 8601 such as 2026-11-01 or 2026-11-01T14:00, "
        "UTC unless it says otherwise, or Unix seconds)",
    )
    group.add_argument("--model", default=None, metavar="NAME", help="only sessions recorded under this model name")
    group.add_argument("--dry-run", action="store_true", help="say what would be forgotten, delete nothing")


def seconds(text: str) -> float:
    """`--older-than`: `30d`, `12h`, `90m`, `2w`, `3600s`; anything else is refused, with the forms it takes."""
    found = _DURATION.fullmatch(text.strip())
    if found is None:
        raise ConfigError(
            f"--older-than {text!r} is not a duration: give a number and a unit, s, m, h, d or w (30d, 12h, 90m)"
        )
    return float(found.group(1)) * _UNITS[found.group(2)]


def moment(text: str) -> float:
    """`--before`: Unix seconds, or ISO 8601 (UTC when it names no zone)."""
    try:
        value = float(text)
    except ValueError:
        try:
            parsed = dt.datetime.fromisoformat(text.strip())
        except ValueError:
            raise ConfigError(
                f"--before {text!r} is not a time: give 2026-11-01, 2026-11-01T14:00 or Unix seconds"
            ) from None
        value = (parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)).timestamp()
    if value != value or value in (float("inf"), float("-inf")):
        raise ConfigError(f"--before {text!r} is not a time: give 2026-11-01, 2026-11-01T14:00 or Unix seconds")
    return value


def cutoff_from(older_than: str | None, before: str | None, now: float) -> float:
    """The cutoff the flags name; one in the future is refused (it would forget the traffic of now)."""
    cutoff = now - seconds(older_than) if older_than is not None else moment(str(before))
    if cutoff > now:
        raise ConfigError(
            f"--before {before} is in the future ({utc(cutoff)}; now {utc(now)}): "
            "only traffic already recorded can be forgotten"
        )
    return cutoff


def utc(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def report(done: Forgotten, where: str) -> list[str]:
    """What `rlproxy forget` prints: the cutoff, the rows by table, what was kept, and the space."""
    plan = done.plan
    model = f" of model '{plan.model}'" if plan.model is not None else ""
    rows = ", ".join(f"{table} {count}" for table, count in done.counts.items())
    lines = [
        f"cutoff: {utc(plan.cutoff)} (sessions{model} last active before it)",
        f"{'would forget' if plan.dry_run else 'forgot'} (rows by table): {rows}",
        f"kept: {done.kept_older} older session(s) that training may still need ({_KEPT})",
    ]
    if plan.dry_run:
        lines.append("dry run: nothing was deleted")
    elif done.free_bytes is not None and done.counts["sessions"]:
        lines.append(
            f"the SQLite file keeps its size: {done.free_bytes / 2**20:.1f} MiB of it is free pages, which new "
            f"traffic fills first; to give them back to the disk, stop every gateway and trainer on it and run "
            f"sqlite3 {shlex.quote(where)} VACUUM"
        )
    return lines


def run(settings: Settings, args: argparse.Namespace) -> list[str]:
    """Forget what the flags say in the store the settings name; the report's lines."""
    cutoff = cutoff_from(args.older_than, args.before, time.time())
    target = str(settings.store or settings.db_path)
    path = Path(target.removeprefix(SQLITE_SCHEME))
    if not is_postgres_url(target) and not path.is_file():
        raise NotFound(f"no store at {target}: pass the --state-dir (or --store) the gateway ran with")
    store = open_store(target if settings.store else path)
    try:
        done = store.forget(cutoff, args.model, dry_run=args.dry_run)
    finally:
        asyncio.run(store.close())
    return report(done, str(path))
