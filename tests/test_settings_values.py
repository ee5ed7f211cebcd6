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


def test_a_device_torch_does_not_know_is_refused_before_anything_loads(capsys, tmp_path):
    # `rlproxy train --device gpu` loaded the model first, then died with torch's RuntimeError traceback
    # and exit 1, which `serve --trainer auto` takes for a crash and starts it again; `serve` said it
    # only once the model had loaded, after its settings line and uvicorn's start.
    for command in ("train", "serve"):
        assert main([command, "--state-dir", str(tmp_path), "--device", "gpu"]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"rlproxy {command}: --device gpu is not a device torch knows: use cpu, cuda (the first GPU) or "
            "cuda:N, or mps (Apple silicon)\n"
        ), err
    assert not (tmp_path / "rlproxy.db").exists()  # refused before the store was opened


def test_a_gpu_this_machine_lacks_is_refused_at_start_with_the_reason(capsys, tmp_path, monkeypatch):
    import torch

    given = ["--state-dir", str(tmp_path), "--trainer", "off"]
    if torch.version.cuda is None:  # this CPU build of torch
        assert main(["serve", *given, "--device", "cuda"]) == 2
        assert f"--device cuda: this torch ({torch.__version__}) is built without CUDA" in capsys.readouterr().err
    # A CUDA build on a machine whose GPUs are hidden, then one with a single GPU.
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["serve", *given, "--device", "cuda"]) == 2
    assert "--device cuda: torch sees no CUDA GPU here (CUDA_VISIBLE_DEVICES='')" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["train", "--state-dir", str(tmp_path), "--device", "cuda:1"]) == 2
    assert capsys.readouterr().err == "rlproxy train: --device cuda:1: torch sees 1 GPU(s) here, cuda:0 to cuda:0\n"
    # The openai engine computes nothing here and starts no trainer: its --device is not looked at.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    from gateway.cli import _check_device, build_parser, settings_from_args

    upstream = ["--engine", "openai", "--upstream-url", "http://127.0.0.1:9/v1", "--device", "cuda"]
    _check_device(settings_from_args(build_parser().parse_args(["serve", *given, *upstream])))


