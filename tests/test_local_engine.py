"""The local engine driven directly (no HTTP), on the tiny model."""

import asyncio
import os
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM

from gateway.engines.base import EngineRequest, StreamChunk, StreamEnd
from gateway.engines.local.engine import LocalEngine
from gateway.engines.local.response import LogprobEntries
from gateway.errors import InvalidRequest, NotFound, UpstreamError
from gateway.models.tiny import ensure_tiny_model

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine(model_dir):
    # The engine belongs to no event loop (a worker thread; each request brings its own loop),
    # so one instance serves every test.
    engine = LocalEngine(str(model_dir), "rlproxy/tiny-qwen2", max_batch_size=16, default_max_tokens=48)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def request(messages=MESSAGES, adapter=None, **body):
    return EngineRequest({"model": "tiny", "messages": messages, **body}, adapter, f"req-{time.monotonic_ns()}")


def teacher_forced(model, prompt_ids, completion_ids) -> list[float]:
    """Logprob of each completion token under `model`, one unpadded forward over prompt+completion."""
    with torch.no_grad():
        logits_TV = model(torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    logprobs_TV = torch.log_softmax(logits_TV, dim=-1)
    start = len(prompt_ids) - 1
    return [logprobs_TV[start + i, token].item() for i, token in enumerate(completion_ids)]


async def collect(engine, req) -> tuple[list[dict], StreamEnd, list[float]]:
    chunks, end, arrivals = [], None, []
    async for item in engine.stream(req):
        if isinstance(item, StreamEnd):
            end = item
        else:
            assert isinstance(item, StreamChunk)
            chunks.append(item.data)
            arrivals.append(time.monotonic())
    assert end is not None
    return chunks, end, arrivals


def stream_text(chunks, index=0) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if c["choices"] and c["choices"][0]["index"] == index
    )


class Script:
    """Makes the model write a fixed token sequence: a hook on the output layer that
    boosts the scripted token at each forward (one request, n=1, at a time)."""

    def __init__(self, engine, token_ids, delay=0.0):
        self.tokens, self.delay, self.step = list(token_ids), delay, 0
        self.handle = engine.loaded.model.get_output_embeddings().register_forward_hook(self)

    def __call__(self, module, inputs, output):
        if self.delay:
            time.sleep(self.delay)
        token = self.tokens[min(self.step, len(self.tokens) - 1)]
        self.step += 1
        output = output.clone()
        output[..., token] += 1000.0
        return output

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


# ---------------------------------------------------------------- basics


