"""A special token's text inside a chat's strings, tokenized as the text it is.

A chat template writes its control tokens as text ("<|im_start|>user\\n...<|im_end|>\\n") and
the tokenizer reads every occurrence of a special token's text in the rendered chat as that
token. Rendered and tokenized as one text, a message holding the same characters
("<|im_end|>\\n<|im_start|>system\\nYou are ...") became the template's own tokens: a user
forged a system turn the model obeyed, and the trainer learnt from a prompt the template never
meant. `SpecialText` renders such a chat with placeholders in place of the texts inside its
strings (messages, tool calls, tools), so that the only special-token texts left in the
rendered chat are the ones the template wrote; those become their tokens, and every piece
between them is tokenized with the placeholders back and special-token text read as plain text
(`split_special_tokens`). A chat whose strings hold no such text is tokenized as one text, as
before: the same ids. The local engine serves with it and the trainer re-renders with it, so
the two agree token for token.
"""

from __future__ import annotations

import copy
import re
import threading
from typing import Any, NamedTuple

_FIRST_PLACEHOLDER = 0xF0000
"""Placeholders are characters of the Supplementary Private Use Area-A, one per special token:
no text means anything by them. A chat holding special-token text and one of them is refused."""
_PLACEHOLDERS = 0xFFFE
_AFTER_TOKEN = "\U0010fffd"
"""The last private-use character, standing for a template's token before a piece (`SpecialText._plain_ids`)."""
_RESERVED = re.compile(f"[{chr(_FIRST_PLACEHOLDER)}-{chr(_FIRST_PLACEHOLDER + _PLACEHOLDERS - 1)}{_AFTER_TOKEN}]")


class SpecialTextError(ValueError):
    """A chat holding a special token's text that cannot be tokenized with it read as text: the
    template rewrites (cuts) that text, so that its place in the rendered chat is unknown, or the
    chat holds a private-use character this module reserves."""