def test_a_refused_value_of_a_repeatable_flag_names_the_flag_and_which_value(capsys, tmp_path, monkeypatch):
    # `--upstream-protocol chat` was blamed on `--upstream-protocol-1`, a flag that does not exist, and a
    # check that names its flag itself read "--judge-api-base: --judge-api-base must start with ...".
    upstream = ["--engine", "openai", "--upstream-url", "http://127.0.0.1:9/v1"]
    given = ["--state-dir", str(tmp_path), *upstream, "--upstream-protocol", "responses"]
    assert main(["serve", *given, "--upstream-protocol", "chat"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "rlproxy serve: --upstream-protocol, its value 2: Input should be 'responses', 'messages' or 'completions'\n"
    )
    assert main(["serve", "--state-dir", str(tmp_path), "--judge-api-base", "ftp://judge"]) == 2
    assert capsys.readouterr().err.startswith("rlproxy serve: --judge-api-base must start with http:// or https://")
    monkeypatch.setenv("RLPROXY_JUDGE_API_BASE", "ftp://judge")
    assert main(["serve", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlproxy serve: RLPROXY_JUDGE_API_BASE (environment variable): --judge-api-base must start")


def test_a_shadow_judge_base_that_is_no_http_url_is_refused_even_without_shadows_and_never_repeated(capsys, tmp_path):
    # RULER requests may name it as judge_api_base with shadows off too, and it went unchecked then; with
    # shadows on, the refusal repeated the URL, password and all.
    url = "ftp://judge:hunter2@gpu-box/v1"
    shadows = ["--shadow-samples", "2", "--shadow-judge-model", "openai/judge"]
    for flags in (shadows, []):
        assert main(["serve", "--state-dir", str(tmp_path), *flags, "--shadow-judge-api-base", url]) == 2
        err = capsys.readouterr().err
        assert "rlproxy serve: --shadow-judge-api-base must start with http:// or https://" in err, err
        assert "hunter2" not in err


def test_a_state_dir_or_store_under_home_written_with_a_tilde_is_under_home(tmp_path, monkeypatch):
    # No shell expands the ~ of `--state-dir=~/runs`, nor of RLPROXY_STATE_DIR=~/runs in an env file: the
    # gateway made a directory named '~' in the current one and kept its store there.
    from gateway.cli import build_parser, settings_from_args

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    settings = settings_from_args(build_parser().parse_args(["serve", "--state-dir=~/runs", "--store=~/shared.db"]))
    assert settings.state_dir == tmp_path / "home" / "runs" and settings.store == str(tmp_path / "home" / "shared.db")
    monkeypatch.setenv("RLPROXY_STATE_DIR", "~/runs")
    assert settings_from_args(build_parser().parse_args(["train"])).state_dir == tmp_path / "home" / "runs"


def test_a_gpu_device_without_torch_installed_is_one_line(capsys, tmp_path, monkeypatch):
    # A gateway-only install (rlproxy[gateway]) has no torch: the trainer it starts beside a vLLM failed on
    # its import, was started again, and failed again.
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    argv = ["serve", "--state-dir", str(tmp_path), "--engine", "vllm", "--vllm-url", "http://127.0.0.1:9"]
    assert main([*argv, "--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith(
        "rlproxy serve: --device cuda needs torch, which is not installed here: pip install 'rlproxy[train]'"
    )


def test_serve_says_which_given_settings_the_others_leave_with_nothing_to_do(caplog, tmp_path):
    # `--canary-share 0.3` without `--promote canary` (or --shadow-rate without --shadow-samples) was
    # taken and ignored without a word, and the run was taken for one with it. A port in use ends the start
    # right after the settings are said, before anything loads.
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        argv = ["serve", "--state-dir", str(tmp_path), "--port", str(taken.getsockname()[1])]
        assert main([*argv, "--canary-share", "0.3", "--shadow-rate", "0.5", "--kl-estimator", "k2"]) == 2
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert said == [
            "--kl-estimator does nothing without --beta above 0 (the KL term it estimates): ignored",
            "--canary-share does nothing without --promote canary: ignored",
            "--shadow-rate does nothing without --shadow-samples: ignored",
        ]
        caplog.clear()  # with what they need, or tuned for the model (smollm2's --beta is 0.2): nothing to say
        given = ["--promote", "canary", "--canary-share", "0.3", "--base-model", "smollm2", "--kl-estimator", "k2"]
        assert main([*argv, *given]) == 2
        assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_very_large_finite_value_is_refused_in_one_line_as_infinity_is(capsys, tmp_path, monkeypatch):
    # `--max-body-mb 1e308` crashed serve with an OverflowError (its limit in bytes is an int), and waits
    # this long crash the wait itself (time.sleep, Event.wait, torch's timedelta): every number has a ceiling.
    for name in ("max_body_mb", "upstream_timeout", "poll_interval", "dist_timeout", "canary_max_wait", "seed"):
        with pytest.raises(ValueError, match="less than"):
            Settings(**{name: 10**300})
    given = ["--state-dir", str(tmp_path), "--trainer", "off"]
    assert main(["serve", *given, "--max-body-mb", "1e308"]) == 2
    err = capsys.readouterr().err
    assert err == "rlproxy serve: --max-body-mb: Input should be less than or equal to 1048576\n", err
    monkeypatch.setenv("RLPROXY_POLL_INTERVAL", "1e10")
    assert main(["train", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "rlproxy train: RLPROXY_POLL_INTERVAL (environment variable): Input should be less than or equal to 3600\n"
    )
    from gateway.http.limits import Limits

    monkeypatch.delenv("RLPROXY_POLL_INTERVAL")
    assert Limits.from_settings(Settings(max_body_mb=1024 * 1024)).max_body_bytes == 2**40


def test_a_setting_left_with_nothing_to_do_is_named_as_it_was_given(caplog, tmp_path, monkeypatch):
    # RLPROXY_CANARY_SHARE=0.3 in a compose file was blamed on a `--canary-share` never given.
    import socket

    monkeypatch.setenv("RLPROXY_CANARY_SHARE", "0.3")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        argv = ["serve", "--state-dir", str(tmp_path), "--port", str(taken.getsockname()[1])]
        assert main([*argv, "--shadow-rate", "0.5"]) == 2
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == [
        "RLPROXY_CANARY_SHARE (environment variable) does nothing without --promote canary: ignored",
        "--shadow-rate does nothing without --shadow-samples: ignored",
    ]


@pytest.mark.parametrize("threads", ["abc", "0", "-1", "2.5"])
def test_a_torch_threads_variable_that_is_no_number_of_threads_is_one_line(capsys, tmp_path, monkeypatch, threads):
    # RLPROXY_TORCH_THREADS=abc ended `rlproxy train` in int()'s ValueError traceback once the model was
    # loaded (under `serve`, its trainer child crashed so at every restart), 0 in torch's RuntimeError.
    import socket

    monkeypatch.setenv("RLPROXY_TORCH_THREADS", threads)
    with socket.socket() as taken:  # were serve to start, it would stop at once on this port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for command in (["train"], ["serve", "--port", str(taken.getsockname()[1])]):
            assert main([*command, "--state-dir", str(tmp_path)]) == 2
            err = capsys.readouterr().err
            assert err == (
                f"rlproxy {command[0]}: RLPROXY_TORCH_THREADS={threads!r} is not a number of threads: give a "
                "whole number from 1 to 4096 (the trainer's CPU threads), or unset it\n"
            ), err


@pytest.mark.parametrize(
    "flag, value, ceiling",
    [
        ("--learning-rate", "1e9", "1"),
        ("--weight-decay", "1e9", "100"),
        ("--beta", "1e30", "1000"),
        ("--epsilon", "1e300", "1000000"),
        ("--tis-cap", "1e300", "1000000"),
        ("--lora-alpha", "1000000000", "65536"),
        ("--lora-rank", "1000000000", "65536"),
    ],
)
def test_a_training_knob_no_run_can_train_at_is_refused_at_start(capsys, tmp_path, flag, value, ceiling):
    # Each trained a step, or none: --learning-rate 1e9, --weight-decay 1e9, --lora-alpha 1e9 served a NaN
    # adapter and set every later group aside as failed (NonFiniteStep), as if the data were at fault;
    # --beta 1e30 made every gradient infinite, --epsilon 1e300 failed every clamp (float32 overflow).
    import socket

    with socket.socket() as taken:  # were serve to start, it would stop at once on this port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve", "--state-dir", str(tmp_path), "--port", port, "--trainer", "auto", flag, value]) == 2
    err = capsys.readouterr().err
    assert err == f"rlproxy serve: {flag}: Input should be less than or equal to {ceiling}\n", err


def test_training_knobs_far_past_any_real_run_still_start():
    # The ceilings refuse only what cannot train: each of these trained three steps of the built-in model.
    Settings(learning_rate=1.0, weight_decay=100, beta=1e3, epsilon=1e6, tis_cap=1e6, lora_rank=65536, lora_alpha=65536)
