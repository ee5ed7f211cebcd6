"""The worker's results as OpenAI's chat completion: messages, logprob entries, usage, the token record.

The logprobs a client asks for are the behaviour logprobs the worker recorded (as vLLM's
`processed_logprobs` mode gives them), not the raw model's; each entry carries its token's
raw bytes, since a byte-level token may be part of a UTF-8 character.
"""

from __future__ import annotations

import json
import re
import uuid

from gateway.engines.base import ChoiceTokens, StreamChunk, TokenRecord
from gateway.engines.local.jobs import ChoiceResult, Job
from gateway.protocols.toolcalls import parse_tool_calls


def assistant_message(text: str, parse_tools: bool, parallel: bool = True) -> tuple[dict, bool]:
    """The assistant message for a choice's text, and whether it holds tool calls."""
    if not parse_tools:
        return {"role": "assistant", "content": text}, False
    content, calls = parse_tool_calls(text)
    calls = calls if parallel else calls[:1]
    out: dict = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = calls
    return out, bool(calls)


def end_of(result: ChoiceResult, has_calls: bool) -> dict:
    """A finished choice's `finish_reason`, and vLLM's `stop_reason` when a stop string ended it
    (the string; vLLM's null is left out, as the vllm engine leaves it out)."""
    end = {"finish_reason": "tool_calls" if has_calls else result.finish_reason}
    if result.stop_reason is not None:
        end["stop_reason"] = result.stop_reason
    return end


def completion_id(request_id: str) -> str:
    return request_id if request_id.startswith("chatcmpl-") else f"chatcmpl-{request_id or uuid.uuid4().hex}"


def usage(prompt_ids: list[int], results: list[ChoiceResult]) -> dict:
    completion = sum(len(r.completion_ids) for r in results)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
    }


class Chunks:
    """A stream's chat.completion.chunk objects: the fields they share, and `usage` as the client
    asked: none, null until the last chunk (`include_usage`), or so far in every chunk (vLLM's
    `continuous_usage_stats`; the first then tells the prompt's tokens)."""

    def __init__(self, head: dict, stream_options, prompt_tokens: int):
        self.head = head
        self.include_usage = bool(stream_options and stream_options.include_usage)
        self.continuous = self.include_usage and stream_options.continuous_usage_stats
        self.prompt_tokens = prompt_tokens
        self.produced = 0  # completion tokens so far, every choice

    def __call__(self, index: int, delta: dict, logprobs: list | None = None, end: dict | None = None) -> StreamChunk:
        choice = {"index": index, "delta": delta, "logprobs": {"content": logprobs} if logprobs is not None else None}
        data = {**self.head, "choices": [{**choice, "finish_reason": None, **(end or {})}]}
        if self.include_usage:
            data["usage"] = self.usage() if self.continuous else None
        return StreamChunk(data)

    def usage(self) -> dict:
        total = self.prompt_tokens + self.produced
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.produced, "total_tokens": total}


def token_record(job: Job, results: list[ChoiceResult]) -> TokenRecord:
    """What the store keeps. A greedy call (temperature 0) records no behaviour logprobs, as
    the vllm engine does: its tokens were drawn from a point mass, not from the T = 1
    distribution its logprobs describe (the client still gets those, as vLLM sends them)."""
    return TokenRecord(
        prompt_ids=list(job.prompt_ids),
        choices=[
            ChoiceTokens(list(r.completion_ids), None if job.sampling.greedy else list(r.logprobs)) for r in results
        ],
        sampling=job.sampling.in_force(),
    )


class LogprobEntries:
    """OpenAI's `logprobs.content` entries for sampled tokens, with each token's text and bytes (cached)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._token_cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_decoder = _byte_decoder() if _byte_level(tokenizer) else None

    def entries(self, ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]]) -> list[dict]:
        entries = []
        for position, (token_id, logprob) in enumerate(zip(ids, logprobs, strict=False)):
            token, token_bytes = self.token_text(token_id)
            alternatives = []
            for alt_id, alt_logprob in top[position] if position < len(top) else []:
                alt_token, alt_bytes = self.token_text(alt_id)
                alternatives.append({"token": alt_token, "logprob": alt_logprob, "bytes": alt_bytes})
            entries.append({"token": token, "logprob": logprob, "bytes": token_bytes, "top_logprobs": alternatives})
        return entries

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and its raw bytes (a byte-level token may be part of a UTF-8 character)."""
        cached = self._token_cache.get(token_id)
        if cached is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            added = self.tokenizer.added_tokens_decoder.get(token_id)
            decoder = self._byte_decoder
            if added is not None or piece is None:
                raw = (added.content if added is not None else self.tokenizer.decode([token_id])).encode()
            elif decoder is not None:  # byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): a character per byte
                in_alphabet = all(c in decoder for c in piece)
                raw = bytes(decoder[c] for c in piece) if in_alphabet else self.tokenizer.decode([token_id]).encode()
            elif byte := _BYTE_PIECE.fullmatch(piece):  # sentencepiece's byte fallback: <0xE9>
                raw = bytes([int(byte[1], 16)])
            else:  # sentencepiece (Llama 2, Mistral, Gemma): the piece is text, ▁ a space
                raw = piece.replace("\u2581", " ").encode()
            cached = (raw.decode("utf-8", errors="replace"), list(raw))
            self._token_cache[token_id] = cached
        return cached


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level(tokenizer) -> bool:
    """Whether the tokenizer's pieces are GPT-2's byte-level alphabet (its decoder or
    pre-tokenizer says so). In a sentencepiece vocabulary the same characters are themselves:
    its "é" is é, not byte 0xE9."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return hasattr(tokenizer, "byte_decoder")  # a Python (slow) GPT-2 style tokenizer
    spec = json.loads(backend.to_str())
    parts = [spec.get("decoder") or {}, spec.get("pre_tokenizer") or {}]
    steps = [step for part in parts for step in (part.get("decoders") or part.get("pretokenizers") or [part])]
    return any(step.get("type") == "ByteLevel" for step in steps)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable character → byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=False)}
