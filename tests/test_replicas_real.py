"""Two real vLLM replicas (the CPU build, the built-in model) behind one gateway, as a user starts
them: `rlproxy serve --engine vllm --vllm-replicas 2`. Which replica answered a call, and with
which LoRA, is read from vLLM's own request log (`--enable-log-requests`: "Received request
chatcmpl-ID ... lora_request: LoRARequest(lora_name='agent@N', ...)", ID the gateway's
X-Request-Id), never from the gateway's word. The trainer is played by writing steps into the
store, as tests/test_promotion.py does; one pair of vLLMs serves every test of the module."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from gateway.models.registry import resolve_base_model
from gateway.store.sqlite import SQLiteStore
from tests.helpers import gateway_process
from tests.helpers_real_vllm import vllm_python
from tests.helpers_vllm import wait_until

pytestmark = pytest.mark.timeout(900)

RECEIVED = re.compile(r"Received request chatcmpl-(\S+?): .*?lora_request: (None|LoRARequest\(lora_name='([^']+)')")


def write_adapter(base_dir: str, path: Path, seed: int) -> None:
    """A LoRA on the projections vLLM serves, with a random B: a policy of its own."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    os.rename(tmp, path)


class Pair:
    """The gateway in front of two managed CPU vLLMs, and what their logs say."""

    def __init__(self, url: str, state: Path, proc):
        self.url, self.state, self.proc = url, state, proc
        self.http = httpx.Client(base_url=url, timeout=300)
        self.store = SQLiteStore(state / "rlproxy.db")
        self.base_dir = resolve_base_model("rlproxy/tiny-qwen2", state)

    def chat(self, session: str, **body) -> httpx.Response:
        messages = [{"role": "user", "content": f"Session {session} says hello."}]
        response = self.http.post(
            "/v1/chat/completions",
            headers={"X-Session-Id": session},
            json={"model": "agent", "messages": messages, "max_tokens": 4, **body},
        )
        assert response.status_code == 200, response.text
        return response

    def publish(self, step: int) -> None:
        path = self.state / "models" / "agent" / "checkpoints" / f"{step:04d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_adapter(self.base_dir, path, seed=step + 1)
        self.store.insert_step("agent", step, str(path.resolve()), {"loss": 0.0}, [], state="promoted")

    def received(self, *ids: str) -> dict[str, set[tuple[int, str | None]]]:
        """Request id -> the (replica, LoRA) pairs whose vLLM logged it: one, or two for a call a
        replica took and died on, answered by the next. Waits until every id in `ids` is logged
        (vLLM's log lines can land a moment after the answer)."""

        def read() -> dict[str, set[tuple[int, str | None]]] | None:
            seen: dict[str, set[tuple[int, str | None]]] = {}
            for replica, name in enumerate(("vllm.log", "vllm-1.log")):
                for match in RECEIVED.finditer((self.state / name).read_text(errors="replace")):
                    seen.setdefault(match.group(1), set()).add((replica, match.group(3)))
            return seen if set(ids) <= set(seen) else None

        return wait_until(read, timeout=60, what="vLLM's log lines of the calls")

    def replicas(self) -> list[dict]:
        return self.http.get("/healthz").json()["replicas"]

    def vllm_pid(self, replica: int) -> int:
        socket = str(self.state / ("vllm.sock" if replica == 0 else f"vllm-{replica}.sock"))
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            cmdline = child.cmdline()
            if "vllm.entrypoints.openai.api_server" in " ".join(cmdline) and socket in cmdline:
                return child.pid
        raise AssertionError(f"no vLLM process on {socket}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    state = tmp_path_factory.mktemp("replicas")
    args = [
        "--engine",
        "vllm",
        "--vllm-python",
        vllm_python(),
        "--vllm-replicas",
        "2",
        "--vllm-arg=--enable-log-requests",
        "--trainer",
        "off",
        "--state-dir",
        str(state),
        "--poll-interval",
        "0.2",
        "--log-level",
        "warning",
    ]
    with gateway_process(args, startup_timeout=600) as (proc, url):
        pair = Pair(url, state, proc)
        yield pair
        pair.http.close()


def test_every_call_of_a_session_lands_on_one_replica(pair):
    ids: dict[str, list[str]] = {}
    for turn in range(3):
        for i in range(12):
            response = pair.chat(f"stick-{i}", stream=turn == 1)
            ids.setdefault(f"stick-{i}", []).append(response.headers["x-request-id"])
    received = pair.received(*(rid for rids in ids.values() for rid in rids))
    replicas = {session: {replica for rid in rids for replica, _ in received[rid]} for session, rids in ids.items()}
    assert all(len(found) == 1 for found in replicas.values()), replicas  # one replica per session
    assert {next(iter(found)) for found in replicas.values()} == {0, 1}  # and the sessions spread over both
    assert [r["state"] for r in pair.replicas()] == ["ready", "ready"]


def test_a_hot_swap_under_concurrent_callers_leaves_no_call_on_the_old_step(pair):
    pair.publish(0)
    wait_until(lambda: pair.chat("swap-0").headers.get("x-model-step") == "0", timeout=120, what="agent -> @0")
    calls: list[tuple[float, str]] = []  # (when the call started, its request id)
    moved: list[float] = []  # when the first answer from step 1 came back
    stop = threading.Event()

    def keep_calling(worker: int) -> None:
        n = 0
        while not stop.is_set():
            started = time.monotonic()
            response = pair.chat(f"swap-{worker}-{n % 3}")
            calls.append((started, response.headers["x-request-id"]))
            if response.headers.get("x-model-step") == "1" and not moved:
                moved.append(time.monotonic())
            n += 1

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(keep_calling, w) for w in range(6)]
        time.sleep(1.0)
        pair.publish(1)
        wait_until(lambda: bool(moved), timeout=120, what="agent -> @1")
        time.sleep(2.0)  # keep calling on both replicas after the move
        stop.set()
        for future in futures:
            future.result()  # no call failed
    received = pair.received(*(rid for _, rid in calls))
    after = [served for started, rid in calls if started > moved[0] for served in received[rid]]
    assert after and {lora for _, lora in after} == {"agent@1"}, after  # nothing on step 0 once NAME moved
    assert {replica for replica, _ in after} == {0, 1}  # on either replica
    assert {replica["step"] for replica in pair.replicas()} == {1}


