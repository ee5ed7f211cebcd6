"""`rlproxy serve --trainer auto`'s trainer child: which exits start it again, and how the
gateway shows it (/healthz, /metrics, /v1/dashboard)."""

import os
import sys
import tempfile
import time

import httpx
import pytest

from gateway.app import create_app
from gateway.cli import main
from gateway.errors import StoreUnavailable
from gateway.settings import Settings
from gateway.trainer_process import TrainerChild
from tests.fake_upstream import FakeUpstream
from tests.helpers import ThreadServer


def _wait_for(child: TrainerChild, state: str, restarts: int = 0) -> dict:
    deadline = time.monotonic() + 120
    while child.status()["state"] != state or child.restarts < restarts:
        assert time.monotonic() < deadline, child.status()
        time.sleep(0.05)
    return child.status()


def _gateway_views(child: TrainerChild) -> tuple[dict, str, dict]:
    """/healthz's and /v1/dashboard's trainer, and /metrics, of a gateway whose child is `child`."""
    with FakeUpstream() as upstream, tempfile.TemporaryDirectory() as state:
        settings = Settings(engine="openai", upstream_url=upstream.url, state_dir=state, trainer="off")
        app = create_app(settings.model_copy(update={"insecure_no_api_key": True}))
        app.state.trainer = child
        with ThreadServer(app) as server:
            health = httpx.get(server.url + "/healthz", timeout=30).json()
            metrics = httpx.get(server.url + "/metrics", timeout=30).text
            dashboard = httpx.get(server.url + "/v1/dashboard", timeout=30).json()
    return health["trainer"], metrics, dashboard["trainer"]


def test_a_trainer_that_refuses_its_settings_is_not_started_again_and_the_gateway_says_why(tmp_path, caplog):
    # `rlproxy serve --init-from other@7` with no step 7 of `other`: the trainer exits 2 with the
    # reason, and was started again every 1 to 60 s for ever while /healthz said "restarting"
    # (the reason only in the log). Starting it again fails the same way: it stays failed.
    cmd = [sys.executable, "-m", "gateway.cli", "train", "--state-dir", str(tmp_path), "--init-from", "other@7"]
    child = TrainerChild(cmd, {**os.environ, "RLPROXY_TORCH_THREADS": "1"})
    with caplog.at_level("ERROR", logger="rlproxy"):
        child.start()
        status = _wait_for(child, "failed")
        child._thread.join(timeout=60)
    assert not child._thread.is_alive() and child.restarts == 0  # the watcher is done: no restart comes
    reason = "--init-from other@7: the store has no step 7 of 'other' (steps: none)"
    assert status == {"state": "failed", "restarts": 0, "last_exit": 2, "last_error": reason}
    assert (
        "the trainer refused its settings and is not started again (fix them and restart the gateway; " in caplog.text
    )
    assert caplog.text.rstrip().endswith(reason)

    health, metrics, dashboard = _gateway_views(child)
    assert health == dashboard == status
    assert 'rlproxy_trainer_state{state="failed"} 1.0' in metrics
    assert 'rlproxy_trainer_state{state="running"} 0.0' in metrics
    child.stop(timeout=10)


def test_a_trainer_that_crashes_is_started_again_with_its_error_shown_and_counted():
    # A crash (a traceback, exit 1) is still brought back; /healthz and /metrics show why it exited
    # and how many times it was started again.
    code = "import sys, time\nif len(sys.argv) < 2: raise RuntimeError('out of host memory')\ntime.sleep(60)"
    child = TrainerChild([sys.executable, "-c", code], {})
    real_spawn = child._spawn

    def spawn():  # the first run crashes, the next one keeps running
        child.cmd = [sys.executable, "-c", code] + (["run"] if child.proc is not None else [])
        real_spawn()

    child._spawn = spawn
    try:
        child.start()
        status = _wait_for(child, "running", restarts=1)
        assert status == {
            "state": "running",
            "restarts": 1,
            "last_exit": 1,
            "last_error": "RuntimeError: out of host memory",
        }
        health, metrics, _ = _gateway_views(child)
    finally:
        child.stop(timeout=10)
    assert health == status
    assert "rlproxy_trainer_restarts_total 1.0" in metrics
    assert 'rlproxy_trainer_state{state="running"} 1.0' in metrics