async def test_completion_shape_and_token_record(engine):
    result = await engine.complete(request(max_tokens=12, seed=3))
    response = result.response
    assert response["object"] == "chat.completion" and response["id"].startswith("chatcmpl-")
    assert response["model"] == "tiny" and isinstance(response["created"], int)
    (choice,) = response["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant" and choice["logprobs"] is None
    assert "tool_calls" not in choice["message"]
    (tokens,) = result.tokens.choices
    # prompt ids are the chat template's rendering with the generation prompt
    expected = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert result.tokens.prompt_ids == engine.tokenizer.encode(expected, add_special_tokens=False)
    assert engine.tokenizer.decode(tokens.completion_ids, skip_special_tokens=True) == choice["message"]["content"]
    assert len(tokens.logprobs) == len(tokens.completion_ids) and all(lp <= 0 for lp in tokens.logprobs)
    assert response["usage"] == {
        "prompt_tokens": len(result.tokens.prompt_ids),
        "completion_tokens": len(tokens.completion_ids),
        "total_tokens": len(result.tokens.prompt_ids) + len(tokens.completion_ids),
    }


async def test_seed_makes_it_deterministic(engine):
    first = await engine.complete(request(max_tokens=24, seed=11, temperature=0.9, top_p=0.95))
    again = await engine.complete(request(max_tokens=24, seed=11, temperature=0.9, top_p=0.95))
    other = await engine.complete(request(max_tokens=24, seed=12, temperature=0.9, top_p=0.95))
    assert first.tokens.choices[0].completion_ids == again.tokens.choices[0].completion_ids
    assert first.response["choices"][0]["message"] == again.response["choices"][0]["message"]
    assert first.tokens.choices[0].completion_ids != other.tokens.choices[0].completion_ids


async def test_n_choices_are_distinct_and_each_decodes(engine):
    result = await engine.complete(request(n=3, max_tokens=16, seed=5))
    choices = result.response["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    ids = [c.completion_ids for c in result.tokens.choices]
    assert len({tuple(i) for i in ids}) == 3
    for choice, tokens in zip(choices, result.tokens.choices, strict=False):
        assert engine.tokenizer.decode(tokens.completion_ids, skip_special_tokens=True) == choice["message"]["content"]
    assert result.response["usage"]["completion_tokens"] == sum(len(i) for i in ids)


def processed_reference(model, prompt_ids, completion_ids, sampling: dict) -> list[float]:
    """Independent reference for behaviour logprobs: one unpadded forward over prompt +
    completion, then, per position, the distribution the sampler draws from, written out
    directly: presence/frequency penalties from the counts of the completion so far, logits
    divided by temperature, softmax, then the top-p nucleus (smallest set of best tokens
    whose mass reaches top_p) renormalised."""
    T = sampling.get("temperature", 1.0)
    top_p = sampling.get("top_p", 1.0)
    presence, frequency = sampling.get("presence_penalty", 0.0), sampling.get("frequency_penalty", 0.0)
    with torch.no_grad():
        logits_TV = model(torch.tensor([prompt_ids + completion_ids])).logits[0].double()
    out = []
    for i, token in enumerate(completion_ids):
        scores = logits_TV[len(prompt_ids) - 1 + i].clone()
        for seen in set(completion_ids[:i]):
            count = completion_ids[:i].count(seen)
            scores[seen] -= frequency * count + presence
        probs = torch.softmax(scores / T, dim=-1)
        if top_p < 1.0:
            order = sorted(range(len(probs)), key=lambda t: -float(probs[t]))
            nucleus, mass = [], 0.0
            for t in order:
                nucleus.append(t)
                mass += float(probs[t])
                if mass >= top_p:
                    break
            kept = torch.zeros_like(probs)
            kept[nucleus] = probs[nucleus]
            probs = kept / kept.sum()
        out.append(float(torch.log(probs[token])))
    return out


@pytest.mark.parametrize(
    "sampling",
    [
        {},
        {"temperature": 0.5},
        {"temperature": 0.7, "top_p": 0.6},
        {"temperature": 1.3, "presence_penalty": 1.5},
        {"temperature": 0.8, "frequency_penalty": 1.0, "top_p": 0.9},
    ],
    ids=["T1", "T0.5", "T0.7-top_p", "presence", "frequency-top_p"],
)
async def test_behaviour_logprobs_are_the_processed_distribution(engine, reference, sampling):
    # Concurrent requests with different prompt lengths and samplings share the batch: left
    # padding, batch merging and other rows' settings must not leak into a row's logprobs.
    # The longest prompt finishes first, so the batch also drops padding columns mid-flight.
    others = [{"temperature": 1.0}, {"temperature": 0.3, "top_p": 0.5}]
    requests = [
        request([{"role": "user", "content": "Hi " * k}], max_tokens=limit, seed=k, n=1 + k % 2, **extra)
        for (k, limit), extra in zip(((1, 20), (7, 12), (30, 5)), [sampling, *others], strict=False)
    ]
    results = await asyncio.gather(*(engine.complete(r) for r in requests))
    result = results[0]
    assert result.tokens.sampling == {
        "temperature": sampling.get("temperature", 1.0),
        "top_p": sampling.get("top_p", 1.0),
        "top_k": -1,
        "min_p": 0.0,
        "presence_penalty": sampling.get("presence_penalty", 0.0),
        "frequency_penalty": sampling.get("frequency_penalty", 0.0),
        "repetition_penalty": 1.0,
        "seed": 1,
        "max_tokens": 20,
    }
    for tokens in result.tokens.choices:
        expected = processed_reference(reference, result.tokens.prompt_ids, tokens.completion_ids, sampling)
        assert len(tokens.logprobs) == len(tokens.completion_ids)
        assert max(abs(a - b) for a, b in zip(tokens.logprobs, expected, strict=False)) < 1e-4
        if sampling.get("temperature", 1.0) != 1.0 or sampling.get("top_p", 1.0) < 1.0:
            raw = teacher_forced(reference, result.tokens.prompt_ids, tokens.completion_ids)
            assert max(abs(a - b) for a, b in zip(tokens.logprobs, raw, strict=False)) > 0.05  # not the raw model's


async def test_top_k_and_repetition_penalty_shape_the_recorded_distribution(engine, reference):
    prompt = [{"role": "user", "content": "Say something long."}]
    result = await engine.complete(
        request(prompt, max_tokens=16, seed=3, temperature=0.9, top_k=5, repetition_penalty=1.3)
    )
    assert result.tokens.sampling["top_k"] == 5 and result.tokens.sampling["repetition_penalty"] == 1.3
    prompt_ids, ids = result.tokens.prompt_ids, result.tokens.choices[0].completion_ids
    with torch.no_grad():
        logits_TV = reference(torch.tensor([prompt_ids + ids])).logits[0].double()
    for i, (token, recorded) in enumerate(zip(ids, result.tokens.choices[0].logprobs, strict=False)):
        scores = logits_TV[len(prompt_ids) - 1 + i].clone()
        for seen in set(prompt_ids + ids[:i]):  # vLLM's rule: divide positive logits, multiply negative ones
            scores[seen] = scores[seen] / 1.3 if scores[seen] > 0 else scores[seen] * 1.3
        scores = scores / 0.9
        best5 = scores.topk(5).indices
        assert token in best5.tolist()
        expected = scores[token] - torch.logsumexp(scores[best5], dim=0)
        assert abs(recorded - float(expected)) < 1e-4


@pytest.mark.parametrize(
    "body", [{"top_k": "5"}, {"top_k": 2.5}, {"min_p": 2}, {"repetition_penalty": 0}, {"ignore_eos": "yes"}]
)
async def test_bad_extra_sampling_fields_are_refused(engine, body):
    with pytest.raises(InvalidRequest) as info:
        await engine.complete(request(max_tokens=2, **body))
    assert next(iter(body)) in info.value.message


async def test_response_logprobs_and_top_logprobs(engine):
    result = await engine.complete(request(max_tokens=8, seed=2, logprobs=True, top_logprobs=3))
    content = result.response["choices"][0]["logprobs"]["content"]
    tokens = result.tokens.choices[0]
    assert [e["logprob"] for e in content] == tokens.logprobs
    joined = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", errors="replace")
    assert joined == result.response["choices"][0]["message"]["content"]
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and tops[0]["logprob"] >= tops[1]["logprob"] >= tops[2]["logprob"]
        # The sampled token is one of the three most likely, or less likely than the third.
        assert entry["bytes"] in [t["bytes"] for t in tops] or entry["logprob"] <= tops[2]["logprob"] + 1e-6
        assert all(isinstance(t["token"], str) and isinstance(t["bytes"], list) for t in tops)


def test_logprob_entries_of_a_sentencepiece_vocabulary_are_its_own_text_and_bytes():
    """Llama 2, Mistral and Gemma's pieces are text (▁ a space, <0xC3> one byte by fallback), not
    GPT-2's byte-level alphabet: their 'é' is é, UTF-8 C3 A9, not the byte E9."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for piece in ("▁", "▁the", "▁caf", "é", "ü"):
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    ids = [vocab[piece] for piece in ("▁the", "▁caf", "é", "▁", "ü", "<0x21>")]
    entries = LogprobEntries(tokenizer).entries(ids, [-1.0] * len(ids), [])
    assert [e["token"] for e in entries] == [" the", " caf", "é", " ", "ü", "!"]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == tokenizer.decode(ids) == " the café ü!"
    assert LogprobEntries(tokenizer).token_text(vocab["<0xC3>"]) == ("\ufffd", [0xC3])  # half of a character


async def test_max_tokens_gives_length(engine):
    for body in ({"max_tokens": 5}, {"max_completion_tokens": 5}):
        result = await engine.complete(request(seed=1, **body))
        assert result.response["choices"][0]["finish_reason"] == "length"
        assert len(result.tokens.choices[0].completion_ids) == 5


async def test_eos_stops_and_is_recorded(engine):
    tok = engine.tokenizer
    script = tok.encode("Sure! The answer is 42.", add_special_tokens=False) + [tok.eos_token_id]
    with Script(engine, script):
        result = await engine.complete(request(max_tokens=40, seed=0))
    (choice,), tokens = result.response["choices"], result.tokens.choices[0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "Sure! The answer is 42."
    assert tokens.completion_ids == script  # <|im_end|> is part of the completion: the trainer learns to stop
    # prompt + completion is exactly the prefix of the next turn's rendering
    longer = MESSAGES + [choice["message"], {"role": "user", "content": "Thanks"}]
    rendered = tok.encode(
        tok.apply_chat_template(longer, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    assert rendered[: len(result.tokens.prompt_ids) + len(script)] == result.tokens.prompt_ids + script


async def test_ignore_eos_runs_to_max_tokens(engine):
    """vLLM's `ignore_eos` (benchmarks send it, for replies of one length): the eos is a token
    like any other, the choice ends at max_tokens."""
    tok = engine.tokenizer
    script = tok.encode("Done.", add_special_tokens=False) + [tok.eos_token_id]
    with Script(engine, script):
        result = await engine.complete(request(max_tokens=12, ignore_eos=True))
    assert result.response["choices"][0]["finish_reason"] == "length"
    assert result.tokens.choices[0].completion_ids[: len(script)] == script
    assert len(result.tokens.choices[0].completion_ids) == 12


async def test_penalties_change_sampling(engine):
    plain = await engine.complete(request(max_tokens=30, temperature=0))
    penalised = await engine.complete(request(max_tokens=30, temperature=0, frequency_penalty=2.0))
    ids, plain_ids = penalised.tokens.choices[0].completion_ids, plain.tokens.choices[0].completion_ids
    # Greedy decoding repeats itself; each use of a token lowers its logit by 2, so the penalised
    # reply uses more distinct tokens.
    assert len(set(ids)) > len(set(plain_ids))
    assert ids != plain_ids


async def test_greedy_and_tiny_top_p_agree(engine):
    greedy = await engine.complete(request(max_tokens=10, temperature=0))
    nucleus = await engine.complete(request(max_tokens=10, top_p=1e-6, seed=99))
    assert greedy.tokens.choices[0].completion_ids == nucleus.tokens.choices[0].completion_ids


async def test_a_near_zero_temperature_is_greedy_and_recorded_as_greedy(engine):
    # vLLM samples greedily below 1e-5 (_SAMPLING_EPS); so does the local engine, and the record
    # says so: temperature 0, no behaviour logprobs (the token came from a point mass).
    greedy = await engine.complete(request(max_tokens=10, temperature=0, logprobs=True))
    for seed in (1, 2):
        tiny = await engine.complete(request(max_tokens=10, temperature=1e-6, seed=seed, logprobs=True))
        assert tiny.tokens.choices[0].completion_ids == greedy.tokens.choices[0].completion_ids
        assert tiny.tokens.sampling["temperature"] == 0.0
        assert tiny.tokens.choices[0].logprobs is None
        # the client still gets logprobs, at T = 1 as vLLM sends them for greedy calls
        assert tiny.response["choices"][0]["logprobs"] == greedy.response["choices"][0]["logprobs"]
    assert greedy.tokens.sampling["temperature"] == 0.0 and greedy.tokens.choices[0].logprobs is None


# ---------------------------------------------------------------- stop strings


async def test_stop_string_cuts_text_and_tokens(engine):
    tok = engine.tokenizer
    full = await engine.complete(request(max_tokens=40, seed=21))
    text, ids = full.response["choices"][0]["message"]["content"], full.tokens.choices[0].completion_ids
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = text.find(stop)
    for stream in (False, True):
        body = dict(max_tokens=40, seed=21, stop=[stop, "never-there"])
        if stream:
            chunks, end, _ = await collect(engine, request(stream=True, **body))
            got_text, got_ids = stream_text(chunks), end.tokens.choices[0].completion_ids
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        else:
            result = await engine.complete(request(**body))
            got_text = result.response["choices"][0]["message"]["content"]
            got_ids = result.tokens.choices[0].completion_ids
            finish = result.response["choices"][0]["finish_reason"]
        assert finish == "stop"
        assert got_text == text[:cut]  # right up to the stop string, which it leaves out
        assert got_ids == ids[: len(got_ids)]  # the tokens actually kept
        kept = tok.decode(got_ids, skip_special_tokens=True)  # all but a token that runs into the stop
        assert got_text.startswith(kept) and tok.decode(ids[: len(got_ids) + 1]).startswith(got_text)


async def test_a_stop_string_that_begins_inside_a_token_run_leaves_no_broken_character(engine):
    """🎉 is three byte-level tokens: cut before it, none of its bytes stay (no U+FFFD)."""
    tok = engine.tokenizer
    script = tok.encode("Hi 😀 there 🎉 ok", add_special_tokens=False) + [tok.eos_token_id]
    assert len(tok.encode("🎉", add_special_tokens=False)) > 1
    for stream in (False, True):
        with Script(engine, script):
            if stream:
                chunks, end, _ = await collect(engine, request(stream=True, max_tokens=40, stop=["🎉"], logprobs=True))
                text, ids = stream_text(chunks), end.tokens.choices[0].completion_ids
                streamed = [
                    e["logprob"]
                    for c in chunks
                    if c["choices"][0]["logprobs"]
                    for e in c["choices"][0]["logprobs"]["content"]
                ]
                assert streamed == end.tokens.choices[0].logprobs  # one entry per recorded token
            else:
                result = await engine.complete(request(max_tokens=40, stop=["🎉"]))
                text, ids = result.response["choices"][0]["message"]["content"], result.tokens.choices[0].completion_ids
        assert text == "Hi 😀 there "
        assert tok.decode(ids) == text  # the record holds no stray bytes of the emoji either


async def test_a_stop_string_that_begins_inside_a_token_keeps_the_text_before_it(engine):
    """OpenAI's stop: the text ends right before the stop string, even inside a token ("or" of
    "world", stop "rld": "... wo"); the record keeps only the tokens the client saw whole."""
    tok = engine.tokenizer
    words = tok.encode("Hello wonderful world", add_special_tokens=False)
    pieces = [tok.decode([token]) for token in words]
    assert "or" in pieces  # "rld" begins inside the token "or"
    script = words + [tok.eos_token_id]
    for stream in (False, True):
        with Script(engine, script):
            if stream:
                chunks, end, _ = await collect(engine, request(stream=True, max_tokens=40, stop=["rld"], logprobs=True))
                text, record = stream_text(chunks), end.tokens.choices[0]
                finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
            else:
                result = await engine.complete(request(max_tokens=40, stop=["rld"], logprobs=True))
                (choice,) = result.response["choices"]
                text, record, finish = choice["message"]["content"], result.tokens.choices[0], choice["finish_reason"]
        assert (text, finish) == ("Hello wonderful wo", "stop")
        assert tok.decode(record.completion_ids) == "Hello wonderful w"  # not "or": its "r" was never sent
        assert len(record.logprobs) == len(record.completion_ids)


# ---------------------------------------------------------------- streaming


async def test_stream_matches_non_stream(engine):
    body = dict(max_tokens=30, seed=8, n=2, logprobs=True, stream_options={"include_usage": True})
    plain = await engine.complete(request(**body))
    chunks, end, _ = await collect(engine, request(stream=True, **body))
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "tiny" for c in chunks)
    firsts = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert [c["choices"][0]["delta"] for c in firsts] == [{"role": "assistant", "content": ""}] * 2
    for index in range(2):
        assert stream_text(chunks, index) == plain.response["choices"][index]["message"]["content"]
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [
            plain.response["choices"][index]["finish_reason"]
        ]
        streamed_logprobs = [e["logprob"] for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
        assert streamed_logprobs == plain.tokens.choices[index].logprobs
        assert end.tokens.choices[index].completion_ids == plain.tokens.choices[index].completion_ids
    assert end.tokens.prompt_ids == plain.tokens.prompt_ids
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain.response["usage"]
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) > 5


async def test_stream_really_streams(engine):
    tok = engine.tokenizer
    script = tok.encode("one two three four five six seven eight nine ten", add_special_tokens=False)
    script.append(tok.eos_token_id)
    start = time.monotonic()
    with Script(engine, script, delay=0.03):
        chunks, end, arrivals = await collect(engine, request(stream=True, max_tokens=40))
    content_times = [
        t for c, t in zip(chunks, arrivals, strict=True) if c["choices"] and c["choices"][0]["delta"].get("content")
    ]
    assert stream_text(chunks) == "one two three four five six seven eight nine ten"
    assert len(content_times) >= 5
    # the first words arrive while the model is still writing the rest
    assert content_times[0] - start < (arrivals[-1] - start) / 2


async def test_closing_a_stream_cancels_it(engine):
    stream = engine.stream(request(stream=True, max_tokens=40, seed=4))
    async for item in stream:
        if item.data["choices"] and item.data["choices"][0]["delta"].get("content"):
            break
    await stream.aclose()
    result = await engine.complete(request(max_tokens=4, seed=4))
    assert len(result.tokens.choices[0].completion_ids) == 4


# ---------------------------------------------------------------- tools


TOOL_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def test_tool_calls_parsed(engine):
    tok = engine.tokenizer
    script = tok.encode(TOOL_TEXT, add_special_tokens=False) + [tok.eos_token_id]
    with Script(engine, script):
        result = await engine.complete(request(tools=TOOLS, max_tokens=60))
    choice = result.response["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # the recorded ids are the raw text, before parsing
    assert tok.decode(result.tokens.choices[0].completion_ids, skip_special_tokens=True) == TOOL_TEXT
    # and the tool round trip renders prefix-stably for the trainer's merge
    longer = MESSAGES + [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    rendered = tok.encode(
        tok.apply_chat_template(longer, tools=TOOLS, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    sequence = result.tokens.prompt_ids + result.tokens.choices[0].completion_ids
    assert rendered[: len(sequence)] == sequence
    # without tools (or with tool_choice "none") the text is left alone
    with Script(engine, script):
        plain = await engine.complete(request(tools=TOOLS, tool_choice="none", max_tokens=60))
    assert plain.response["choices"][0]["message"] == {"role": "assistant", "content": TOOL_TEXT}
    assert plain.response["choices"][0]["finish_reason"] == "stop"


async def test_tool_calls_streamed(engine):
    tok = engine.tokenizer
    script = tok.encode(TOOL_TEXT, add_special_tokens=False) + [tok.eos_token_id]
    with Script(engine, script):
        chunks, end, _ = await collect(engine, request(tools=TOOLS, max_tokens=60, stream=True))
    assert stream_text(chunks) == "Let me check."
    calls = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    assert end.tokens.choices[0].completion_ids == script


async def test_parallel_tool_calls_false_answers_with_the_first_call_only(engine):
    """As vLLM does (and Anthropic's `disable_parallel_tool_use` asks): the client gets one call;
    the record keeps what the model wrote."""
    tok = engine.tokenizer
    two = TOOL_TEXT + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    script = tok.encode(two, add_special_tokens=False) + [tok.eos_token_id]
    with Script(engine, script):
        both = await engine.complete(request(tools=TOOLS, max_tokens=80))
    assert len(both.response["choices"][0]["message"]["tool_calls"]) == 2
    with Script(engine, script):
        result = await engine.complete(request(tools=TOOLS, max_tokens=80, parallel_tool_calls=False))
    (call,) = result.response["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert result.response["choices"][0]["finish_reason"] == "tool_calls"
    assert result.tokens.choices[0].completion_ids == script
    with Script(engine, script):
        chunks, _, _ = await collect(
            engine, request(tools=TOOLS, max_tokens=80, stream=True, parallel_tool_calls=False)
        )
    calls = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["arguments"]) for c in calls] == [(0, '{"city": "Paris"}')]


# ---------------------------------------------------------------- batching


async def test_a_request_whose_prefill_fails_gets_an_error_and_the_batch_goes_on(engine):
    """Its prefill failing (out of memory on a long prompt, simulated), a request is answered with
    the error instead of waiting forever, and one already generating is not disturbed."""
    word = engine.tokenizer.encode(" word", add_special_tokens=False)[0]
    with Script(engine, [word]):  # no eos: it runs until closed
        running = engine.stream(request(stream=True, max_tokens=1500))
        await running.__anext__()
        while not engine.worker.batch.rows:
            await asyncio.sleep(0.001)

        def out_of_memory(module, args):
            if args[0].shape[1] > 1:  # a prefill; a decode step feeds one token per row
                raise RuntimeError("CUDA out of memory")

        hook = engine.loaded.model.get_input_embeddings().register_forward_pre_hook(out_of_memory)
        try:
            with pytest.raises(UpstreamError, match="CUDA out of memory"):
                await asyncio.wait_for(engine.complete(request(max_tokens=4)), 60)
        finally:
            hook.remove()
        assert len(engine.worker.batch.rows) == 1  # still generating
        await running.aclose()
    assert len((await engine.complete(request(max_tokens=4))).tokens.choices[0].completion_ids) == 4


async def test_a_long_prompt_is_tokenised_beside_the_event_loop_not_on_it(engine, monkeypatch):
    """Tokenising megabytes takes seconds (8 MB: 15 s for smollm2 on a busy 2-core machine):
    on the event loop it would stall every other call and stream of the gateway meanwhile."""
    entered, release, released = threading.Event(), threading.Event(), []
    encode = engine.tokenizer.encode

    def slow_encode(text, **kwargs):
        if "A VERY LONG PROMPT" in text:
            entered.set()
            released.append(release.wait(20))  # held until the short call below is answered
        return encode(text, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", slow_encode)
    long = asyncio.ensure_future(
        engine.complete(request(messages=[{"role": "user", "content": "A VERY LONG PROMPT"}], max_tokens=2))
    )
    assert await asyncio.to_thread(entered.wait, 20)
    short = await engine.complete(request(max_tokens=2))
    release.set()
    assert len(short.tokens.choices[0].completion_ids) == 2
    assert len((await long).tokens.choices[0].completion_ids) == 2
    assert released == [True]  # the short call was answered while the long prompt was being tokenised


async def test_concurrent_requests_are_batched(engine):
    bodies = [
        dict(messages=[{"role": "user", "content": f"Question number {i}?"}], max_tokens=24, seed=i) for i in range(8)
    ]
    alone = [await engine.complete(request(**b)) for b in bodies]
    engine.loaded.step_batch_sizes.clear()
    together = await asyncio.gather(*(engine.complete(request(**b)) for b in bodies))
    seen = list(engine.loaded.step_batch_sizes)
    assert max(seen) >= 4, seen  # they shared forward passes
    for a, b in zip(alone, together, strict=False):  # and batching does not change what a seed samples
        assert a.tokens.choices[0].completion_ids == b.tokens.choices[0].completion_ids


# ---------------------------------------------------------------- adapters


@pytest.fixture(scope="module")
def lora_dirs(model_dir, tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    out = []
    for seed in (1, 2):
        base = AutoModelForCausalLM.from_pretrained(model_dir)
        torch.manual_seed(seed)
        config = LoraConfig(
            r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
        )  # random A and B: a LoRA that changes the model
        peft_model = get_peft_model(base, config)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.5)
        path = tmp_path_factory.mktemp(f"lora{seed}")
        peft_model.save_pretrained(path)
        out.append(path)
    return out


def adapter_reference(model_dir, path):
    from peft import PeftModel

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(path)).eval()


async def test_adapters_load_serve_mix_and_unload(engine, reference, model_dir, lora_dirs):
    await engine.load_adapter("agent@1", lora_dirs[0])
    await engine.load_adapter("agent@2", lora_dirs[1])
    try:
        refs = {
            None: reference,
            "agent@1": adapter_reference(model_dir, lora_dirs[0]),
            "agent@2": adapter_reference(model_dir, lora_dirs[1]),
        }
        # one mixed batch: base and two adapters side by side
        names = [None, "agent@1", "agent@2", "agent@1"]
        results = await asyncio.gather(
            *(engine.complete(request(adapter=name, max_tokens=16, seed=7)) for name in names)
        )
        for name, result in zip(names, results, strict=False):
            tokens = result.tokens.choices[0]
            expected = teacher_forced(refs[name], result.tokens.prompt_ids, tokens.completion_ids)
            assert max(abs(a - b) for a, b in zip(tokens.logprobs, expected, strict=False)) < 1e-4, name
            if name is not None:  # the adapter really changes the distribution
                base = teacher_forced(reference, result.tokens.prompt_ids, tokens.completion_ids)
                assert max(abs(a - b) for a, b in zip(tokens.logprobs, base, strict=False)) > 1e-2
        await engine.unload_adapter("agent@1")
        with pytest.raises(NotFound):
            await engine.complete(request(adapter="agent@1", max_tokens=4))
        still = await engine.complete(request(adapter="agent@2", max_tokens=8, seed=1))
        expected = teacher_forced(refs["agent@2"], still.tokens.prompt_ids, still.tokens.choices[0].completion_ids)
        assert max(abs(a - b) for a, b in zip(still.tokens.choices[0].logprobs, expected, strict=False)) < 1e-4
    finally:
        for name in ("agent@1", "agent@2"):
            if name in engine.loaded.adapters:
                await engine.unload_adapter(name)
    # all gone: back to the plain base model, which is unchanged
    assert not engine.loaded.peft
    base = await engine.complete(request(max_tokens=8, seed=1))
    expected = teacher_forced(reference, base.tokens.prompt_ids, base.tokens.choices[0].completion_ids)
    assert max(abs(a - b) for a, b in zip(base.tokens.choices[0].logprobs, expected, strict=False)) < 1e-4


async def test_unload_waits_for_running_requests(engine, lora_dirs):
    await engine.load_adapter("agent@3", lora_dirs[0])
    running = asyncio.create_task(engine.complete(request(adapter="agent@3", max_tokens=40, seed=3)))
    await asyncio.sleep(0.01)
    await engine.unload_adapter("agent@3")
    result = await running  # finished on its adapter, not failed by the unload
    assert len(result.tokens.choices[0].completion_ids) >= 1
    assert "agent@3" not in engine.loaded.adapters


async def test_adapter_errors(engine, tmp_path, lora_dirs):
    with pytest.raises(NotFound):
        await engine.load_adapter("x", tmp_path)  # not a PEFT checkpoint
    with pytest.raises(NotFound):
        await engine.unload_adapter("never-loaded")
    with pytest.raises(NotFound):
        await engine.complete(request(adapter="never-loaded"))


# ---------------------------------------------------------------- bad input and lifecycle


async def test_not_started_and_missing_model(tmp_path):
    from gateway.errors import ConfigError, EngineUnavailable

    engine = LocalEngine(str(tmp_path / "nothing-here"), "x")
    with pytest.raises(EngineUnavailable):
        await engine.complete(request())
    with pytest.raises(ConfigError, match="nothing-here"):
        await engine.start()


async def test_bad_input_says_what_to_fix(engine):
    long = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(InvalidRequest, match="context is 2048 tokens.*Shorten 'messages'"):
        await engine.complete(request(long))
    with pytest.raises(InvalidRequest, match="lower 'max_tokens'"):  # the field the request set
        await engine.complete(request(max_tokens=5000))
    with pytest.raises(InvalidRequest, match="lower 'max_completion_tokens'"):
        await engine.complete(request(max_completion_tokens=5000))
    with pytest.raises(InvalidRequest, match="messages"):
        await engine.complete(EngineRequest({"model": "tiny", "messages": []}, None, "bad"))
    with pytest.raises(InvalidRequest):
        async for _ in engine.stream(request(long, stream=True)):
            pass


async def test_a_background_job_makes_way_for_a_live_request_and_still_finishes_right(engine, reference):
    """Shadow samples run as background jobs: a live request that arrives while one is in the
    batch never shares a step with it (its rows are set aside and recomputed afterwards), and
    what the background job returns is still exact: each choice's recorded logprobs are the
    model's own for its tokens after the prompt."""
    worker = engine.worker
    body = {"model": "tiny", "messages": MESSAGES, "n": 4, "max_tokens": 48, "temperature": 1.0}
    background = asyncio.ensure_future(engine.complete(EngineRequest(body, None, "shadow-test", background=True)))
    while not any(row.job.background for row in list(worker.batch.rows)):
        assert not background.done(), "the background job finished before a live request could arrive"
        await asyncio.sleep(0.0005)
    set_aside = worker.set_aside
    live = await engine.complete(request(max_tokens=4, temperature=1.0))
    assert worker.set_aside == set_aside + 1  # the live request did not wait behind it, nor beside it
    assert len(live.tokens.choices) == 1
    done = await background
    assert [c["index"] for c in done.response["choices"]] == [0, 1, 2, 3]
    for tokens in done.tokens.choices:
        expected = teacher_forced(reference, done.tokens.prompt_ids, tokens.completion_ids)
        assert len(tokens.logprobs) == len(tokens.completion_ids) > 0
        assert max(abs(a - b) for a, b in zip(tokens.logprobs, expected, strict=True)) < 1e-4
