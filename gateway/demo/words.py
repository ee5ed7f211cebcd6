"""How much of a text is English: the share of its words found in a dictionary.

A reward that counts capitals can be gamed by capital gibberish ("LADERMARKEL"): the reward
rises while the replies stop being language. This measure sees that happen. A word is a run
of 3 or more ASCII letters (shorter runs are mostly in any list, and by chance); it counts
as English when Debian's `wamerican` list (`apt-get install wamerican`) has it, ignoring
case. A model that repeats one real word ("HELLO HELLO HELLO") would pass on the share
alone, so `distinct_share` says how many of the found words differ.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from pathlib import Path

DICTIONARY = Path("/usr/share/dict/american-english")
"""Debian's `wamerican` word list, one word a line."""

WORD = re.compile(r"[A-Za-z]{3,}")


@functools.lru_cache(maxsize=2)
def _load(path: Path) -> frozenset[str] | None:
    try:
        return frozenset(line.strip().lower() for line in path.read_text(encoding="utf-8", errors="replace").split())
    except OSError:
        return None


def dictionary_share(texts: Iterable[str | None], words: Iterable[str] | None = None) -> dict:
    """{"share", "distinct_share", "words"} of `texts`: `words` is how many words (runs of 3+
    ASCII letters) they hold, `share` the fraction of those the dictionary has (`words`, or
    `DICTIONARY` when None), `distinct_share` the distinct found words over the found words
    (None when none is found). Without a dictionary or a word both are None, and `reason`
    says why."""
    found_in = frozenset(w.lower() for w in words) if words is not None else _load(DICTIONARY)
    tokens = [w.lower() for text in texts if text for w in WORD.findall(text)]
    if found_in is None:
        return {
            "share": None,
            "distinct_share": None,
            "words": len(tokens),
            "reason": f"no word list at {DICTIONARY}: apt-get install wamerican",
        }
    if not tokens:
        return {"share": None, "distinct_share": None, "words": 0, "reason": "no word of 3 or more letters"}
    found = [w for w in tokens if w in found_in]
    distinct = len(set(found)) / len(found) if found else None
    return {"share": len(found) / len(tokens), "distinct_share": distinct, "words": len(tokens)}