class QuickToGiveUp(TrainerChild):
    FIRST_DELAY_SECONDS = 0.05  # the waits between restarts: 0.05, 0.1, 0.2 ... s
    CRASH_LIMIT = 3


def test_a_trainer_that_crashes_at_once_again_and_again_is_left_failed_and_the_gateway_says_why():
    # A CUDA build that does not fit the card, a broken install: the trainer crashes as it starts,
    # every time. It was started again every minute for ever, /healthz saying "restarting" (or
    # "running", between a start and its crash); after CRASH_LIMIT crashes in a row it stays failed.
    crash = "raise RuntimeError('CUDA error: no kernel image is available for execution on the device')"
    child = QuickToGiveUp([sys.executable, "-c", crash], {}).start()
    try:
        status = _wait_for(child, "failed")
        child._thread.join(timeout=60)
        assert not child._thread.is_alive()  # the watcher is done: no restart comes
        health, metrics, dashboard = _gateway_views(child)
    finally:
        child.stop(timeout=10)
    assert status == {
        "state": "failed",
        "restarts": 2,
        "last_exit": 1,
        "last_error": "crashed 3 times in a row, each within 10 minutes of its start, and is not started again "
        "(fix the cause and restart the gateway; serving goes on); the last: RuntimeError: CUDA error: no kernel "
        "image is available for execution on the device",
    }
    assert health == dashboard == status
    assert 'rlproxy_trainer_state{state="failed"} 1.0' in metrics
    assert "rlproxy_trainer_restarts_total 2.0" in metrics


def test_a_trainer_that_trained_for_a_while_before_it_crashed_starts_its_count_again(tmp_path):
    # Crash, crash, a run that trains longer than STABLE_SECONDS, then crashes: the third crash in a
    # row of quick ones is the one that leaves it failed, not the third crash.
    class Patient(QuickToGiveUp):
        STABLE_SECONDS = 3.0

    runs = tmp_path / "runs"
    code = (
        "import pathlib, sys, time\n"
        "runs = pathlib.Path(sys.argv[1]); n = len(runs.read_text()) if runs.exists() else 0\n"
        "runs.write_text('x' * (n + 1))\n"
        "time.sleep(6 if n == 2 else 0); sys.exit(1)"
    )
    child = Patient([sys.executable, "-c", code, str(runs)], {}).start()
    try:
        status = _wait_for(child, "failed")
    finally:
        child.stop(timeout=10)
    assert runs.read_text() == "xxxxx" and status["restarts"] == 4
    assert status["last_error"].startswith("crashed 3 times in a row")


def test_a_trainer_refused_for_the_moment_is_tried_again_for_as_long_as_it_takes(tmp_path, caplog):
    # Exit 75 (another trainer holds the model's lock: a standby; the store restarting) is no crash:
    # however often it comes, the trainer is started again, and takes over once it can. A standby's
    # wait is no error either: it was logged as one ("the trainer exited") every minute.
    runs = tmp_path / "runs"
    code = (
        "import pathlib, sys, time\n"
        "runs = pathlib.Path(sys.argv[1]); n = len(runs.read_text()) if runs.exists() else 0\n"
        "runs.write_text('x' * (n + 1))\n"
        "print('rlproxy train: another trainer worker (pid 7) holds the lock', file=sys.stderr)\n"
        "sys.exit(75) if n < 4 else time.sleep(60)"
    )
    with caplog.at_level("INFO", logger="rlproxy"):
        child = QuickToGiveUp([sys.executable, "-c", code, str(runs)], {}).start()
        try:
            status = _wait_for(child, "running", restarts=4)
        finally:
            child.stop(timeout=10)
    waits = [r for r in caplog.records if r.name == "rlproxy" and "trainer" in r.getMessage()]
    assert [r.levelname for r in waits] == ["WARNING"] * 4
    assert (
        waits[0]
        .getMessage()
        .startswith(
            "the trainer cannot train for the moment (another trainer worker (pid 7) holds the lock); trying again in"
        )
    )
    assert status == {
        "state": "running",
        "restarts": 4,
        "last_exit": 75,
        "last_error": "another trainer worker (pid 7) holds the lock",
    }


