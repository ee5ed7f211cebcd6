"""The CLI: every setting is a documented flag; flags > environment > defaults."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import build_parser, settings_from_args
from gateway.settings import Settings
from tests.helpers import call_row, stop_process


def help_text(command: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", command, "--help"], capture_output=True, text=True, check=True
    ).stdout


def test_every_setting_is_a_documented_serve_flag():
    text = help_text("serve")
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in text, f"{flag} missing from `rlproxy serve --help`"
        assert field.description, f"setting {name} has no description"


def test_train_help_lists_the_flags_a_trainer_reads_and_takes_the_gateways_too():
    text = help_text("train")
    listed = set(re.findall(r"^ {2}(--[a-z0-9-]+)", text, re.MULTILINE))  # each option's own line
    for flag in ("--state-dir", "--store", "--base-model", "--learning-rate", "--promote", "--max-steps", "--gpu-mode"):
        assert flag in listed, f"{flag} missing from `rlproxy train --help`"
    for flag in ("--port", "--api-key", "--cors-origin", "--upstream-url", "--max-batch-size", "--shadow-samples"):
        assert flag not in listed, f"`rlproxy train --help` lists {flag}, which it ignores"
    for flag in ("--judge-model", "--canary-share", "--keep-adapters", "--live-group-size", "--trainer"):
        assert flag not in listed, f"`rlproxy train --help` lists {flag}, which it ignores"
    assert "ignores them" in " ".join(text.split())  # and says so
    # `serve --trainer auto` starts it with the gateway's own command line: still taken
    args = build_parser().parse_args(["train", "--port", "9200", "--api-key", "k" * 16, "--max-steps", "1"])
    assert settings_from_args(args).port == 9200 and args.max_steps == 1


def test_demo_help_leaves_out_the_upstreams_flags_and_trainer_which_it_ignores():
    listed = set(re.findall(r"^ {2}(--[a-z0-9-]+)", help_text("demo"), re.MULTILINE))
    assert {"--engine", "--base-model", "--vllm-url", "--learning-rate", "--trainer-devices"} <= listed
    assert not {"--upstream-url", "--upstream-api-key", "--upstream-timeout", "--trainer"} & listed
    assert build_parser().parse_args(["demo", "--trainer", "off"]).trainer == "off"  # still taken


def test_demo_help_gives_the_defaults_the_demo_runs_with(tmp_path, monkeypatch):
    # `demo --help` gave serve's: --log-level "info", --poll-interval "1.0", --default-max-tokens
    # "256", where `rlproxy demo` runs at warning, 0.2 and the task's own (8 for shout).
    from gateway.demo import TASKS
    from gateway.demo.options import demo_settings

    for name in list(os.environ):
        if name.startswith("RLPROXY_"):
            monkeypatch.delenv(name)
    text = " ".join(help_text("demo").split())
    for flag, name in (
        ("--log-level", "log_level"),
        ("--poll-interval", "poll_interval"),
        ("--keep-adapters", "keep_adapters"),
    ):
        value = demo_settings({}, tmp_path).model_dump()[name]
        assert re.search(rf"{flag} \S+ .*?default in the demo: {value}\)", text), (flag, value)
    by_task = ", ".join(f"{demo_settings({}, tmp_path, task).default_max_tokens} with --task {task}" for task in TASKS)
    assert f"default in the demo: {by_task})" in text


def test_flags_beat_environment_beat_defaults(monkeypatch):
    monkeypatch.setenv("RLPROXY_MODEL_NAME", "from-env")
    monkeypatch.setenv("RLPROXY_PORT", "9100")
    args = build_parser().parse_args(["serve", "--port", "9200"])
    settings = settings_from_args(args)
    assert settings.port == 9200  # flag
    assert settings.model_name == "from-env"  # environment
    assert settings.groups_per_step == Settings.model_fields["groups_per_step"].default  # default


def test_a_repeatable_flag_s_variable_takes_one_value_or_a_json_list(monkeypatch):
    # docs/ruler.md: `--judge-api-base URL` (env RLPROXY_JUDGE_API_BASE). A bare URL there, or a bare
    # host in RLPROXY_ALLOWED_HOST, stopped `rlproxy serve` with a SettingsError traceback.
    monkeypatch.setenv("RLPROXY_JUDGE_API_BASE", "http://gpu-box:8001/v1")
    monkeypatch.setenv("RLPROXY_JUDGE_MODEL", "openai/o3")
    monkeypatch.setenv("RLPROXY_ALLOWED_HOST", "rlproxy.internal")
    monkeypatch.setenv("RLPROXY_CORS_ORIGIN", "https://app.example")
    monkeypatch.setenv("RLPROXY_UPSTREAM_PROTOCOL", "responses")
    monkeypatch.setenv("RLPROXY_VLLM_ARG", '["--max-model-len=4096", "--enforce-eager"]')
    settings = settings_from_args(build_parser().parse_args(["serve"]))
    assert settings.judge_api_base == ["http://gpu-box:8001/v1"] and settings.judge_model == ["openai/o3"]
    assert settings.allowed_host == ["rlproxy.internal"] and settings.cors_origin == ["https://app.example"]
    assert settings.upstream_protocol == ["responses"]
    assert settings.vllm_arg == ["--max-model-len=4096", "--enforce-eager"]
    # A flag still beats its variable.
    args = build_parser().parse_args(["serve", "--judge-model", "self", "--judge-model", "openai/o4"])
    assert settings_from_args(args).judge_model == ["self", "openai/o4"]


def test_a_broken_list_in_a_variable_is_a_clean_error_naming_the_variable(monkeypatch, capsys, tmp_path):
    from gateway.cli import main

    monkeypatch.setenv("RLPROXY_JUDGE_API_BASE", '["http://gpu-box:8001/v1"')
    assert main(["serve", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "RLPROXY_JUDGE_API_BASE (environment variable):" in err and "Traceback" not in err


def test_bad_flag_value_is_refused_with_the_choices():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--engine", "gpt"])


def test_secrets_are_masked_in_public_settings():
    settings = Settings(api_key="sk-gateway-3f8b2c6e1d", upstream_api_key="sk-upstream")
    public = settings.public_dict()
    assert "sk-gateway" not in str(public) and "sk-upstream" not in str(public)
    assert "sk-gateway" not in repr(settings)


def test_export_writes_sessions_as_json_lines(tmp_path):
    import json

    from gateway.store import CallRecord
    from gateway.store.sqlite import SQLiteStore

    store = SQLiteStore(tmp_path / "rlproxy.db")
    store.record_call_sync(
        CallRecord(
            id="r1",
            session_id="s1",
            group_id="g",
            split="train",
            model="agent",
            served=None,
            step=None,
            engine="openai",
            stream=False,
            status="ok",
            request={"messages": []},
            response={"choices": []},
            latency_ms=2.0,
        )
    )
    out = tmp_path / "out.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "export", "--state-dir", str(tmp_path), "--output", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["s1"] and rows[0]["calls"][0]["id"] == "r1"


def test_export_without_a_store_says_what_to_pass(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "export", "--state-dir", str(tmp_path / "none")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "--state-dir" in done.stderr


def test_a_setting_out_of_range_is_a_clean_error_naming_the_flag(capsys, tmp_path):
    from gateway.cli import main

    assert main(["train", "--state-dir", str(tmp_path), "--groups-per-step", "0"]) == 2
    assert "--groups-per-step: Input should be greater than or equal to 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # it was taken: trained nothing, exited 0
        main(["train", "--state-dir", str(tmp_path), "--max-steps", "-1"])
    assert "argument --max-steps: '-1' must be 0 or more" in capsys.readouterr().err
    assert main(["train", "--state-dir", str(tmp_path), "--delta", "1.1"]) == 2
    err = capsys.readouterr().err
    assert "delta (1.1) must exceed 1 + epsilon_high (1.2)" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flags, reason",
    [
        # LossConfig refused it only at the first step, which failed every group in turn and set
        # them aside as if the data were at fault.
        (["--epsilon-high", "-0.5"], "epsilon_high\n  Input should be greater than or equal to 0"),
        # Dropout 1 zeroes the adapter's input: no gradient ever reaches it.
        (["--lora-dropout", "1"], "lora_dropout\n  Input should be less than 1"),
        # Flags the loss never reads were ignored without a word.
        (["--loss-type", "cispo", "--delta", "3"], "--delta has nothing to cap under --loss-type cispo"),
        (["--loss-type", "cispo", "--epsilon-high", "0"], "0 weighs every token 0 and trains nothing"),
        (["--max-tokens-norm", "512"], "--loss-type grpo never uses it"),
    ],
)
def test_training_settings_that_cannot_train_as_asked_are_refused_at_start(tmp_path, flags, reason):
    # Read as `rlproxy train` reads them (it prints the reason and exits 2, as above); accepted,
    # they started a trainer that found out at its first step, or never.
    args = build_parser().parse_args(["train", "--state-dir", str(tmp_path), *flags])
    with pytest.raises(ValueError) as refused:
        settings_from_args(args)
    assert reason in str(refused.value)


def test_a_combination_refused_at_start_reads_as_one_plain_line(capsys, tmp_path):
    # pydantic words a check across settings as "Value error, ..." at no field; the user gets the
    # reason alone, as for one flag out of range.
    from gateway.cli import main

    assert main(["train", "--state-dir", str(tmp_path), "--max-tokens-norm", "512"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlproxy train: --max-tokens-norm is dr_grpo's fixed divisor"), err
    assert "Value error" not in err and "settings:" not in err


def test_a_port_or_token_limit_that_cannot_work_is_refused(capsys, tmp_path):
    # --port 99999 listened on 34463 (99999 - 65536); --default-max-tokens 0 gave 1-token answers.
    from gateway.cli import main

    assert main(["serve", "--state-dir", str(tmp_path), "--port", "99999"]) == 2
    assert "--port: Input should be less than or equal to 65535" in capsys.readouterr().err
    assert main(["serve", "--state-dir", str(tmp_path), "--default-max-tokens", "0"]) == 2
    assert "--default-max-tokens: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_a_bad_value_from_the_environment_is_blamed_on_its_variable_not_a_flag(capsys, tmp_path, monkeypatch):
    # `RLPROXY_PORT=abc rlproxy serve` said "--port: Input should be a valid integer", sending the
    # user after a flag they never gave. A flag given beside the variable is still the one named.
    from gateway.cli import main

    monkeypatch.setenv("RLPROXY_PORT", "abc")
    assert main(["serve", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "rlproxy serve: RLPROXY_PORT (environment variable): Input should be a valid integer" in err
    assert "--port" not in err
    assert main(["serve", "--state-dir", str(tmp_path), "--port", "99999"]) == 2
    assert "rlproxy serve: --port: Input should be less than or equal to 65535" in capsys.readouterr().err
    monkeypatch.setenv("RLPROXY_GROUPS_PER_STEP", "0")
    assert main(["train", "--state-dir", str(tmp_path), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "rlproxy train: RLPROXY_GROUPS_PER_STEP (environment variable): Input should be greater than" in err


def test_serve_says_where_it_listens_on_the_port_it_picked(upstream, tmp_path):
    """--port 0 takes any free port: the log says which once the gateway answers (uvicorn says
    it only of a socket it bound itself, and `rlproxy serve` binds its own first)."""
    args = ["--engine", "openai", "--upstream-url", upstream.url, "--trainer", "off", "--state-dir", str(tmp_path)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        start_new_session=True,
    )
    try:
        started = next((line for line in proc.stdout if "Application startup complete" in line), None)
        assert started is not None, "the gateway did not start"
        os.kill(proc.pid, signal.SIGTERM)
        log = proc.stdout.read()
    finally:
        stop_process(proc)
    said = re.search(r"listening on http://127\.0\.0\.1:(\d+) ", log)
    assert said is not None and int(said.group(1)) > 0, f"`rlproxy serve` never said where it listens:\n{log}"
    assert log.index(said.group(0)) < log.index("Shutting down")  # while it answered


def test_a_base_model_path_that_does_not_exist_is_one_clear_line(capsys, tmp_path):
    # It went on to from_pretrained, which took the path for a Hugging Face id: ~130 lines of
    # tracebacks ending in "Repo id must be in the form 'repo_name'".
    from gateway.cli import main

    missing = tmp_path / "no-such-model"
    assert main(["serve", "--state-dir", str(tmp_path / "state"), "--base-model", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--base-model '{missing}' is not a directory" in err and "Traceback" not in err


def test_export_refuses_what_it_cannot_read_or_write_in_one_line(capsys, tmp_path):
    # --output a directory (or under a file) ended in an IsADirectoryError traceback after the
    # export ran; `--store sqlite:///` of a missing file created an empty store and exported
    # "0 sessions"; `--min-reward nan` and `--since inf` selected nothing without a word; an
    # --output naming the store file wrote the export over it.
    from gateway.cli import main
    from gateway.store.sqlite import SQLiteStore

    store = SQLiteStore(tmp_path / "rlproxy.db")
    store.record_call_sync(call_row("r1", "s1", "g"))
    state = ["export", "--state-dir", str(tmp_path)]

    assert main([*state, "--output", str(tmp_path)]) == 2
    assert f"cannot write --output {tmp_path}: it is a directory" in capsys.readouterr().err
    assert main([*state, "--format", "parquet", "--output", str(tmp_path)]) == 2
    assert "it is a directory" in capsys.readouterr().err
    assert main([*state, "--output", str(tmp_path / "rlproxy.db" / "out.jsonl")]) == 2
    assert "a folder on its path is a file" in capsys.readouterr().err

    for store_file in ("rlproxy.db", "rlproxy.db-wal"):  # written over, the store was gone for good
        assert main([*state, "--output", str(tmp_path / store_file)]) == 2
        assert "is the store itself" in capsys.readouterr().err
    assert store.get_session("s1")["n_calls"] == 1

    missing = tmp_path / "elsewhere" / "rlproxy.db"
    assert main(["export", "--store", f"sqlite:///{missing}"]) == 2
    assert "no store at" in capsys.readouterr().err and not missing.parent.exists()

    for flag, value in (("--min-reward", "nan"), ("--since", "inf"), ("--until", "nan")):
        with pytest.raises(SystemExit) as exited:
            main([*state, flag, value])
        assert exited.value.code == 2
        assert f"argument {flag}: '{value}' is not a finite number" in capsys.readouterr().err

    out = tmp_path / "new" / "out.jsonl"  # a file in a folder that is not there yet: made
    assert main([*state, "--output", str(out), "--since", "2020-01-01"]) == 0
    assert len(out.read_text().splitlines()) == 1


@pytest.mark.parametrize("command", ["serve", "train"])
def test_a_state_dir_that_is_a_file_is_one_clear_line(capsys, tmp_path, command):
    # It ended in a NotADirectoryError traceback from the store's chmod of rlproxy.db, after
    # chmod-ing the file itself to 0700; under a file, in one from mkdir.
    from gateway.cli import main

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    upstream = ["--engine", "openai", "--upstream-url", "http://127.0.0.1:9/v1", "--trainer", "off"]
    flags = upstream if command == "serve" else ["--max-steps", "1"]
    assert main([command, "--state-dir", str(a_file), *flags]) == 2
    err = capsys.readouterr().err
    assert f"--state-dir {a_file} is a file, not a directory" in err and "Traceback" not in err
    assert a_file.read_text() == "mine" and a_file.stat().st_mode & 0o777 != 0o700

    assert main([command, "--state-dir", str(a_file / "state"), *flags]) == 2
    err = capsys.readouterr().err
    assert f"--state-dir {a_file / 'state'} cannot be used (Not a directory)" in err and "Traceback" not in err


def test_a_port_in_use_is_one_clear_line_before_anything_starts(capsys, tmp_path):
    # uvicorn bound the port only after the app's startup: the engine (a managed vLLM, minutes
    # on a GPU) and the trainer were started first, then "[Errno 98] ... address already in use".
    import socket

    from gateway.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        state = tmp_path / "state"
        upstream = ["--engine", "openai", "--upstream-url", "http://127.0.0.1:9/v1", "--trainer", "off"]
        assert main(["serve", "--state-dir", str(state), "--port", str(port), *upstream]) == 2
    err = capsys.readouterr().err
    assert f"--port {port} on 127.0.0.1 is already in use" in err and "Traceback" not in err
    assert not state.exists()  # refused before the state dir, the store or the engine


def test_an_engine_that_cannot_start_is_one_clear_line_and_what_started_is_stopped(tmp_path):
    # A --vllm-url nothing answers (or a --device torch does not know) failed in the app's startup:
    # uvicorn printed Starlette's 40-line lifespan traceback, an "Unclosed client session" error
    # from the engine's HTTP pool, and exited 3, the reason on the traceback's last line.
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    serve = [sys.executable, "-m", "gateway.cli", "serve", "--state-dir", str(tmp_path), "--port", "0"]
    vllm = ["--trainer", "off", "--engine", "vllm", "--vllm-url", f"http://127.0.0.1:{port}"]
    done = subprocess.run([*serve, *vllm], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"rlproxy serve: no vLLM answers at http://127.0.0.1:{port}/health" in done.stderr
    assert "Traceback" not in done.stderr and "Unclosed client session" not in done.stderr


@pytest.mark.parametrize("name", ["team@v2", "", "org/agent", ".."])
def test_a_model_name_the_store_or_the_state_dir_cannot_hold_is_refused(tmp_path, name):
    # The store files a call under the name before its first '@' (NAME@STEP): `--model-name team@v2`
    # recorded every group as `team`, and the trainer, looking for `team@v2`, never trained one.
    # The name is also a folder under STATE/models/ ('..' put the checkpoints beside the state dir).
    # Read as `rlproxy serve` reads them (it prints the reason and exits 2); accepted, it served.
    args = build_parser().parse_args(["serve", "--state-dir", str(tmp_path), "--model-name", name])
    with pytest.raises(ValueError) as refused:
        settings_from_args(args)
    assert f"{name!r} cannot be a model name" in str(refused.value)


@pytest.mark.parametrize(
    "flags, reason",
    [
        # Every call was a 504 "the upstream ... did not answer within -5 s" (vLLM's calls too).
        (["--upstream-timeout", "-5"], "upstream_timeout\n  Input should be greater than 0"),
        (["--upstream-timeout", "0"], "upstream_timeout\n  Input should be greater than 0"),
        # A ValueError traceback from the local engine's constructor.
        (["--max-batch-size", "0"], "max_batch_size\n  Input should be greater than or equal to 1"),
        # A ValueError traceback ("Port out of range 0-65535") once the vLLM engine was built.
        (["--engine", "vllm", "--vllm-port", "70000"], "vllm_port\n  Input should be less than or equal to 65535"),
        (["--engine", "vllm", "--max-loras", "0"], "max_loras\n  Input should be greater than or equal to 1"),
    ],
)
def test_an_engine_setting_that_cannot_work_is_refused_at_start(tmp_path, flags, reason):
    # Read as `rlproxy serve` reads them (it prints the reason and exits 2, as above).
    args = build_parser().parse_args(["serve", "--state-dir", str(tmp_path), *flags])
    with pytest.raises(ValueError) as refused:
        settings_from_args(args)
    assert reason in str(refused.value)


def test_version_says_the_version_of_the_package():
    # `rlproxy --version` was "error: the following arguments are required: COMMAND" (exit 2).
    import re
    from pathlib import Path

    done = subprocess.run([sys.executable, "-m", "gateway.cli", "--version"], capture_output=True, text=True)
    assert done.returncode == 0
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert done.stdout.strip() == "rlproxy " + re.search(r'^version = "(.+)"$', pyproject, re.M).group(1)


@pytest.mark.parametrize(
    "init_from, reason",
    [
        ("agent-sft", "--init-from takes NAME@STEP (as served, e.g. agent-sft@12), not 'agent-sft'"),
        ("agent-sft@last", "--init-from takes NAME@STEP (as served, e.g. agent-sft@12), not 'agent-sft@last'"),
        ("agent@3", "--init-from agent@3 names this run itself: give another --model-name"),
    ],
)
def test_serve_refuses_an_init_from_its_trainer_can_never_read(tmp_path, init_from, reason):
    # Only the trainer read it: `rlproxy serve --init-from agent-sft` started a gateway that answered
    # every call 503 "loading step 0 ... try again shortly" while its trainer exited 2 and was started
    # again, forever.
    args = build_parser().parse_args(["serve", "--state-dir", str(tmp_path), "--init-from", init_from])
    with pytest.raises(ValueError) as refused:
        settings_from_args(args)
    assert reason in str(refused.value)


@pytest.mark.parametrize(
    "engine, flag, url",
    [("local", "--upstream-url", "https://api.openai.com/v1"), ("openai", "--vllm-url", "http://127.0.0.1:9")],
)
def test_an_engine_url_without_its_engine_is_refused_not_ignored(tmp_path, engine, flag, url):
    # `rlproxy serve --upstream-url https://api.openai.com/v1` (no --engine openai) served the
    # built-in tiny model's gibberish on the local engine, the URL ignored without a word.
    from gateway.app import create_app
    from gateway.errors import ConfigError

    given = ["--engine", engine, flag, url, "--trainer", "off"]
    if engine == "openai":
        given += ["--upstream-url", "http://127.0.0.1:9/v1"]
    settings = settings_from_args(build_parser().parse_args(["serve", "--state-dir", str(tmp_path), *given]))
    with pytest.raises(ConfigError) as refused:
        create_app(settings)
    assert f"{flag} is for --engine" in str(refused.value) and f"with --engine {engine} it would be ignored" in str(
        refused.value
    )


def test_an_empty_state_dir_is_refused_not_taken_for_the_current_directory(monkeypatch, tmp_path):
    # RLPROXY_STATE_DIR= (empty, as a compose file leaves an unset variable) was Path(""), the current
    # directory: `rlproxy serve` put its store there and chmod-ed the directory itself to 0700.
    monkeypatch.setenv("RLPROXY_STATE_DIR", "")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as refused:
        settings_from_args(build_parser().parse_args(["serve"]))
    assert "state_dir\n  Value error, give a directory; an empty value would be the current one" in str(refused.value)


@pytest.mark.parametrize(
    "url, says",
    [
        ("http://gpu-box:80800/v1", "is not a URL (Port out of range 0-65535)"),
        ("http://gpu-box:8o00/v1", "is not a URL (Port could not be cast to integer value as '8o00')"),
        ("http://[fd00::2/v1", "is not a URL (Invalid IPv6 URL)"),
        ("http:///v1", "names no host"),
    ],
)
@pytest.mark.parametrize("flag", ["--upstream-url", "--vllm-url"])
def test_a_base_url_the_client_cannot_parse_is_one_line_without_the_url(capsys, tmp_path, flag, url, says):
    # Each was the HTTP client's ValueError traceback at start. The URL stays out of the line: it
    # may carry a password (http://user:secret@host/v1).
    from gateway.cli import main

    engine = ["--engine", "openai"] if flag == "--upstream-url" else ["--engine", "vllm"]
    secret_url = url.replace("//", "//user:secret@", 1)
    assert main(["serve", "--state-dir", str(tmp_path), *engine, flag, secret_url, "--trainer", "off"]) == 2
    err = capsys.readouterr().err
    assert f"rlproxy serve: {flag} {says}" in err, err
    assert "Traceback" not in err and "secret" not in err


def _own_handler(signum, frame):  # the caller's own handler, which rlproxy's command must leave in place
    pass


@pytest.fixture
def callers_handlers():
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, _own_handler)
    signal.signal(signal.SIGTERM, _own_handler)
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def test_train_in_process_puts_the_callers_signal_handlers_back(callers_handlers, monkeypatch, tmp_path):
    # They were left installed: a pytest run that ran `main(["train", ...])` ignored Ctrl-C and SIGTERM for good.
    import trainer.worker
    from gateway.cli import main
    from gateway.errors import RLProxyError

    during = {}

    def worker(settings, stop, **kwargs):
        during.update({signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)})
        raise RLProxyError("the worker failed")

    monkeypatch.setattr(trainer.worker, "run_worker", worker)
    assert main(["train", "--state-dir", str(tmp_path), "--max-steps", "1"]) != 0
    assert _own_handler not in during.values()  # while it trains, a signal stops it after the step
    assert signal.getsignal(signal.SIGINT) is _own_handler
    assert signal.getsignal(signal.SIGTERM) is _own_handler


def test_demo_in_process_puts_the_callers_signal_handler_back(callers_handlers, tmp_path, capsys):
    from gateway.cli import main

    # refused once its handler is in: the flags are checked after it is installed
    assert main(["demo", "--out", str(tmp_path / "out"), "--teacher-games", "1"]) == 2
    assert "rlproxy demo: --teacher-games" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is _own_handler
