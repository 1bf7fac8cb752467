"""How the planner applies a split: one connector per kind of fleet.

A connector is the planner's only hand on the fleet. The planner asks it for the split in
force, decides, and hands it the split it wants; the connector owns how that happens
(Kubernetes Deployment scale, roles of ``pdserve up``'s workers, metrics for an HPA).

Contract, for every connector:

- ``current()`` is the split the fleet is set to now (what was asked for, not what is
  ready yet: pods still starting count).
- ``apply(split)`` sets the fleet to ``split`` and returns once the orchestrator has
  accepted it, not once the workers serve. Applying the split in force changes nothing,
  so the planner may apply every interval.
- Faults of the environment (an orchestrator that cannot be reached, an object that is
  missing, a permission the connector lacks) raise ``ConnectorError`` with a message fit
  for the log as it is; the planner logs it, keeps its plan and tries again next
  interval. Any other exception is a bug.
"""

from __future__ import annotations

from typing import Protocol

from common.planner.types import Split


class ConnectorError(Exception):
    """The fleet could not be read or changed this time; the message says why."""


class Connector(Protocol):
    async def current(self) -> Split: ...

    async def apply(self, split: Split) -> None: ...
