"""vLLM's chat wire, both ways: what rlproxy asks vLLM for, and what the client gets back.

Pure functions over JSON dicts (no I/O but the SSE reader), so each rule is tested alone:
- `vllm_body`: the client's body with `return_token_ids: true`, `logprobs: true`, the
  client's own `top_logprobs` (0 when it asked for none) and every sampling field explicit
  (`sampling_in_force`: what the client left out gets OpenAI's default, never the model's
  `generation_config.json`);
- `split_completion` / `StreamSplitter`: vLLM's answer -> the client's OpenAI-shaped answer
  (no token ids, `logprobs: null` unless asked, `top_logprobs` cut to the number asked) plus
  the `TokenRecord` (prompt ids from `prompt_token_ids`, completion ids from each choice's
  `token_ids`, logprobs from `logprobs.content[i].logprob`; in a stream, prompt ids come on the
  first chunk and ids and logprobs per chunk);
- `status_error`: vLLM's error answer as the gateway's error (its 4xx the client's fault, its
  5xx a 502).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from gateway.engines.base import ChoiceTokens, TokenRecord
from gateway.errors import InvalidRequest, RLProxyError, UpstreamError
from gateway.settings import is_greedy

# vLLM-only response fields that carry nothing when null; dropped so the client sees OpenAI's shape.
_NULL_EXTRAS = ("prompt_logprobs", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics")
_NULL_CHOICE_EXTRAS = ("stop_reason", "routed_experts")
_NULL_MESSAGE_EXTRAS = ("reasoning", "reasoning_content")


@dataclass(frozen=True)
class ClientAsk:
    """What the client itself asked to see of tokens and logprobs."""

    logprobs: bool
    top_logprobs: int
    token_ids: bool  # the client sent vLLM's own `return_token_ids`

    @classmethod
    def of(cls, body: dict) -> ClientAsk:
        return cls(
            logprobs=bool(body.get("logprobs")),
            top_logprobs=int(body.get("top_logprobs") or 0),
            token_ids=bool(body.get("return_token_ids")),
        )


# OpenAI's defaults for what a client leaves out; vLLM's own spelling where it has extras.
# top_k -1 = off (vLLM >= 0.8 also reads 0 as off; -1 is accepted by every version we support).
OPENAI_SAMPLING_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}
SAMPLING_KEYS = (*OPENAI_SAMPLING_DEFAULTS, "seed", "max_tokens")


# vLLM handles lower values first; live calls keep its default, 0.
BACKGROUND_PRIORITY = 10


def sampling_in_force(body: dict) -> dict:
    """Every sampling parameter of this call, explicit: the client's value or OpenAI's default.

    Sent to vLLM as is, so its `--generation-config` defaults can never apply, and recorded as
    `TokenRecord.sampling`. `max_tokens` None = up to the context length; `seed` None = unseeded.
    """
    out = {}
    for key, default in OPENAI_SAMPLING_DEFAULTS.items():
        value = body.get(key)
        out[key] = default if value is None else value
    out["temperature"] = vllm_temperature(out["temperature"])
    out["seed"] = body.get("seed")
    limit = body.get("max_completion_tokens")
    out["max_tokens"] = limit if limit is not None else body.get("max_tokens")
    return out


VLLM_MIN_TEMPERATURE = 1e-2
"""vLLM raises a temperature in (0, 1e-2) to 1e-2 (`_MAX_TEMP` in vllm/sampling_params.py,
`SamplingParams.__post_init__`) before it decides greedy (`temperature < _SAMPLING_EPS`)."""


def vllm_temperature(value):
    """The temperature vLLM samples at for the client's `value`, sent and recorded as such:
    below `GREEDY_BELOW` (1e-5) it is greedy, 0, as on every engine (vLLM itself would raise
    1e-6 to 1e-2 and sample); up to 1e-2, vLLM's own floor. Anything else as it is (vLLM
    judges what is not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return value
    if is_greedy(value):
        return 0.0
    return max(value, VLLM_MIN_TEMPERATURE)


