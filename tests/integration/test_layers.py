"""The layer rules as the processes of a real stack show them: the gateway runs no model, so
its process never loads torch (pyproject.toml's import-linter contracts check the import
graph; this checks the process ``pdserve up`` started, CLI included)."""

from __future__ import annotations

from pathlib import Path

from tests.integration.conftest import Stack


def shared_libraries(pid: int) -> set[str]:
    """File names of the shared objects mapped into a live process."""
    names = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and ".so" in fields[-1]:
            names.add(Path(fields[-1]).name)
    return names


def torch_libraries(pid: int) -> set[str]:
    return {name for name in shared_libraries(pid) if name.startswith(("libtorch", "libc10"))}


def test_the_gateway_process_loads_no_torch(stack: Stack) -> None:
    children = stack.children()
    gateway = children["gateway"]
    worker = next(c for c in children.values() if c.role == "decode")
    # The probe itself: a worker of the same stack has libtorch mapped.
    assert torch_libraries(worker.pid), f"{worker.name} maps no libtorch: the probe is broken"
    # After the stack has served requests (other tests of this session use it), not only at
    # start: no lazy import on the request path loads torch either.
    assert stack.cli("generate", "--target", stack.target, "--max-tokens", "4", "Hi").returncode == 0
    assert torch_libraries(gateway.pid) == set(), (
        f"the gateway (pid {gateway.pid}) maps {sorted(torch_libraries(gateway.pid))}"
    )
