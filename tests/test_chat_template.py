"""`--chat-template FILE`: the template in force is the one every place renders with (the local
engine, the managed vLLM, the trainer, export-model), and a bad one is refused at start. And
smollm2's built-in hermes template: a multi-turn tool session renders turn by turn as an
extension of the previous turn, and vLLM's hermes parser and the gateway's read back the tool
calls it writes; smollm2's own template (`--chat-template original`) drops the tools."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.cli import main
from gateway.engines.vllm.build import vllm_engine
from gateway.models.templates import hermes_template, load_tokenizer
from gateway.protocols.toolcalls import parse_tool_calls
from gateway.settings import SMOLLM2_MODEL_ID, Settings
from tests.helpers import ThreadServer
from tests.helpers_real_vllm import vllm_python
from tests.helpers_smollm2 import smollm2_dir
from tests.helpers_trainer import Recorder, trainer_settings
from trainer.backends.peft import PeftBackend
from trainer.render import ChatTemplateRenderer
from trainer.worker import run_worker

MARKER = "You are a quokka named Template"
"""The default system message of the test's template: what a chat without one renders with."""


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "quokka.jinja"
    path.write_text(hermes_template(MARKER))
    return path


def contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def marker_ids(tokenizer) -> list[int]:
    return list(tokenizer("\n" + MARKER, add_special_tokens=False)["input_ids"])[1:]


def test_the_local_engine_renders_with_the_chat_template_given(tmp_path, template_file):
    settings = Settings(state_dir=tmp_path, trainer="off", default_max_tokens=4, chat_template=str(template_file))
    app = create_app(settings)
    with ThreadServer(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(
            model="agent", messages=[{"role": "user", "content": "Hello"}], extra_headers={"X-Session-Id": "s-quokka"}
        )
        (call,) = httpx.get(server.url + "/v1/sessions/s-quokka").json()["calls"]
    tokenizer = load_tokenizer(app.state.services.engine.model_path)  # the model's own template
    assert MARKER not in tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False)
    assert contains(call["prompt_ids"], marker_ids(tokenizer)), tokenizer.decode(call["prompt_ids"])


def test_the_trainer_renders_with_the_chat_template_given(tmp_path, template_file):
    backend = PeftBackend(trainer_settings(tmp_path, chat_template=str(template_file)))
    turn = ChatTemplateRenderer(backend.tokenizer)(
        {"messages": [{"role": "user", "content": "Hello"}]},
        {"choices": [{"message": {"role": "assistant", "content": "Hi."}, "finish_reason": "stop"}]},
    )
    assert contains(list(turn.prompt_ids), marker_ids(backend.tokenizer))


def test_the_managed_vllm_is_started_with_the_chat_template_given(tmp_path, template_file):
    # dedicated: what is checked here is the command line, not a GPU shared with a CPU trainer
    settings = Settings(state_dir=tmp_path, engine="vllm", gpu_mode="dedicated", chat_template=str(template_file))
    command = vllm_engine(settings).process.command
    assert command[command.index("--chat-template") + 1] == str(template_file.resolve())
    plain = vllm_engine(Settings(state_dir=tmp_path, engine="vllm", gpu_mode="dedicated")).process.command
    assert "--chat-template" not in plain  # the model's own, from its directory


def test_export_model_writes_the_chat_template_into_the_merged_tokenizer(tmp_path, template_file):
    settings = trainer_settings(tmp_path / "state", chat_template=str(template_file))
    recorder = Recorder(settings)
    for group in ("g1", "g2"):
        recorder.group(group, [1.0, 0.0])
    recorder.close()
    assert run_worker(settings, max_steps=1) == 1
    state = ["--state-dir", str(settings.state_dir)]
    # the template the step was trained with, unless --chat-template names another
    assert main(["export-model", "agent@1", "--out", str(tmp_path / "trained"), "--merged", *state]) == 0
    other = tmp_path / "other.jinja"
    other.write_text(hermes_template("You are a wombat"))
    given = ["--chat-template", str(other)]
    assert main(["export-model", "agent@1", "--out", str(tmp_path / "given"), "--merged", *state, *given]) == 0
    chat = [{"role": "user", "content": "Hello"}]
    trained = load_tokenizer(str(tmp_path / "trained")).apply_chat_template(chat, tokenize=False)
    assert MARKER in trained
    assert "wombat" in load_tokenizer(str(tmp_path / "given")).apply_chat_template(chat, tokenize=False)


@pytest.fixture
def signals_kept():
    """`rlproxy demo` turns SIGTERM into Ctrl-C for its own process: not for the test's."""
    kept = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, kept)


@pytest.mark.parametrize("command", ["serve", "train", "demo", "export-model"])
def test_a_missing_or_broken_chat_template_is_refused_at_start(command, tmp_path, capsys, signals_kept):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}{{ message.content }}")  # no endfor
    where = ["--out", str(tmp_path / "out")] if command == "demo" else ["--state-dir", str(tmp_path / "state")]
    if command == "export-model":
        where = ["agent@1", "--out", str(tmp_path / "export"), *where]
    assert main([command, *where, "--chat-template", str(tmp_path / "nowhere.jinja")]) == 2
    assert f"rlproxy {command}: --chat-template {tmp_path / 'nowhere.jinja'}: no such file" in capsys.readouterr().err
    assert main([command, *where, "--chat-template", str(broken)]) == 2
    err = capsys.readouterr().err
    assert f"rlproxy {command}: --chat-template {broken}: not a Jinja template (line 1: " in err, err
    utf16 = tmp_path / "utf16.jinja"  # what Windows' Notepad writes when saved as "Unicode"
    utf16.write_text("{{ messages[0].content }}", encoding="utf-16")
    assert main([command, *where, "--chat-template", str(utf16)]) == 2
    assert f"rlproxy {command}: --chat-template {utf16}: not UTF-8 text" in capsys.readouterr().err
    assert not (tmp_path / "state").exists() and not (tmp_path / "out").exists()  # nothing started