def vllm_body(
    body: dict, model: str, ask: ClientAsk, *, background: bool = False, request_id: str | None = None
) -> dict:
    """The body sent to vLLM: the client's, with the served model, token ids and logprobs
    switched on and every sampling field explicit. Background work (shadow samples) goes at
    BACKGROUND_PRIORITY: behind live calls on a vLLM started with `--scheduling-policy priority`
    (as rlproxy starts it); a first-come-first-served vLLM takes the field and ignores it. A
    client's own `priority` is dropped: a negative one would jump ahead of every other client.
    `request_id`, the gateway's: vLLM logs the call as `chatcmpl-ID` (`--enable-log-requests`),
    so one id follows a call through the gateway, its response header and vLLM's log."""
    out = dict(body)
    out.pop("priority", None)
    if request_id is not None:
        out["request_id"] = request_id
    if background:
        out["priority"] = BACKGROUND_PRIORITY
    out.update({key: value for key, value in sampling_in_force(body).items() if key in OPENAI_SAMPLING_DEFAULTS})
    out["model"] = model
    out["return_token_ids"] = True
    out["logprobs"] = True
    out["top_logprobs"] = ask.top_logprobs if ask.logprobs else 0
    return out


def behaviour_logprobs(values: list[float] | None, sampling: dict) -> list[float] | None:
    """The recorded mu: vLLM's processed logprobs, except for greedy calls (temperature 0).

    A greedy token is drawn from a point mass (mu = 1), but vLLM's greedy path returns
    log_softmax of the penalised logits (sampler.py, `Sampler.sample`, all_greedy branch):
    not the distribution sampled from, so it is left unknown (the trainer's weight is 1).
    """
    if values is None or not sampling.get("temperature"):  # greedy: `vllm_temperature` made it 0
        return None
    return values


def _logprob_values(logprobs: dict | None) -> list[float] | None:
    content = (logprobs or {}).get("content")
    if content is None:
        return None
    return [float(entry["logprob"]) for entry in content]


def _client_logprobs(logprobs: dict | None, ask: ClientAsk) -> dict | None:
    if not ask.logprobs or logprobs is None:
        return None
    out = dict(logprobs)
    if out.get("content") is not None:
        out["content"] = [
            {**entry, "top_logprobs": (entry.get("top_logprobs") or [])[: ask.top_logprobs]} for entry in out["content"]
        ]
    return out


