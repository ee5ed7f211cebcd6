"""Secrets out of text: an upstream's error before a client, the store or the log sees it
(`redact`), and the settings written to the log, beside checkpoints and to trackers (`masked`).

Pure functions over strings (layer 0): `gateway.settings` and everything above use them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from urllib.parse import quote

MASK = "***"
# A name is secret when one of its words (split at - _ . and spaces) ends in one of these:
# `sslpassword`, `api_key`, `hf-token`, `apikey`; not `max-num-batched-tokens` nor `ssl-keyfile`.
_SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "pwd", "pass", "credential", "signature")
# scheme://USER:PASSWORD@host: greedy up to the last @ before the path, so a password may hold an @.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^/?#\s]*)@")
_QUERY = re.compile(r"(?P<lead>[?&;](?P<name>[^=&#;?\s]*)=)(?P<value>[^&#;\s]*)")
# libpq's key=value form (`host=h password='p w'`), spaces around = allowed.
_DSN = re.compile(r"(?P<lead>(?:^|(?<=\s))(?P<name>[A-Za-z_][\w-]*)\s*=\s*)(?P<value>'(?:[^'\\]|\\.)*'|[^\s']+)")
_FLAG = re.compile(r"(?P<lead>--?(?P<name>[\w-]+)[=\s]\s*)(?P<value>.+)")


def redact(text: str, secrets: Iterable[str]) -> str:
    """`text` with every secret replaced by `MASK`: as it is, percent-encoded, and as it
    reads inside a JSON string (an upstream may echo a header in any of these forms)."""
    forms: set[str] = set()
    for secret in secrets:
        if secret:
            forms |= {secret, quote(secret, safe=""), json.dumps(secret)[1:-1]}
    for form in sorted(forms, key=len, reverse=True):  # longest first: one form may hold another
        text = text.replace(form, MASK)
    return text


def secret_name(name: str) -> bool:
    """Whether a setting, query parameter or flag called `name` holds a secret."""
    return any(word.endswith(_SECRET_WORDS) for word in re.split(r"[-_.\s]+", name.lower()) if word)


def _masker(found: list[str] | None) -> Callable[[re.Match], str]:
    def mask(match: re.Match) -> str:
        if "info" in match.groupdict():  # user-info: the user stays, the password goes
            user, colon, password = match["info"].partition(":")
            if not colon and not match["scheme"].lower().startswith("http"):
                return match[0]  # postgresql://USER@host: a user name, no secret
            hidden, kept = (password, f"{user}:") if colon else (match["info"], "")  # https://TOKEN@host
            if found is not None:
                found.append(hidden)
            return f"{match['scheme']}{kept}{MASK}@"
        if not secret_name(match["name"]) or not match["value"]:
            return match[0]
        if found is not None:
            found.append(match["value"].strip("'"))
        return match["lead"] + MASK

    return mask


def mask_text(text: str, found: list[str] | None = None) -> str:
    """A URL or DSN without its secrets: user-info, secret-looking query parameters, libpq
    `password=...`; each value hidden is appended to `found` when given."""
    mask = _masker(found)
    for pattern in (_USERINFO, _QUERY, _DSN):
        text = pattern.sub(mask, text)
    return text


def mask_args(args: list[str], found: list[str] | None = None) -> list[str]:
    """Command-line arguments without secrets: `--hf-token=V`, `--hf-token V` (one item or two)."""
    out: list[str] = []
    for i, arg in enumerate(args):
        flag = _FLAG.fullmatch(arg)
        before = args[i - 1] if i else ""
        if flag and secret_name(flag["name"]):
            arg = _masker(found)(flag)
        elif before.startswith("-") and not arg.startswith("-") and not _FLAG.fullmatch(before) and secret_name(before):
            if found is not None:
                found.append(arg)
            arg = MASK
        out.append(mask_text(arg, found))
    return out


def masked(data: dict, found: list[str] | None = None) -> dict:
    """Settings (as JSON) fit to log or write down: secret-named values, and every secret
    inside a string or a list of strings, masked; each value hidden appended to `found`."""
    out = {}
    for name, value in data.items():
        if value and isinstance(value, str) and secret_name(name):
            if found is not None:
                found.append(value)
            value = MASK
        elif isinstance(value, str):
            value = mask_text(value, found)
        elif isinstance(value, list) and all(isinstance(item, str) for item in value):
            value = mask_args(value, found)
        out[name] = value
    return out


def hidden_in(data: dict) -> list[str]:
    """The secrets `masked` hides in `data` (for `redact`)."""
    found: list[str] = []
    masked(data, found)
    return [secret for secret in found if secret and secret != MASK]
