"""Adapters through the store: a step's checkpoint files, content-addressed and checksummed.

The trainer's `insert_step` (on PostgreSQL) first writes every file of the checkpoint
directory as a blob keyed by its SHA-256 (`blobs`), then the step's file list (`step_files`)
with the step row, in one transaction: once a replica sees a step, its files are there. A replica whose models
dir lacks the step (the trainer is on another machine) fetches the adapter's files (`served`) into
`MODELS_DIR/NAME/store/NNNN/`, checks every file's SHA-256 and size against the list, and
only then hands the directory to the engine. No shared filesystem is needed. A fetch killed
mid-way leaves its temporary directory, which the next fetch there removes (`remove_abandoned_fetches`).

`--keep-checkpoints N` drops the file lists of the steps whose checkpoints it removes, and the
blobs no list names any more (`prune_file_lists`): else the database kept every step's adapter
and optimizer state for ever. A blob is shared by every step whose file it is (an unchanged
config, across models too), so it goes only when no list names it; lists are written and blobs
collected under one advisory lock (`locks.lock_blobs`), and a list's writer puts back a blob
collected since its upload (`write_file_list`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.errors import ConfigError
from gateway.store.locks import lock_blobs


class StepFilesError(ConfigError):
    """A step's files in the store do not match their checksums (or are missing)."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetched_dir(models_dir: Path, model: str, step: int) -> Path:
    """Where a replica keeps the files of `model`'s step `step` it fetched from the store."""
    return Path(models_dir).resolve() / model / "store" / f"{int(step):04d}"


def served(name: str) -> bool:
    """Whether an engine reads the step file `name` to serve the step: the PEFT adapter, that is
    `adapter_config.json` and its weights (`adapter_model.safetensors`, `.bin` from an older PEFT),
    what the local engine's `PeftModel.from_pretrained` and vLLM's `load_lora_adapter` read. Not
    the optimizer state (twice the adapter's size) nor the trainer's own files: a replica fetched
    those for every step it served, and never read them."""
    return name == "adapter_config.json" or name.startswith("adapter_model.")


def checkpoint_files(directory: Path) -> list[Path]:
    """The regular files at the top of a checkpoint directory (what a step consists of)."""
    return sorted(p for p in Path(directory).iterdir() if p.is_file() and not p.name.startswith("."))


def _upload(conn: Any, path: Path) -> str:
    """Store the file at `path` as a blob unless one with its content is there; its SHA-256."""
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    present = conn.execute("SELECT 1 FROM blobs WHERE sha256 = ?", (digest,)).fetchone()
    if present is None:
        conn.execute(
            "INSERT INTO blobs (sha256, size, data) VALUES (?, ?, ?) ON CONFLICT (sha256) DO NOTHING",
            (digest, len(data), data),
        )
    return digest


def upload_blobs(conn: Any, directory: Path) -> list[tuple[str, str]]:
    """Write the checkpoint's files into the store as blobs (inside the caller's transaction), and
    list them: (name, sha256) each. Content-addressed: a file already stored (an unchanged config)
    is not sent twice, and a blob no step lists (its record refused) harms none."""
    return [(path.name, _upload(conn, path)) for path in checkpoint_files(directory)]


def write_file_list(conn: Any, model: str, step: int, listing: list[tuple[str, str]], directory: Path) -> None:
    """The step's file list, in its step row's transaction: a record refused (its step number taken,
    a group trained meanwhile) leaves the list of the step recorded under that number as it was.
    A blob uploaded (or found stored) before, then collected by another trainer's prune since (no
    list named it yet), is stored again from `directory`: the list never names a missing blob."""
    lock_blobs(conn, exclusive=False)
    for name, digest in listing:
        if conn.execute("SELECT 1 FROM blobs WHERE sha256 = ?", (digest,)).fetchone() is None:
            if _upload(conn, directory / name) != digest:
                raise StepFilesError(f"file {name!r} of {directory} changed while the step was recorded")
    conn.execute("DELETE FROM step_files WHERE model = ? AND step = ?", (model, step))
    for name, digest in listing:
        conn.execute(
            "INSERT INTO step_files (model, step, name, sha256) VALUES (?, ?, ?, ?)", (model, step, name, digest)
        )


def prune_file_lists(conn: Any, model: str, keep: int, protected: set[int]) -> list[int]:
    """`--keep-checkpoints`, in the store: drop the file lists of `model`'s steps older than the newest
    `keep` with files, except `protected` (the steps `trainer.resume.prune_checkpoints` keeps on disk),
    then every blob no list names (another step's, another model's, stays). Returns the steps dropped."""
    lock_blobs(conn, exclusive=True)
    listed = [
        row[0]
        for row in conn.execute(
            "SELECT DISTINCT step FROM step_files WHERE model = ? ORDER BY step", (model,)
        ).fetchall()
    ]
    dropped = [step for step in listed[:-keep] if step not in protected] if keep > 0 else []
    for step in dropped:
        conn.execute("DELETE FROM step_files WHERE model = ? AND step = ?", (model, step))
    if dropped:
        conn.execute("DELETE FROM blobs b WHERE NOT EXISTS (SELECT 1 FROM step_files f WHERE f.sha256 = b.sha256)")
    return dropped


