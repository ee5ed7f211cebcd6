"""A misspelt RLPROXY_* variable is said once at start, never with its value, with the setting meant."""

import socket

from gateway.cli import build_parser, main, settings_from_args
from gateway.trainer_process import trainer_command


def test_a_misspelt_variable_is_said_once_with_the_setting_meant_and_never_its_value(capsys, tmp_path, monkeypatch):
    # RLPROXY_APIKEY for RLPROXY_API_KEY was ignored without a word: the gateway ran without its key.
    monkeypatch.setenv("RLPROXY_APIKEY", "a-key-of-thirty-two-characters-x")
    monkeypatch.setenv("RLPROXY_TORCH_THREADS", "1")  # read by the trainer, not a setting: nothing to say
    with socket.socket() as taken:  # a port in use ends the start right after the settings are read
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        argv = ["serve", "--state-dir", str(tmp_path), "--port", str(taken.getsockname()[1])]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (
        "rlproxy serve: warning: RLPROXY_APIKEY (did you mean RLPROXY_API_KEY?): no such variable, ignored "
        "(`rlproxy serve --help` lists each setting's)"
    ), err
    assert "a-key-of-thirty" not in err
    # The trainer the gateway starts does not say it again: the variable is not in its environment.
    args = build_parser().parse_args(argv)
    _, env = trainer_command(args, settings_from_args(args))
    assert "RLPROXY_APIKEY" not in env and env["RLPROXY_TORCH_THREADS"] == "1"


def test_no_warning_when_every_variable_is_read(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("RLPROXY_MAX_N", "4")
    monkeypatch.setenv("rlproxy_log_level", "warning")  # Settings reads them case-insensitively
    monkeypatch.setenv("RLPROXY_JUDGE_API_KEY", "sk-judge")  # read by RULER, not a setting
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--state-dir", str(tmp_path), "--port", str(taken.getsockname()[1])]) == 2
    assert "no such variable" not in capsys.readouterr().err


def test_every_rlproxy_variable_the_project_reads_is_known():
    # The processes rlproxy starts get the environment without the variables it does not know
    # (`without_unknown`): one read somewhere but missing from the list would silently not reach
    # the trainer or its ranks.
    import re
    from pathlib import Path

    from gateway.settings_env import unknown_variables

    root = Path(__file__).resolve().parent.parent
    named = set()
    for folder in ("gateway", "trainer", "sdk", "deploy", "bench", "tests", "docs"):
        for path in (root / folder).rglob("*"):
            if path.is_file() and path.suffix in {".py", ".sh", ".md", ".yml", ".yaml", ".toml", ".conf", ""}:
                named |= set(re.findall(r"RLPROXY_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="ignore")))
    named |= set(re.findall(r"RLPROXY_[A-Z0-9_]*[A-Z0-9]", (root / "README.md").read_text()))
    assert len(named) > 20
    assert unknown_variables(dict.fromkeys(named, "x")) == ["RLPROXY_APIKEY"]  # this file's misspelling
