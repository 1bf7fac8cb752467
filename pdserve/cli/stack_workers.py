"""StackWorkers: a local planner's hands on ``pdserve up``'s engine workers
(services/planner/connectors/local.py WorkerProcesses): it starts a worker as the stack
started its others (their command line, a port, an id and a metrics port of its own) and
stops one (SIGTERM: it drains), recording both in the stack's state file, so that
``pdserve status``, ``pdserve down`` and ``pdserve up``'s watch know them."""

from __future__ import annotations

import signal
from pathlib import Path

from pdserve.cli.launcher import StackState, free_port, signal_child, spawn

ENGINE_COMMANDS = ("prefill", "decode", "worker")


class StackWorkers:
    def __init__(self, state_path: Path) -> None:
        self.state_path = state_path

    def _state(self) -> StackState:
        state = StackState.load(self.state_path)
        if state is None:
            raise FileNotFoundError(f"no stack recorded at {self.state_path}")
        return state

    def start(self, role: str) -> str:
        state = self._state()
        engine = [c for c in state.children if c.role in ("prefill", "decode", "both")]
        if not engine or not engine[0].argv:
            raise ValueError("the stack has no engine worker to copy a command line from")
        template = engine[0]
        names = {c.name for c in state.children}
        number = len(engine)
        while f"worker-{number}" in names:
            number += 1
        name, port = f"worker-{number}", free_port()
        metrics_port = free_port() if template.metrics_port else 0
        argv = _command_for(template.argv, role, name, port, metrics_port)
        child, _ = spawn(
            name, role, argv, f"127.0.0.1:{port}", Path(template.log).parent, metrics_port,
            template.env,
        )  # fmt: skip
        state.children.append(child)
        state.save(self.state_path)
        return name

    def stop(self, worker_id: str) -> None:
        state = self._state()
        child = next((c for c in state.children if c.name == worker_id), None)
        if child is None:
            raise ValueError(f"no worker {worker_id!r} in the stack")
        # Forgotten first: its exit is then no failure to pdserve up's watch.
        state.children.remove(child)
        state.save(self.state_path)
        signal_child(child.pid, signal.SIGTERM)


def _command_for(argv: list[str], role: str, name: str, port: int, metrics_port: int) -> list[str]:
    """``argv`` (an engine worker's) as ``pdserve worker --role ROLE`` with its own id and
    ports."""
    out = list(argv)
    if "--role" in out:  # a `pdserve worker --role X`
        at = out.index("--role")
        del out[at : at + 2]
    index = next(i for i, a in enumerate(out) if a in ENGINE_COMMANDS)
    out[index : index + 1] = ["worker", "--role", role]
    for flag, value in (("--port", port), ("--worker-id", name), ("--metrics-port", metrics_port)):
        if flag in out:
            out[out.index(flag) + 1] = str(value)
        else:
            out += [flag, str(value)]
    return out
