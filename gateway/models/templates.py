"""Chat templates: the hermes-style one the built-in models carry, and the `--chat-template`
that replaces a model's own wherever rlproxy renders a chat (the local engine, vLLM, the
trainer, SFT, export).

One loader (`load_tokenizer`) for every place that renders, so the template in force is the
same everywhere: a session recorded by the gateway renders in the trainer token for token as
it was served.
"""

from __future__ import annotations

from pathlib import Path

from gateway.errors import ConfigError

ORIGINAL = "original"
"""`--chat-template original`: the template the model shipped with, where rlproxy gave a
built-in model another (smollm2's own drops tools); for any other model, its tokenizer's."""

ORIGINAL_TEMPLATE_FILE = "original_chat_template.jinja"
"""Where a built-in model's directory keeps the template it shipped with."""


def hermes_template(default_system: str) -> str:
    """A ChatML chat template with tools in the hermes form (Qwen2.5's, which vLLM's `hermes`
    tool parser reads), `default_system` where the chat has no system message.

    Qwen2.5's template with two changes: `arguments` given as a JSON string (OpenAI's wire
    form) is emitted as is instead of being JSON-encoded a second time, and a missing content
    renders as "". It is prefix-stable: rendering messages[:k] with add_generation_prompt and
    appending the reply + <|im_end|> gives a prefix of rendering the longer conversation.
    """
    if "'" in default_system or "\\" in default_system:
        raise ValueError("the default system message is written into Jinja strings: no quotes or backslashes")
    return (
        "{%- if tools %}"
        "{{- '<|im_start|>system\\n' }}"
        "{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
        "{%- else %}{{- '" + default_system + "' }}{%- endif %}"
        "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
        "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
        "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
        '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
        "{%- else %}"
        "{%- if messages[0].role == 'system' %}"
        "{{- '<|im_start|>system\\n' + (messages[0].content or '') + '<|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}{%- endif %}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
        " or (message.role == 'assistant' and not message.tool_calls) %}"
        "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
        "{%- elif message.role == 'assistant' %}"
        "{{- '<|im_start|>assistant' }}"
        "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
        "{%- for tool_call in message.tool_calls %}"
        "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
        '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
        "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
        "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
        "{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- elif message.role == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' }}{{- message.content or '' }}{{- '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def template_path(chat_template: str | None, model_dir: str) -> Path | None:
    """The file of the template in force, None for the tokenizer's own. `chat_template` is the
    `--chat-template` value: a Jinja file, or `original`."""
    if chat_template is None:
        return None
    if chat_template == ORIGINAL:
        shipped = Path(model_dir) / ORIGINAL_TEMPLATE_FILE
        return shipped if shipped.is_file() else None
    path = Path(chat_template).expanduser()
    if not path.is_file():
        raise ConfigError(f"--chat-template {chat_template}: no such file; give a Jinja chat template or 'original'")
    return path


def read_template(path: Path) -> str:
    """The template's text, compiled once so that a broken file fails at start, not on a call."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:  # a file saved as UTF-16 (Windows' "Unicode"), or not text at all
        raise ConfigError(
            f"--chat-template {path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
        ) from exc
    except OSError as exc:  # unreadable: its permissions, a directory's name given as a file's
        raise ConfigError(f"--chat-template {path}: cannot read it ({exc.strerror})") from exc
    try:
        # transformers' own compiler, the one apply_chat_template uses: its extensions
        # ({% generation %}, loop controls) are valid in a chat template, plain Jinja's parser refuses them.
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template {path}: not a Jinja template (line {exc.lineno}: {exc.message})") from exc
    return text


def check_chat_template(chat_template: str | None) -> None:
    """At the start of a command: a `--chat-template` file that is missing or not Jinja fails
    there, with what to fix, not on the first call that renders."""
    path = template_path(chat_template, "") if chat_template != ORIGINAL else None
    if path is not None:
        read_template(path)


def use_template(tokenizer, chat_template: str | None, model_dir: str):
    """`tokenizer` with the `--chat-template` in force (a tokenizer loaded elsewhere: Unsloth's)."""
    path = template_path(chat_template, model_dir)
    if path is not None:
        tokenizer.chat_template = read_template(path)
    return tokenizer


def load_tokenizer(model_dir: str, chat_template: str | None = None):
    """`AutoTokenizer.from_pretrained(model_dir)` with the `--chat-template` in force."""
    from transformers import AutoTokenizer

    return use_template(AutoTokenizer.from_pretrained(model_dir), chat_template, model_dir)