def test_killing_a_replica_fails_no_call_that_had_not_started_and_a_restarted_one_serves_the_step(pair):
    pair.publish(2)
    wait_until(lambda: pair.chat("kill-0").headers.get("x-model-step") == "2", timeout=120, what="agent -> @2")
    sessions = [f"kill-{i}" for i in range(10)]
    first = {s: pair.chat(s).headers["x-request-id"] for s in sessions}
    logged = pair.received(*first.values())
    home = {s: replica for s, rid in first.items() for replica, _ in logged[rid]}
    assert set(home.values()) == {0, 1}
    outcomes: list[tuple[str, str | BaseException]] = []
    stop = threading.Event()

    def keep_calling(session: str) -> None:
        while not stop.is_set():
            try:  # not streamed: no byte comes back before the whole answer, so none may fail
                outcomes.append((session, pair.chat(session, max_tokens=16).headers["x-request-id"]))
            except BaseException as exc:  # noqa: BLE001 - every failure is the test's finding
                outcomes.append((session, exc))

    pid = pair.vllm_pid(1)
    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        futures = [pool.submit(keep_calling, s) for s in sessions]
        wait_until(lambda: len(outcomes) >= 10, timeout=120, what="calls before the kill")
        for child in psutil.Process(pid).children(recursive=True):
            child.kill()
        os.kill(pid, signal.SIGKILL)
        killed = len(outcomes)
        wait_until(lambda: len(outcomes) >= killed + 20, timeout=120, what="calls after the kill")
        stop.set()
        for future in futures:
            future.result()
    failures = [outcome for _, outcome in outcomes if isinstance(outcome, BaseException)]
    # vLLM writes a reply's headers and its body apart, so a kill can fall between them: that
    # call had started (a byte came back) and is the 503 that says so. No other call may fail.
    not_started = [failure for failure in failures if "after its answer had begun" not in str(failure)]
    assert not not_started, not_started[:3]
    received = pair.received(*(rid for _, rid in outcomes if isinstance(rid, str)))
    after = [(s, received[rid]) for s, rid in outcomes[killed:] if isinstance(rid, str) and home[s] == 1]
    moved = {s for s, served in after if (0, "agent@2") in served}
    assert moved, "replica 1's sessions went on on replica 0"
    # The gateway restarts the replica; it loads the serving step before it takes a call.
    wait_until(lambda: pair.replicas()[1]["state"] == "ready", timeout=600, interval=1.0, what="replica 1 back")
    assert pair.replicas()[1]["step"] == 2
    back = [pair.chat(s) for s in sessions if home[s] == 1]
    received = pair.received(*(r.headers["x-request-id"] for r in back))
    assert set.union(*(received[r.headers["x-request-id"]] for r in back)) == {(1, "agent@2")}  # home, on step 2
    log = (pair.state / "vllm-1.log").read_text(errors="replace")
    restarted = log[log.rindex("Starting vLLM server") :]
    loaded = restarted.index("Loaded new LoRA adapter: name 'agent@2'")
    assert loaded < restarted.index("Received request")  # the step was in before the first call came


def test_a_step_asked_for_by_name_loads_only_on_the_replica_its_session_routes_to(pair):
    path = pair.state / "models" / "agent" / "checkpoints" / "0003"
    write_adapter(pair.base_dir, path, seed=4)
    pair.store.insert_step("agent", 3, str(path.resolve()), {"loss": 0.0}, [], state="candidate")  # never NAME
    pinned = [pair.chat("pinned", model="agent@3") for _ in range(2)]
    assert {r.headers["x-model-step"] for r in pinned} == {"3"}
    received = pair.received(*(r.headers["x-request-id"] for r in pinned))
    ((replica, lora),) = set.union(*(received[r.headers["x-request-id"]] for r in pinned))
    assert lora == "agent@3"
    loaded = [
        "Loaded new LoRA adapter: name 'agent@3'" in (pair.state / name).read_text(errors="replace")
        for name in ("vllm.log", "vllm-1.log")
    ]
    assert loaded == [replica == 0, replica == 1]  # one LoRA slot taken, on the replica that served it
