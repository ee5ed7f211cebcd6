"""A row's text as its tokens arrive: incremental decoding, stop strings, what may be streamed.

Text is tracked incrementally (vLLM's detokenizer: decode a short window of the newest ids)
when a request streams or watches for stop strings. Text that could still become a stop
string or an incomplete UTF-8 character is held back from stream deltas, and with stop
strings only whole tokens are sent, so a later cut never takes back what was sent.

The worker thread calls these once per row per step; they read and write the `Row`.
"""

from __future__ import annotations

from gateway.engines.local.jobs import Row


class Detokenizer:
    """Decodes token ids with the model's tokenizer, and keeps each row's text up to date."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._backend = None  # the Python side would change spaces the backend keeps

    def decode(self, ids: list[int]) -> str:
        if self._backend is not None:  # the Rust tokenizer directly: half the cost, same text
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def advance(self, row: Row) -> None:
        """Extend `row.text` by the newest token, holding back an incomplete UTF-8 character."""
        before = self.decode(row.ids[row.prefix : row.read])
        after = self.decode(row.ids[row.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            row.text += after[len(before) :]
            row.prefix, row.read = row.read, len(row.ids)
        row.offsets.append(len(row.text))

    def cut_at_stop(self, row: Row) -> str | None:
        """If the text holds a stop string, cut the text right before it (OpenAI's: the stop
        string never shows, and what precedes it always does, even part of a token's text) and
        the tokens to those whose text ends at or before it. Returns the stop string it cut at
        (the earliest; the first listed of those at one place), None if none.

        A token whose text runs into the stop string is left out of the record (ids, logprobs):
        the client never saw all of its text, so the trainer must not learn it. The record then
        decodes to the text less that token's part before the stop string (at most one token)."""
        stops = row.job.sampling.stops
        longest = max(len(s) for s in stops)
        previous = row.offsets[-2] if len(row.offsets) > 1 else 0
        search_from = max(0, previous - longest + 1)
        hits = [(p, s) for s in stops if (p := row.text.find(s, search_from)) >= 0]
        if not hits:
            return None
        cut, matched = min(hits, key=lambda hit: hit[0])
        row.text = row.text[:cut]
        kept = 0
        for k, offset in enumerate(row.offsets, start=1):
            if offset <= cut:
                kept = k
        # Tokens that added no text are bytes of a character still incomplete after them: at
        # the end of what is kept, the first bytes of one the stop string begins with (an
        # emoji, a CJK character spread over byte-level tokens). Kept, they decode to U+FFFD.
        while kept and row.offsets[kept - 1] == (row.offsets[kept - 2] if kept > 1 else 0):
            if not self.decode(row.ids[:kept]).endswith("\ufffd"):
                break
            kept -= 1
        del row.ids[kept:], row.logprobs[kept:], row.top[kept:], row.offsets[kept:]
        row.sent = min(row.sent, len(row.text))
        return matched

    def finish(self, row: Row) -> None:
        """Set a finished row's final text: the whole text, including any held-back bytes, unless
        a stop string cut it (`cut_at_stop` set it then, maybe ending inside a token)."""
        if row.stop_reason is None:
            row.text = self.decode(row.ids)


def streamable(row: Row) -> tuple[int, int]:
    """How much of the row can be streamed now, as (characters, tokens): never part of a
    possible stop string (with stop strings, only whole tokens before the held-back tail,
    so a later cut never takes back what was sent)."""
    limit = len(row.text)
    stops = row.job.sampling.stops
    if not stops:
        return limit, len(row.ids)
    limit = min(limit, len(row.text) - (max(len(s) for s in stops) - 1))
    chars = count = previous = 0
    for k, offset in enumerate(row.offsets, start=1):
        # a token that added no text may hold the first bytes of a stop string's character,
        # which a cut takes out (`cut_at_stop`): its logprob goes with the next token that adds text
        if previous < offset <= limit:
            chars, count = offset, k
        previous = offset
    return chars, count


def delta(row: Row, text: str, upto: int) -> tuple:
    """A stream event for one row: new text, and the tokens [sent_tokens, upto) with their logprobs."""
    start, row.sent_tokens = row.sent_tokens, max(row.sent_tokens, upto)
    return (row.index, text, row.ids[start:upto], row.logprobs[start:upto], row.top[start:upto])