def test_a_trainer_killed_by_a_signal_says_so(tmp_path):
    child = TrainerChild([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], {})
    child.start()
    try:
        status = _wait_for(child, "restarting")
    finally:
        child.stop(timeout=10)
    assert status["last_exit"] == -9 and status["last_error"] == "killed by SIGKILL"


def test_train_exits_75_for_a_failure_of_the_moment_and_2_for_its_settings(tmp_path, monkeypatch, capsys):
    # The exit `serve --trainer auto` decides on: a store that cannot be written now is a reason to
    # try again (75, not counted as a crash), a setting out of range is not (2).
    import trainer.worker

    def store_gone(*args, **kwargs):
        raise StoreUnavailable("the disk holding the store is full", cause="full")

    monkeypatch.setattr(trainer.worker, "run_worker", store_gone)
    assert main(["train", "--state-dir", str(tmp_path)]) == 75
    assert "rlproxy train: the disk holding the store is full" in capsys.readouterr().err
    assert main(["train", "--state-dir", str(tmp_path), "--groups-per-step", "0"]) == 2


@pytest.mark.parametrize(("rank_codes", "exit_code"), [((2, 0), 2), ((75, 0), 75), ((1, 0), 1), ((-9, 0), 1)])
def test_nproc_ranks_that_refuse_their_settings_exit_2_and_crashed_ones_1(rank_codes, exit_code):
    from trainer.distributed.launch import _watch

    class Rank:
        def __init__(self, code):
            self.returncode = code

        def poll(self):
            return self.returncode

    with pytest.raises(Exception) as failed:
        _watch([Rank(code) for code in rank_codes])
    assert failed.value.exit_code == exit_code


def test_serve_refuses_an_init_from_step_the_store_lacks_before_starting_its_trainer(tmp_path):
    # A new run (no step yet) that --init-from seeds: the step it names is looked up at start, where
    # the trainer found it missing only after loading its model, and NAME stayed `loading` step 0.
    import subprocess

    flags = ["--state-dir", str(tmp_path / "state"), "--port", "0", "--insecure-no-api-key", "--trainer", "auto"]
    serve = [sys.executable, "-m", "gateway.cli", "serve", *flags, "--init-from", "other@7"]
    done = subprocess.run(serve, capture_output=True, text=True, timeout=120)  # it served on, before
    assert done.returncode == 2
    assert done.stderr.endswith(
        "rlproxy serve: --init-from other@7: the store has no step 7 of 'other' (steps: none)\n"
    )
    assert "starting the trainer" not in done.stderr and "Traceback" not in done.stderr


def test_the_dashboard_shows_a_failed_trainer_and_why(tmp_path):
    from tests.browser import find_or_install_chromium
    from tests.test_dashboard import Page

    chromium, why = find_or_install_chromium()
    if chromium is None:
        pytest.skip(why)
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
    said = (
        "import sys; print('rlproxy train: --init-from other@7: the store has no step 7', file=sys.stderr); sys.exit(2)"
    )
    child = TrainerChild([sys.executable, "-c", said], {}).start()
    _wait_for(child, "failed")
    with FakeUpstream() as upstream:
        settings = Settings(engine="openai", upstream_url=upstream.url, state_dir=str(tmp_path), trainer="off")
        app = create_app(settings.model_copy(update={"insecure_no_api_key": True}))
        app.state.trainer = child
        with ThreadServer(app) as server, sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            page = Page(browser, server.url)
            try:
                page.open("/ui")
                page.wait_until("document.querySelector('#trainer-state') !== null")
                card = page.page.inner_text("#trainer-state")
                assert page.errors == []
            finally:
                page.close()
                browser.close()
    assert "failed" in card and "--init-from other@7: the store has no step 7" in card


def test_the_reason_shown_without_a_key_holds_no_secret():
    # /healthz answers anyone who reaches the port: a trainer's last line naming a key or a URL
    # with a password in it is shown masked.
    said = (
        "import sys; print('rlproxy train: cannot reach postgresql://rl:hunter22@db/rl with key sk-live-123456', "
        "file=sys.stderr); sys.exit(2)"
    )
    child = TrainerChild([sys.executable, "-c", said], {}, secrets=["sk-live-123456"]).start()
    error = _wait_for(child, "failed")["last_error"]
    assert "hunter22" not in error and "sk-live-123456" not in error
    assert error.startswith("cannot reach postgresql://")


