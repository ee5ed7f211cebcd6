"""The several-machines deploy files agree with the CLI and with each other: compose runs
PostgreSQL, two gateways behind a load balancer and a trainer, each with its own state volume;
the SkyPilot recipes put gateways on CPU nodes and the trainer on a GPU node, and every
`rlproxy COMMAND --flag` they use exists. One call goes through compose's own nginx.conf, in
front of two gateways started as compose starts them, on a real PostgreSQL."""

import contextlib
import re
import subprocess
import time

import httpx
import pytest
import yaml
from openai import OpenAI

from tests.browser import find_or_install_nginx
from tests.helpers import free_port, gateway_process
from tests.test_deploy import DEPLOY, cli_flags, rlproxy_invocations, shell_invocations

KEY = "compose-test-key-" + "3c9e11d0a7b2"


def _flags_exist(invocations):
    for command, args in invocations:
        unknown = {a.split("=")[0] for a in args if a.startswith("--")} - cli_flags(command)
        assert not unknown, f"rlproxy {command}: unknown flag(s) {sorted(unknown)}"


def test_compose_runs_postgres_two_gateways_a_balancer_and_a_trainer():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert services["postgres"]["image"].startswith("postgres:")
    gateways = [name for name, s in services.items() if s.get("command", [None])[0] == "serve"]
    trainers = [name for name, s in services.items() if s.get("command", [None])[0] == "train"]
    assert len(gateways) == 2 and len(trainers) == 1
    volumes = [services[name]["volumes"][0].split(":")[0] for name in (*gateways, *trainers)]
    assert len(set(volumes)) == 3, "every rlproxy service has a state volume of its own"
    for name in (*gateways, *trainers):
        service = services[name]
        assert service["environment"]["RLPROXY_STORE"].startswith("postgresql://")
        assert "--store" not in service["command"], "the URL holds a password: environment, not argv"
        _flags_exist(rlproxy_invocations(["rlproxy", *service["command"]]))
    nginx = (DEPLOY / "nginx.conf").read_text()
    assert sorted(re.findall(r"server (gateway-\w+):8000", nginx)) == sorted(gateways)
    assert "proxy_buffering off" in nginx  # streams pass through


def test_skypilot_recipes_put_gateways_on_cpu_and_the_trainer_on_a_gpu():
    gateways = yaml.safe_load((DEPLOY / "sky" / "gateways.yaml").read_text())
    trainer = yaml.safe_load((DEPLOY / "sky" / "trainer.yaml").read_text())
    assert "accelerators" not in gateways["resources"] and gateways["service"]["replicas"] >= 2
    assert gateways["service"]["readiness_probe"] == "/healthz"
    assert trainer["resources"]["accelerators"]
    for task, command in ((gateways, "serve"), (trainer, "train")):
        assert "RLPROXY_STORE" in task["secrets"]
        found = shell_invocations(task["setup"]) + shell_invocations(task["run"])
        assert command in [c for c, _ in found]
        _flags_exist(found)


@contextlib.contextmanager
def _balancer(nginx: str, tmp_path, backends: dict[str, int]):
    """deploy/nginx.conf as compose mounts it, its replicas and port moved to loopback ports."""
    port = free_port()
    conf = (DEPLOY / "nginx.conf").read_text().replace("listen 8000;", f"listen 127.0.0.1:{port};")
    for name, backend_port in backends.items():
        conf = conf.replace(f"server {name}:8000", f"server 127.0.0.1:{backend_port}")
    temp = "".join(
        f"    {kind}_temp_path {tmp_path}/{kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf = conf.replace("http {\n", f"http {{\n    access_log off;\n{temp}", 1)
    (tmp_path / "nginx.conf").write_text(f"pid {tmp_path}/nginx.pid;\n{conf}")
    args = [nginx, "-p", str(tmp_path), "-e", str(tmp_path / "error.log"), "-c", str(tmp_path / "nginx.conf")]
    proc = subprocess.Popen([*args, "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "nginx exited"
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.timeout(600)
def test_one_call_through_the_compose_balancer(tmp_path, postgres_db):
    nginx, why = find_or_install_nginx()
    if nginx is None:
        pytest.skip(why)
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    with contextlib.ExitStack() as stack:
        backends = {}
        for name in ("gateway-a", "gateway-b"):
            command = services[name]["command"][1:]
            args = [
                a
                for i, a in enumerate(command)
                if a not in ("--host", "--port") and command[i - 1] not in ("--host", "--port")
            ]
            env = {
                **{k: str(v) for k, v in services[name]["environment"].items()},
                "RLPROXY_STORE": postgres_db,
                "RLPROXY_API_KEY": KEY,
                "RLPROXY_STATE_DIR": str(tmp_path / name),
                "RLPROXY_BASE_MODEL": "rlproxy/tiny-qwen2",
            }
            port = free_port()
            stack.enter_context(gateway_process(args, env=env, port=port))
            backends[name] = port
        url = stack.enter_context(_balancer(nginx, tmp_path, backends))

        client = OpenAI(base_url=url + "/v1", api_key=KEY, default_headers={"X-Session-Id": "through-nginx"})
        reply = client.chat.completions.create(
            model="agent", max_tokens=4, messages=[{"role": "user", "content": "hello"}]
        )
        assert reply.choices[0].message.content is not None
        auth = {"Authorization": f"Bearer {KEY}"}
        # A page of the balancer's own origin may write (nginx passes the Host it was reached by);
        # another site's may not, key or not.
        own = httpx.post(
            url + "/v1/sessions/through-nginx/reward", json={"reward": 1.0}, headers={**auth, "origin": url}
        )
        assert own.status_code == 200, own.text
        foreign = httpx.post(
            url + "/v1/sessions/through-nginx/reward",
            json={"reward": 0.0},
            headers={**auth, "origin": "http://evil.example"},
        )
        assert foreign.status_code == 403, foreign.text
        assert httpx.get(url + "/v1/sessions/through-nginx", headers=auth).json()["reward"] == 1.0
