"""A step's checkpoint files read back from a PostgreSQL store (`gateway.store.files`): a replica
or a trainer on a machine that lacks them fetches them from the database, verified (a mixin of
`PostgresStore`: its class stays within its size limit)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from gateway.store import files as store_files
from gateway.store.locks import lock_blobs
from gateway.store.steps import has_adapter


class PostgresStepFiles:
    def _query(self, sql: str, params: tuple | dict = ()) -> list[dict]:  # implemented by `PostgresStore`
        raise NotImplementedError

    def step_files(self, model: str, step: int) -> list[tuple[str, str, int]]:
        return store_files.listed(self._query, model, step)

    def stored_steps(self, model: str) -> set[int]:
        return {row["step"] for row in self._query("SELECT DISTINCT step FROM step_files WHERE model = ?", (model,))}

    def _checkpoint_kept(self, conn: Any, model: str, step: int, path: str) -> bool:
        """As `StepRows._checkpoint_kept`, in the database first: a gateway on another machine than the
        trainer loads a step from its file list, which `--keep-checkpoints` drops (a step recorded
        without files, by an older rlproxy, loads from its path)."""
        lock_blobs(conn, exclusive=False)  # a prune (`_hold_off_decisions`) first, or this decision first
        listed = conn.execute("SELECT 1 FROM step_files WHERE model = ? AND step = ? LIMIT 1", (model, step))
        return listed.fetchone() is not None or has_adapter(path)

    def _hold_off_decisions(self, conn: Any) -> None:
        """As `StepRows._hold_off_decisions`: the blobs' lock, exclusive, which a decision takes shared
        before it looks for a step's files (`_checkpoint_kept`)."""
        lock_blobs(conn, exclusive=True)

    def _drop_step_files(self, conn: Any, model: str, keep: int, kept: set[int]) -> list[int]:
        """As `StepRows._drop_step_files`: file lists dropped, then the blobs none names (`store_files`)."""
        return store_files.prune_file_lists(conn, model, keep, kept)

    def fetch_step_files(self, model: str, step: int, raw_path: str, models_dir: Path) -> str:
        """A local directory holding step `step`'s adapter, verified: the files an engine reads
        (`store_files.served`) are fetched into `models_dir/MODEL/store/NNNN` (the trainer's own
        path is on its machine). A step recorded without files (by an older rlproxy) keeps its path.
        Run at every load, the gateway's first at its start included."""
        dest = store_files.fetched_dir(models_dir, model, step)
        store_files.remove_abandoned_fetches(dest.parent)  # what fetches killed mid-way left there
        fetched = self.restore_checkpoint(model, step, dest, store_files.served)
        return raw_path if fetched is None else str(fetched)

    def forget_step_files(self, model: str, step: int, models_dir: Path) -> None:
        """Remove what `fetch_step_files` fetched for a step no engine holds any more (unloaded):
        else a replica kept a copy of every step the trainer ever published."""
        shutil.rmtree(store_files.fetched_dir(models_dir, model, step), ignore_errors=True)

    def restore_checkpoint(
        self, model: str, step: int, dest: Path, wanted: Callable[[str], bool] = lambda name: True
    ) -> Path | None:
        """A trainer on a machine without the checkpoint (moved, or a new node): the step's
        files (adapter, optimizer state, trainer state) from the store into `dest`, verified;
        only those whose name is `wanted` where given. None if the step was recorded without files."""
        listing = self.step_files(model, step)
        if not listing:
            return None
        wanted_files = [entry for entry in listing if wanted(entry[0])]
        return store_files.materialize(partial(store_files.read_blob, self._query), wanted_files, Path(dest))