GATEWAY_SLOW_TO_STOP = """
import asyncio, contextlib, logging, sys
from starlette.applications import Starlette
from gateway.http.listen import listen
from gateway.trainer_process import TrainerChild, run_gateway

@contextlib.asynccontextmanager
async def lifespan(app):
    yield
    await asyncio.sleep(3)  # requests to finish, an engine to stop: the trainer is gone long before

logging.basicConfig(level="INFO", stream=sys.stderr)
trainer = "import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: sys.exit(0)); time.sleep(120)"
child = TrainerChild([sys.executable, "-c", trainer], {}).start()
run_gateway(Starlette(lifespan=lifespan), child, listen("127.0.0.1", 0), log_level="info")
"""


def test_ctrl_c_does_not_say_the_trainer_stopped_while_the_gateway_serves(tmp_path):
    # Ctrl-C reaches the whole process group: the trainer stops at once (exit 0) while the gateway
    # still finishes its requests, and the gateway warned "the trainer stopped (code 0) while the
    # gateway serves; restart the gateway to train again" as it shut down.
    import signal
    import subprocess

    script = tmp_path / "slow_to_stop.py"
    script.write_text(GATEWAY_SLOW_TO_STOP)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    try:
        log = []
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            if "listening on" in line:
                break
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C
        log.append(proc.stderr.read())
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(log)
    assert code == 0, output
    assert "Application shutdown complete" in output
    assert "the trainer stopped" not in output and "the trainer exited" not in output


def test_a_trainer_that_cannot_be_started_again_at_once_is_tried_again_later():
    # Out of host memory (what killed it, often), forking the gateway fails: that OSError ended the
    # watcher, and the trainer was never started again while /healthz said "restarting".
    code = "import sys, time; sys.exit(1) if len(sys.argv) < 2 else time.sleep(60)"
    child = TrainerChild([sys.executable, "-c", code], {})
    real_spawn, tries = child._spawn, []

    def spawn():  # the first run exits with 1; the first restart cannot fork; the next one runs
        tries.append(1)
        if len(tries) == 2:
            raise OSError(12, "Cannot allocate memory")
        child.cmd = [sys.executable, "-c", code] + (["run"] if len(tries) > 1 else [])
        real_spawn()

    child._spawn = spawn
    try:
        child.start()
        status = _wait_for(child, "running", restarts=1)
    finally:
        child.stop(timeout=10)
    assert len(tries) == 3
    assert status == {
        "state": "running",
        "restarts": 1,
        "last_exit": 1,
        "last_error": "could not be started again: [Errno 12] Cannot allocate memory",
    }


def test_a_second_trainer_of_the_same_model_exits_75_to_take_over_later(tmp_path, capsys):
    # deploy/README.md: a second trainer of a model "is refused at start, and takes over once the
    # first is gone". Refused with exit 2 (settings), `serve --trainer auto` would never start it again;
    # with 1 (a crash), it would be left failed after CRASH_LIMIT tries.
    from gateway.store.sqlite import SQLiteStore
    from trainer.lock import take_lock

    store = SQLiteStore(tmp_path / "rlproxy.db")
    held = take_lock(tmp_path / "models" / "agent" / "checkpoints", "agent", store)
    try:
        assert main(["train", "--state-dir", str(tmp_path), "--max-steps", "1"]) == 75
    finally:
        held.close()
    assert "rlproxy train: another trainer worker (pid " in capsys.readouterr().err


def test_a_store_that_does_not_answer_at_start_is_tried_again():
    # PostgreSQL restarting just as a crashed trainer is started again: "cannot connect to the
    # store" was a settings error (exit 2), and the trainer was never started again.
    import socket

    pytest.importorskip("psycopg_pool")
    from gateway.errors import ConfigError
    from gateway.store.postgres_conn import open_pool

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ConfigError) as refused:
        open_pool(f"postgresql://rl:pw@127.0.0.1:{port}/rl", 1, 1, 1.0)
    assert "cannot connect to the store at" in refused.value.message and "pw" not in refused.value.message
    assert refused.value.exit_code == 75