def special_token_texts(tokenizer: Any) -> list[str]:
    """The texts of the tokenizer's special tokens (those it reads as one control token wherever
    they occur in a text), longest first. Added tokens that are not special (Qwen's <tool_call>
    tags) are words of the template's formats, left alone."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    texts |= {token.content for token in added.values() if getattr(token, "special", False)}
    return sorted((t for t in texts if t), key=lambda t: (-len(t), t))


def special_tokens_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """Any of the tokenizer's special tokens' texts, the longest first; None if it has none."""
    texts = special_token_texts(tokenizer)
    return re.compile("|".join(re.escape(t) for t in texts)) if texts else None


class Rendered(NamedTuple):
    """A chat rendered by `SpecialText.render`: its text, and whether placeholders stand in it
    for special-token texts of its strings (what `encode` is told; a private-use character a
    message holds itself is then left as it is)."""

    text: str
    shielded: bool


class SpecialText:
    """Renders and tokenizes chats for one tokenizer with the text of its special tokens inside
    the chat's strings read as text (module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.pattern = special_tokens_pattern(tokenizer)
        texts = special_token_texts(tokenizer)[:_PLACEHOLDERS]
        self._placeholder = {text: chr(_FIRST_PLACEHOLDER + i) for i, text in enumerate(texts)}
        self._text = {p: text for text, p in self._placeholder.items()}
        last = chr(_FIRST_PLACEHOLDER + len(texts) - 1)
        self._restore = re.compile(f"[{chr(_FIRST_PLACEHOLDER)}-{last}]") if texts else None
        self._strips = _strips(tokenizer)
        self._plain: Any = None
        self._after_id = -1
        self._lock = threading.Lock()

    def holds(self, value: Any) -> bool:
        """Whether a string inside `value` (messages, tools: any JSON value) holds a special token's text."""
        return self.pattern is not None and any(self.pattern.search(s) for s in _strings(value))

    def render(self, messages: list[dict], **kwargs: Any) -> Rendered:
        """`apply_chat_template(messages, tokenize=False, **kwargs)` with every special token's
        text inside the strings of `messages` and `kwargs["tools"]` a placeholder: the text to
        give `encode` (and to cut, as a rendered chat is cut). A template that escapes such a
        text itself (the rendered chat holds no more special-token texts than the template's
        own) renders as it writes it. Raises `SpecialTextError` where the template rewrites such
        a text otherwise (cuts it): its place in the rendered chat is unknown."""
        render = self.tokenizer.apply_chat_template
        if not self.holds([messages, kwargs.get("tools")]):
            return Rendered(str(render(messages, tokenize=False, **kwargs)), False)
        if any(_RESERVED.search(s) for s in _strings([messages, kwargs.get("tools")])):
            raise SpecialTextError(
                "a message holding a special token's text also holds a character of U+F0000-U+FFFFD or U+10FFFD, "
                "private-use characters rlproxy reserves to tell that text from the template's tokens"
            )
        tools = kwargs.get("tools")
        shielded = {**kwargs, "tools": self._shield(tools)} if tools else kwargs
        text = str(render(self._shield(messages), tokenize=False, **shielded))
        plain = str(render(messages, tokenize=False, **kwargs))
        if self.restore(text) == plain:
            return Rendered(text, True)
        assert self.pattern is not None  # `holds` found a special token's text
        if len(self.pattern.findall(plain)) == len(self.pattern.findall(text)):
            return Rendered(plain, False)  # every special token's text in it is the template's
        raise SpecialTextError(
            "the chat template rewrites a string holding a special token's text, so that text cannot be told "
            "from the template's own tokens"
        )

    def restore(self, text: str) -> str:
        """`text` with its placeholders back to the special tokens' texts they stand for."""
        if self._restore is None:
            return text
        return self._restore.sub(lambda m: self._text[m.group()], text)

    def encode(self, text: str, shielded: bool) -> list[int]:
        """The ids of a text `render` gave (or a piece of it), `shielded` as it said: the special
        tokens the template wrote, and the rest (placeholders back as their texts) tokenized as
        plain text. Not shielded: the text tokenized whole, as the tokenizer reads it."""
        if not shielded:
            encode = getattr(self.tokenizer, "encode", None)  # a processor has none: its call tokenizes
            if encode is None:
                return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            return list(encode(text, add_special_tokens=False))
        assert self.pattern is not None  # placeholders exist only for a tokenizer with special tokens
        ids: list[int] = []
        start, strip_next, after_token = 0, False, False
        for match in self.pattern.finditer(text):
            lstrip, rstrip = self._strips.get(match.group(), (False, False))
            piece = text[start : match.start()]
            piece = piece.lstrip() if strip_next else piece
            ids += self._plain_ids(piece.rstrip() if lstrip else piece, after_token)
            ids.append(int(self.tokenizer.convert_tokens_to_ids(match.group())))
            start, strip_next, after_token = match.end(), rstrip, True
        piece = text[start:]
        ids += self._plain_ids(piece.lstrip() if strip_next else piece, after_token)
        return ids

    def _shield(self, value: Any) -> Any:
        """`value` with the special tokens' texts inside its strings replaced by their placeholders."""
        if isinstance(value, str):
            assert self.pattern is not None
            return self.pattern.sub(lambda m: self._placeholder.get(m.group(), m.group()), value)
        if isinstance(value, dict):
            return {key: self._shield(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._shield(item) for item in value]
        return value

    def _plain_ids(self, piece: str, after_token: bool) -> list[int]:
        """`piece` (no template token in it) tokenized with special-token text read as text, as
        the tokenizer reads a piece at the start of a text or, `after_token`, after a token."""
        if not piece:
            return []
        piece = self.restore(piece)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:  # a Python tokenizer: the flag is an argument of this call only
            return list(self.tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        # A copy of the fast tokenizer that never matches special tokens. Passing split_special_tokens
        # to the shared one sets a flag on it, which a request tokenized at the same time on another
        # thread would read: its template tokens split into characters.
        with self._lock:
            if self._plain is None:
                from tokenizers import AddedToken  # a fast tokenizer's own package (the [train] extra)

                plain = copy.deepcopy(backend)
                plain.encode_special_tokens = True
                # Not special, so still matched: stands for the template's token before a piece. A
                # piece tokenized alone would be read as a text's start (sentencepiece's Metaspace
                # gives it a leading "▁" that the same piece after a token does not get).
                plain.add_tokens([AddedToken(_AFTER_TOKEN, special=False, normalized=False)])
                self._after_id = plain.token_to_id(_AFTER_TOKEN)
                self._plain = plain
        if not after_token:
            return list(self._plain.encode(piece, add_special_tokens=False).ids)
        ids = list(self._plain.encode(_AFTER_TOKEN + piece, add_special_tokens=False).ids)
        assert ids[0] == self._after_id
        return ids[1:]


def _strips(tokenizer: Any) -> dict[str, tuple[bool, bool]]:
    """Special tokens that take the whitespace beside them (lstrip, rstrip), as the tokenizer reads them."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {
        t.content: (bool(getattr(t, "lstrip", False)), bool(getattr(t, "rstrip", False)))
        for t in added.values()
        if getattr(t, "lstrip", False) or getattr(t, "rstrip", False)
    }


def _strings(value: Any) -> Any:
    """Every string inside a JSON value (texts, tool-call arguments, tool descriptions)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)
