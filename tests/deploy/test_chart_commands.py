"""The command lines the chart gives each container are ones pdserve's own CLI accepts, so a
renamed or removed flag breaks this test rather than a rollout."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from typing import Any

import pytest

from common.engine.config import parse_memory_budget
from pdserve.cli.main import build_parser
from tests.deploy.rendering import VARIANTS, containers, render

# What Kubernetes substitutes for $(VAR) when the container starts.
POD_ENV = {"POD_IP": "10.1.2.3", "POD_NAME": "demo-pdserve-decode-7d9f-abcde"}


def pdserve_commands(values: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(container name, argv) of every container that runs the pdserve image."""
    commands = []
    for workload in render(values).workloads():
        for container in containers(workload):
            if "command" in container:  # Redis: its own image and entry point
                continue
            argv = [
                re.sub(r"\$\((\w+)\)", lambda m: POD_ENV[m.group(1)], a) for a in container["args"]
            ]
            commands.append((container["name"], argv))
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                command = container.get(probe, {}).get("exec", {}).get("command")
                if command:  # the image's pdserve, run in the container (no $(VAR) there)
                    assert command[0] == "pdserve", (container["name"], probe)
                    commands.append((f"{container['name']} {probe}", command[1:]))
    return commands


def parse(argv: list[str]) -> argparse.Namespace:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"pdserve rejects {argv}: {stderr.getvalue().strip()}")


def check_accepted(values: dict[str, Any]) -> set[str]:
    seen: set[str] = set()
    for name, argv in pdserve_commands(values):
        args = parse(argv)
        seen.add(args.command)
        for budget in (getattr(args, "kv_cache_memory", None), getattr(args, "capacity", None)):
            if budget is not None:
                assert parse_memory_budget(budget, 64 << 30) > 0, (name, budget)
    return seen


@pytest.mark.parametrize(
    "variant", sorted(name for name, values in VARIANTS.items() if "metrics" not in values)
)
def test_pdserve_accepts_every_rendered_command_line(variant: str) -> None:
    seen = check_accepted(VARIANTS[variant])
    expected = {"gateway", "prefill", "decode", "convert", "generate"}
    if VARIANTS[variant].get("mtls", {}).get("enabled"):
        expected.add("health")  # the probes of mTLS ports
    if VARIANTS[variant].get("blockstore", {}).get("enabled", True):
        expected.add("blockstore")
    if not VARIANTS[variant].get("model", {}).get("convert", {}).get("enabled", True):
        expected.discard("convert")
    assert seen == expected


def test_pdserve_accepts_the_metrics_port() -> None:
    check_accepted({"metrics": {"enabled": True}})


def test_workers_get_their_pod_identity() -> None:
    argvs: dict[str, list[str]] = dict(pdserve_commands({}))
    decode = parse(argvs["decode"])
    assert (decode.advertise, decode.worker_id) == ("10.1.2.3:50053", POD_ENV["POD_NAME"])
    assert decode.host == "0.0.0.0"


@pytest.mark.parametrize("variant", ["mtls-shared-secret", "mtls-per-role"])
def test_mtls_probes_check_the_process_with_its_own_certificate(variant: str) -> None:
    commands = dict(pdserve_commands(VARIANTS[variant]))
    probed = set()
    for name, argv in commands.items():
        if not name.endswith("Probe"):
            continue
        container = name.split()[0]
        probe, process = parse(argv), parse(commands[container])
        assert probe.command == "health"
        assert probe.target == f"127.0.0.1:{process.port}", name
        assert (probe.tls_cert, probe.tls_key, probe.tls_ca) == (
            process.tls_cert, process.tls_key, process.tls_ca
        ), name  # fmt: skip
        probed.add(container)
    assert probed == {"prefill", "decode", "blockstore"}  # the gateway's port is plaintext


def cli_commands() -> set[str]:
    (commands,) = [
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    ]
    return set(commands.choices)


@pytest.mark.parametrize("variant", ["planner-kubernetes", "planner-metrics"])
def test_pdserve_accepts_the_planners_command_line(variant: str) -> None:
    assert "planner" in check_accepted(VARIANTS[variant])
    planner = parse(dict(pdserve_commands(VARIANTS[variant]))["planner"])
    assert (planner.namespace, planner.prefill_deployment, planner.decode_deployment) == (
        "llm", "demo-pdserve-prefill", "demo-pdserve-decode",
    )  # fmt: skip
    assert planner.worker_id == POD_ENV["POD_NAME"]
