"""Settings that cannot work are refused when the command starts, in one line naming the flag
or the RLPROXY_* variable that gave them, never found out later as a traceback."""

import typing

import pytest

from gateway.cli import main
from gateway.settings import Settings

FLOAT_SETTINGS = [
    name
    for name, field in Settings.model_fields.items()
    if float in (field.annotation, *typing.get_args(field.annotation))
]


def test_every_float_setting_refuses_infinity_and_nan():
    # `--max-body-mb inf` crashed `rlproxy serve` with an OverflowError traceback, `--poll-interval inf`
    # the trainer's first wait, `--dist-timeout inf` the process group; nan meant nothing anywhere.
    assert "max_body_mb" in FLOAT_SETTINGS and "delta" in FLOAT_SETTINGS
    for name in FLOAT_SETTINGS:
        for value in ("inf", "-inf", "nan", "Infinity"):
            with pytest.raises(ValueError, match="Input should be a finite number"):
                Settings(**{name: value})


def test_an_infinite_flag_or_variable_is_one_line_naming_it(capsys, tmp_path, monkeypatch):
    given = ["--state-dir", str(tmp_path), "--trainer", "off"]
    assert main(["serve", *given, "--max-body-mb", "inf"]) == 2
    err = capsys.readouterr().err
    assert err == "rlproxy serve: --max-body-mb: Input should be a finite number\n", err
    monkeypatch.setenv("RLPROXY_POLL_INTERVAL", "nan")
    assert main(["train", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == "rlproxy train: RLPROXY_POLL_INTERVAL (environment variable): Input should be a finite number\n"