def _drop_null(mapping: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        if key in mapping and mapping[key] is None:
            del mapping[key]


def split_completion(data: dict, ask: ClientAsk, sampling: dict | None = None) -> tuple[dict, TokenRecord | None]:
    """A vLLM chat.completion -> (what the client sees, the token record). Mutates and returns `data`.
    `sampling` is `sampling_in_force` of the request (recorded, and greedy calls record no mu)."""
    sampling = sampling if sampling is not None else dict(OPENAI_SAMPLING_DEFAULTS)
    prompt_ids = data.pop("prompt_token_ids", None)
    _drop_null(data, _NULL_EXTRAS)
    choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
    records: list[ChoiceTokens] = []
    for choice in choices:
        ids = choice.pop("token_ids", None)
        values = _logprob_values(choice.get("logprobs"))
        if ids is not None:
            if values is not None and len(values) != len(ids):
                values = None  # misaligned logprobs are worse than none: the trainer re-scores
            records.append(ChoiceTokens(completion_ids=list(ids), logprobs=behaviour_logprobs(values, sampling)))
        choice["logprobs"] = _client_logprobs(choice.get("logprobs"), ask)
        if ask.token_ids:
            choice["token_ids"] = ids
        _drop_null(choice, _NULL_CHOICE_EXTRAS)
        if isinstance(choice.get("message"), dict):
            _drop_null(choice["message"], _NULL_MESSAGE_EXTRAS)
    if ask.token_ids:
        data["prompt_token_ids"] = prompt_ids
    if prompt_ids is None or len(records) != len(choices):
        return data, None
    return data, TokenRecord(prompt_ids=list(prompt_ids), choices=records, sampling=sampling)


class StreamSplitter:
    """Per stream: strips each vLLM chunk to what the client asked for and collects the token record."""

    def __init__(self, ask: ClientAsk, sampling: dict | None = None):
        self.ask = ask
        self.sampling = sampling if sampling is not None else dict(OPENAI_SAMPLING_DEFAULTS)
        self.prompt_ids: list[int] | None = None
        self.ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float] | None] = {}

    def feed(self, chunk: dict) -> dict | None:
        """The chunk for the client, or None when nothing in it is for the client."""
        prompt_ids = chunk.pop("prompt_token_ids", None)
        if prompt_ids is not None and self.prompt_ids is None:
            self.prompt_ids = list(prompt_ids)
        _drop_null(chunk, _NULL_EXTRAS)
        had_choices = bool(chunk.get("choices"))
        kept = []
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            ids = choice.pop("token_ids", None)
            values = _logprob_values(choice.get("logprobs"))
            if ids:
                self.ids.setdefault(index, []).extend(ids)
                collected = self.logprobs.setdefault(index, [])
                if collected is not None:
                    if values is None or len(values) != len(ids):
                        self.logprobs[index] = None
                    else:
                        collected.extend(values)
            choice["logprobs"] = _client_logprobs(choice.get("logprobs"), self.ask)
            if self.ask.token_ids:
                choice["token_ids"] = ids
            _drop_null(choice, _NULL_CHOICE_EXTRAS)
            delta = choice.get("delta") or {}
            _drop_null(delta, _NULL_MESSAGE_EXTRAS)
            # vLLM sends a chunk with an empty delta when return_token_ids is on and a parser held
            # the text back; those exist only to carry token ids.
            if delta or choice.get("finish_reason") is not None or choice["logprobs"] or self.ask.token_ids:
                kept.append(choice)
        chunk["choices"] = kept
        if self.ask.token_ids and prompt_ids is not None:
            chunk["prompt_token_ids"] = prompt_ids
        if had_choices and not kept and not chunk.get("usage"):
            return None
        return chunk

    def record(self) -> TokenRecord | None:
        if self.prompt_ids is None or not self.ids:
            return None
        count = max(self.ids) + 1
        choices = []
        for index in range(count):
            ids = self.ids.get(index, [])
            values = self.logprobs.get(index)
            aligned = values if values is not None and len(values) == len(ids) else None
            choices.append(ChoiceTokens(completion_ids=ids, logprobs=behaviour_logprobs(aligned, self.sampling)))
        return TokenRecord(prompt_ids=self.prompt_ids, choices=choices, sampling=self.sampling)


# ---------------------------------------------------------------------------- helpers


def maybe_json(payload: bytes) -> object:
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None


def loads(payload: bytes, what: str) -> dict:
    data = maybe_json(payload)
    if not isinstance(data, dict):
        raise UpstreamError(f"vLLM sent something that is not {what}: {payload[:300].decode(errors='replace')}")
    return data


def error_message(data: object) -> str:
    """vLLM's error text: `{"error": {"message"}}` (current) or `{"object": "error", "message"}` (older)."""
    if not isinstance(data, dict):
        return ""
    error = data.get("error", data)
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or "")
    return str(error)


_PAST_THE_CONTEXT = (
    "maximum context length",  # its serving layer: "This model's maximum context length is N tokens. ..."
    "longer than the maximum model length",  # its input processor: "The decoder prompt (length N) is ..."
)


def status_error(status: int, payload: bytes, target: str) -> RLProxyError:
    """vLLM's error answer to a chat request for `target` (the adapter or base model name)."""
    body = maybe_json(payload)
    # A body that is not vLLM's JSON (a proxy's error page, say) is not repeated to the client:
    # the engine logs it (`VLLMEngine._answer_error`).
    message = error_message(body) or f"its {len(payload)}-byte body is in the gateway's log"
    if status == 404:
        return UpstreamError(f"vLLM does not serve '{target}': {message}")
    if status < 500:
        detail = body.get("error") if isinstance(body, dict) else None
        param, code = (detail.get("param") if isinstance(detail, dict) else None), None
        if any(phrase in message for phrase in _PAST_THE_CONTEXT):  # as the local engine says it, and OpenAI
            param, code = "messages", "context_length_exceeded"
        # an InvalidRequest, so that a protocol's route names the fields as its client wrote them
        error = InvalidRequest(f"vLLM rejected the request: {message}", param=param, code=code)
        error.status_code = status
        return error
    return UpstreamError(f"vLLM answered {status}: {message}")
