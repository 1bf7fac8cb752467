"""A connector that applies nothing: the planner only exports the split it wants
(``pdserve:planner_desired_workers{role}``) for an autoscaler to act on (an HPA on an
External metric, or KEDA; the chart wires an HPA with ``planner.mode=metrics``). The split
in force is what the registry lists."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from common.planner.types import Split
from services.planner.connectors import ConnectorError
from services.planner.observe import Fleet


class MetricsConnector:
    def __init__(self, read_fleet: Callable[[], Awaitable[Fleet]]) -> None:
        self.read_fleet = read_fleet

    async def current(self) -> Split:
        split = (await self.read_fleet()).split
        if split is None:
            raise ConnectorError("no decode worker is registered; the fleet cannot serve")
        return split

    async def apply(self, split: Split) -> None:
        """The gauges carry it (services/planner/metrics.py)."""
