"""The other protocols on the local engine (built-in tiny model), with the official clients
over a real socket: recorded token ids decode to what each client got, and one session
that mixes protocols becomes training samples whose masks are checked by hand."""

from __future__ import annotations

import anthropic
import openai
import pytest
from transformers import AutoTokenizer

from gateway.app import create_app
from gateway.settings import Settings
from gateway.tiny_model import TINY_MODEL_ID, resolve_base_model
from tests.helpers import ThreadServer
from trainer.data import trajectory_samples


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    settings = Settings(state_dir=state, engine="local", trainer="off", default_max_tokens=10)
    app = create_app(settings)
    with ThreadServer(app) as server:
        yield server, app.state.services, settings


@pytest.fixture(scope="module")
def tokenizer(gateway):
    return AutoTokenizer.from_pretrained(resolve_base_model(TINY_MODEL_ID, gateway[2].state_dir))


def decoded(tokenizer, row) -> str:
    return tokenizer.decode(row["completion_ids"][0], skip_special_tokens=True).strip()


def test_each_protocol_records_what_the_client_got(gateway, tokenizer):
    url = gateway[0].url
    store = gateway[1].store
    oai = openai.OpenAI(base_url=f"{url}/sessions/local-each/v1", api_key="x", max_retries=0)
    claude = anthropic.Anthropic(base_url=f"{url}/sessions/local-each", api_key="x", max_retries=0)
    got = []
    got.append(oai.responses.create(model=TINY_MODEL_ID, input="hello", max_output_tokens=8).output_text)
    events = list(oai.responses.create(model=TINY_MODEL_ID, input="again", stream=True, max_output_tokens=8))
    got.append("".join(e.delta for e in events if e.type == "response.output_text.delta"))
    got.append("".join(b.text for b in claude.messages.create(
        model=TINY_MODEL_ID, max_tokens=8, messages=[{"role": "user", "content": "hi"}]).content if b.type == "text"))
    with claude.messages.stream(model=TINY_MODEL_ID, max_tokens=8, messages=[{"role": "user", "content": "yo"}]) as s:
        got.append(s.get_final_text())
    got.append(oai.completions.create(model=TINY_MODEL_ID, prompt="once upon", max_tokens=8).choices[0].text)
    rows = store.session_calls("local-each")
    assert [r["protocol"] for r in rows] == ["responses", "responses", "messages", "messages", "completions"]
    for row, text in zip(rows, got):
        assert row["status"] == "ok" and row["prompt_ids"]
        assert decoded(tokenizer, row) == text.strip()
        assert len(row["completion_logprobs"][0]) == len(row["completion_ids"][0])


def test_mixed_protocol_session_trains_with_hand_checked_masks(gateway, tokenizer):
    url = gateway[0].url
    store = gateway[1].store
    oai = openai.OpenAI(base_url=f"{url}/sessions/mixed/v1", api_key="x", max_retries=0)
    claude = anthropic.Anthropic(base_url=f"{url}/sessions/mixed", api_key="x", max_retries=0)
    first = oai.responses.create(model=TINY_MODEL_ID, instructions="be kind", input="tell me", max_output_tokens=6,
                                 temperature=0)
    second = claude.messages.create(model=TINY_MODEL_ID, system="be kind", max_tokens=6, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": "tell me"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "more"}])
    oai.chat.completions.create(model=TINY_MODEL_ID, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "be kind"}, {"role": "user", "content": "tell me"},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "more"},
        {"role": "assistant", "content": second.content[0].text if second.content else ""},
        {"role": "user", "content": "last"}])
    rows = store.session_calls("mixed")
    assert [r["protocol"] for r in rows] == ["responses", "messages", "chat"]
    samples = trajectory_samples(rows, trajectory_id="mixed", group_id="g", advantage=1.0)
    # By hand: walk the calls, merging a call into the running sequence when its prompt
    # starts with everything so far; prompt tokens are masked out, sampled tokens trained.
    expected, ids, mask = [], [], []
    for row in rows:
        prompt, completion = row["prompt_ids"], row["completion_ids"][0]
        if ids and prompt[: len(ids)] == ids:
            new = prompt[len(ids):]
        else:
            if ids:
                expected.append((ids, mask))
            ids, mask, new = [], [], prompt
        ids = ids + new + completion
        mask = mask + [False] * len(new) + [True] * len(completion)
    expected.append((ids, mask))
    assert [(list(s.token_ids), list(s.loss_mask)) for s in samples] == expected
    trained = [t for s in samples for t, m in zip(s.token_ids, s.loss_mask) if m]
    assert trained == [t for r in rows for t in r["completion_ids"][0]]  # every sampled token, nothing else