# ---------------------------------------------------------------------------- smollm2's tool template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
]


def tool_call(call_id: str, city: str) -> dict:
    # `arguments` as a JSON string, as the OpenAI wire form (and the gateway's replies) carry it
    arguments = json.dumps({"city": city, "unit": "celsius"}, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


SESSION = [
    {"role": "system", "content": "You answer questions about the weather."},
    {"role": "user", "content": "Is it warmer in Zürich or in Lyon?"},
    {
        "role": "assistant",
        "content": "Let me look both up.",
        "tool_calls": [tool_call("call_1", "Zürich"), tool_call("call_2", "Lyon")],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 14}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temperature": 19}'},
    {"role": "assistant", "content": "Lyon is warmer: 19 °C against 14 °C in Zürich."},
    {"role": "user", "content": "And tomorrow?"},
]
END = "<|im_end|>\n"


def vllm_hermes_parse(model_dir: str, texts: list[str]) -> list[dict]:
    """vLLM's own hermes parser (the one `--tool-call-parser hermes` runs) over `texts`, in the CPU
    vLLM's environment: one process for all of them (importing vLLM takes seconds)."""
    script = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest\n"
        "from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser\n"
        "job = json.load(sys.stdin)\n"
        "request = ChatCompletionRequest(model='m', messages=[{'role': 'user', 'content': 'x'}], tools=job['tools'])\n"
        "parser = Hermes2ProToolParser(AutoTokenizer.from_pretrained(job['model']))\n"
        "for text in job['texts']:\n"
        "    got = parser.extract_tool_calls(text, request)\n"
        "    calls = [[c.function.name, c.function.arguments] for c in got.tool_calls]\n"
        "    print(json.dumps({'called': got.tools_called, 'content': got.content, 'calls': calls}))\n"
    )
    job = json.dumps({"model": model_dir, "tools": TOOLS, "texts": texts})
    done = subprocess.run(
        [vllm_python(), "-c", script],
        input=job,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_a_tool_session_renders_turn_by_turn_and_vllm_and_the_gateway_read_its_tool_calls():
    tokenizer = load_tokenizer(str(smollm2_dir()))  # the built-in hermes template: smollm2's default

    def render(messages: list[dict], generation: bool = False) -> str:
        return tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=generation, tokenize=False)

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    whole = ids(render(SESSION, generation=True))
    replies = []
    for k, message in enumerate(SESSION):
        if message["role"] != "assistant":
            continue
        prompt = render(SESSION[:k], generation=True)
        written = render(SESSION[: k + 1])
        assert written.startswith(prompt) and written.endswith(END)
        reply = written[len(prompt) : -len(END)]  # what the model writes after the generation prompt
        replies.append(reply)
        # each turn, as the gateway records it (prompt ids, then the sampled ids up to <|im_end|>),
        # is a prefix of the session's next prompt: the trainer merges the turns into one sample
        turn = ids(prompt) + ids(reply) + ids(END)
        assert whole[: len(turn)] == turn
    assert "<tools>" in tokenizer.decode(whole) and "get_weather" in tokenizer.decode(whole)

    parsed = vllm_hermes_parse(str(smollm2_dir()), replies)
    for reply, message, by_vllm in zip(replies, [SESSION[2], SESSION[5]], parsed, strict=True):
        sent = [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls", [])]
        assert by_vllm["calls"] == sent  # the same names, the same argument strings
        content, calls = parse_tool_calls(reply)  # the local engine's parser
        assert [[c["function"]["name"], c["function"]["arguments"]] for c in calls] == sent
        assert content == ((by_vllm["content"] or "").strip() or None) == message["content"]


def test_smollm2_own_template_drops_tools():
    """Why smollm2 gets a hermes template: its own (`--chat-template original`) renders a request
    with tools as if it had none, drops an assistant's tool calls from the history, and fails on
    one without text."""
    original = load_tokenizer(str(smollm2_dir()), "original")
    question = SESSION[:2]
    with_tools = original.apply_chat_template(question, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert with_tools == original.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    assert "get_weather" not in original.apply_chat_template(SESSION[:3], tools=TOOLS, tokenize=False)
    with pytest.raises(Exception, match="content"):
        original.apply_chat_template([*question, {**SESSION[2], "content": None}], tools=TOOLS, tokenize=False)


def test_vllm_serves_smollm2_with_its_hermes_template_or_the_original_one(tmp_path):
    smollm2 = Settings(state_dir=tmp_path, engine="vllm", gpu_mode="dedicated", base_model=SMOLLM2_MODEL_ID)
    assert "--chat-template" not in vllm_engine(smollm2).process.command  # its directory's: hermes
    original = smollm2.model_copy(update={"chat_template": "original"})
    command = vllm_engine(original).process.command
    assert command[command.index("--chat-template") + 1] == str(smollm2_dir() / "original_chat_template.jinja")