def collect_unlisted(conn: Any, digests: set[str]) -> int:
    """Delete the blobs of `digests` that no file list names: those a step's record uploaded before
    it was refused (its step number taken, a session discarded, the store failing mid-record). Its
    checkpoint is discarded, so nothing would ever name them, and without `--keep-checkpoints` no
    prune collects them either. Under the exclusive lock: a trainer uploading the same content
    meanwhile stores it again when it lists it (`write_file_list`). How many went."""
    lock_blobs(conn, exclusive=True)
    gone = 0
    for digest in sorted(digests):
        cursor = conn.execute(
            "DELETE FROM blobs b WHERE b.sha256 = ?"
            " AND NOT EXISTS (SELECT 1 FROM step_files f WHERE f.sha256 = b.sha256)",
            (digest,),
        )
        gone += int(cursor.rowcount or 0)
    return gone


def listed(query: Callable[[str, tuple], list[dict]], model: str, step: int) -> list[tuple[str, str, int]]:
    """Step `step`'s file list: (name, sha256, size) each, by name (empty: none kept)."""
    rows = query(
        "SELECT f.name, f.sha256, b.size FROM step_files f JOIN blobs b ON b.sha256 = f.sha256"
        " WHERE f.model = ? AND f.step = ? ORDER BY f.name",
        (model, step),
    )
    return [(r["name"], r["sha256"], int(r["size"])) for r in rows]


def read_blob(query: Callable[[str, tuple], list[dict]], digest: str) -> bytes | None:
    """The blob's bytes, None where no blob has that SHA-256 (collected by a prune, for one)."""
    rows = query("SELECT data FROM blobs WHERE sha256 = ?", (digest,))
    return bytes(rows[0]["data"]) if rows else None


def _safe_name(name: str) -> str:
    # Names come from the database (another machine): never a path.
    if not name or "/" in name or "\\" in name or name in (".", "..") or name.startswith("."):
        raise StepFilesError(f"step file name {name!r} is not a plain file name")
    return name


def _verified(directory: Path, listing: list[tuple[str, str, int]]) -> bool:
    return all(
        (directory / name).is_file()
        and (directory / name).stat().st_size == size
        and sha256_file(directory / name) == digest
        for name, digest, size in listing
    )


def _locked(directory: Path, blocking: bool) -> int | None:
    """An open descriptor of `directory` holding its exclusive `flock`, None where another holds it,
    the directory is gone, or its filesystem locks no directories (NFS may refuse one opened to read).
    The lock goes when the descriptor is closed, by its process's exit too."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        return None
    return fd


def remove_abandoned_fetches(parent: Path) -> None:
    """Remove the temporary directories under `parent` (a replica's `store/`, where only fetches write)
    of fetches whose process is gone (killed mid-way: nothing else removed them, a copy of a step each).
    A fetch holds its directory's lock while it runs (`_claim`), so a live one's, in this process or
    another, is never touched; a process id reused since (a restarted container) holds nothing."""
    for entry in parent.iterdir() if parent.is_dir() else ():
        if not entry.name.startswith(".tmp-") or not entry.is_dir():
            continue
        fd = _locked(entry, blocking=False)
        if fd is not None:
            try:
                shutil.rmtree(entry, ignore_errors=True)
            finally:
                os.close(fd)


def _claim(dest: Path) -> tuple[Path, int | None]:
    """A new temporary sibling of `dest` (`.tmp-NNNN-PID-XXXX`: unique, so no other fetch's), whose lock
    is held while the fetch runs (`remove_abandoned_fetches` leaves it alone). A sweep in another
    process may lock it between the mkdir and the lock and remove it: then another is made. Where
    the filesystem locks no directories, none is held (and no sweep there can take one either)."""
    while True:
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-{os.getpid()}-", dir=dest.parent))
        fd = _locked(tmp, blocking=True)
        if fd is None and tmp.is_dir():
            return tmp, None
        if fd is not None and tmp.is_dir() and os.stat(tmp).st_ino == os.fstat(fd).st_ino:
            return tmp, fd
        if fd is not None:
            os.close(fd)


def materialize(read_blob: Callable[[str], bytes | None], listing: list[tuple[str, str, int]], dest: Path) -> Path:
    """Fetch the files of `listing` (name, sha256, size) into `dest`, verified, atomically:
    written into a hidden sibling, each file's checksum checked, then renamed to `dest`."""
    if dest.is_dir() and _verified(dest, listing):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp, lock = _claim(dest)
    try:
        for name, digest, size in listing:
            data = read_blob(digest)
            if data is None or len(data) != size or hashlib.sha256(data).hexdigest() != digest:
                raise StepFilesError(f"file {name!r} of {dest.name} does not match its checksum in the store")
            target = tmp / _safe_name(name)
            with open(target, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        if not _verified(tmp, listing):
            raise StepFilesError(f"files of {dest.name} changed while written")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if lock is not None:
            os.close(lock)
    return dest
