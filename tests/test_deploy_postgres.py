"""The several-machines deploy files agree with the CLI and with each other: compose runs
PostgreSQL, two gateways behind a load balancer and a trainer, each with its own state volume;
the SkyPilot recipes put gateways on CPU nodes and the trainer on a GPU node, and every
`rlproxy COMMAND --flag` they use exists."""

import re

import yaml

from tests.test_deploy import DEPLOY, cli_flags, rlproxy_invocations, shell_invocations


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
