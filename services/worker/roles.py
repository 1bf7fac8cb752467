"""An engine worker's role, as state: which of its faces takes new calls.

Every engine worker serves both faces (PrefillService and DecodeService, services/worker/
faces/); the role says which of them admits new calls:

| role | PrefillService | DecodeService |
|---|---|---|
| prefill | admits | refuses (UNAVAILABLE, reason ROLE_CHANGED) |
| decode | refuses | admits (prefills locally what the gateway routes to it) |
| both | admits | admits |

A role change (``WorkerRuntime.set_role``) is one at a time; while one is in progress
another is refused with FAILED_PRECONDITION and nothing of it happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from common.errors import FailedPreconditionError, InvalidRequestError, RoleChangedError
from common.planner.types import BOTH, DECODE, ENGINE_ROLES, PREFILL

FACE_ROLES = {PREFILL: (PREFILL, BOTH), DECODE: (DECODE, BOTH)}  # face -> roles admitting it


@dataclass(frozen=True)
class RoleChange:
    previous: str
    role: str
    num_streams_moved: int
    elapsed_ms: float


class Roles:
    """The role in force, when it began, and the change in progress (if any)."""

    def __init__(self, role: str, clock: Callable[[], float] = time.time) -> None:
        if role not in ENGINE_ROLES:
            raise ValueError(f"role must be one of {', '.join(ENGINE_ROLES)}, got {role!r}")
        self.clock = clock
        self.role = role
        self.since_unix_ms = int(clock() * 1000)
        self.num_changes = 0
        self.changing_to: str | None = None

    def serves(self, face: str) -> bool:
        return self.role in FACE_ROLES[face]

    def admit(self, face: str, worker_id: str) -> None:
        """Refuses a new call of ``face`` the role does not take."""
        if not self.serves(face):
            raise RoleChangedError(
                f"worker {worker_id} serves the {self.role} role and takes no {face} calls; "
                f"route to a {face} worker"
            )

    def begin(self, role: str, worker_id: str) -> str:
        """Starts a change to ``role``; returns the role it replaces."""
        if role not in ENGINE_ROLES:
            raise InvalidRequestError("role", f"must be one of {', '.join(ENGINE_ROLES)}")
        if self.changing_to is not None:
            raise FailedPreconditionError(
                f"worker {worker_id} is already changing its role to {self.changing_to}; "
                "retry once that change is done"
            )
        previous = self.role
        self.changing_to = role
        if role != previous:
            self.role = role
            self.since_unix_ms = int(self.clock() * 1000)
            self.num_changes += 1
        return previous

    def end(self) -> None:
        self.changing_to = None
