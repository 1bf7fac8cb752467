"""The planner's interval: observe, decide, apply, record.

Every ``interval_s``:

1. observe: the interval's load from the gateways' metrics, the fleet from the registry
   (services/planner/observe.py), the split in force from the connector;
2. decide: the policy (common/planner/policy.py) with the profile of the fleet's workers
   (from Redis: the workers publish theirs);
3. apply: the connector sets the fleet to the split wanted, when it differs;
4. record: one log line with the inputs and the decision, the planner's metrics, a
   ``plan`` span.

Nothing here stops the planner: a load it cannot read, a profile not yet published, a
connector that fails, are logged and the next interval tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from opentelemetry.util.types import AttributeValue

from common.index.profiles import ProfileStore
from common.planner.policy import Planner, PlannerConfig
from common.planner.profile import WorkerProfile
from common.planner.types import Decision, LoadWindow, Split
from common.telemetry.tracing import tracer
from services.planner.config import PlannerServiceConfig
from services.planner.connectors import Connector, ConnectorError
from services.planner.metrics import PlannerMetrics
from services.planner.observe import Fleet, LoadObserver

log = logging.getLogger(__name__)


class PlannerLoop:
    def __init__(
        self,
        config: PlannerServiceConfig,
        observer: LoadObserver,
        profiles: ProfileStore,
        connector: Connector,
        metrics: PlannerMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.observer = observer
        self.profiles = profiles
        self.connector = connector
        self.metrics = metrics
        self.clock = clock
        self.policy: Planner | None = None
        self.max_workers = config.max_workers
        self.last_decision: Decision | None = None

    async def run_forever(self) -> None:
        await self.observer.observe()  # the first reading: intervals difference from it
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.step()
            except Exception:  # a bug: logged, and the planner goes on
                log.exception("planning interval failed")

    async def step(self) -> Decision | None:
        """One interval; the decision taken (None when there was nothing to decide on)."""
        window, fleet = await self.observer.observe()
        if window is None:
            return None
        if self.policy is None and not await self._start_policy(fleet):
            self.metrics.decisions.labels("no_profile").inc()
            return None
        assert self.policy is not None
        try:
            current = await self.connector.current()
        except ConnectorError as exc:
            log.warning("cannot read the split in force: %s", exc)
            self.metrics.decisions.labels("apply_failed").inc()
            return None
        with tracer().start_as_current_span("plan") as span:
            decision = self.policy.decide(window, current, self.clock())
            span.set_attributes(_attributes(window, current, decision))
            outcome = self._outcome(window, decision)
            if decision.split != current:
                try:
                    await self.connector.apply(decision.split)
                except ConnectorError as exc:
                    outcome = "apply_failed"
                    span.set_attribute("pdserve.planner.apply_error", str(exc))
                    log.warning("could not apply %s: %s", decision.split, exc)
        self.metrics.decisions.labels(outcome).inc()
        self.metrics.record(window, decision, current.prefill, current.decode)
        self.last_decision = decision
        log.log(
            logging.WARNING if not decision.targets_met else logging.INFO,
            "plan %s -> %s (%s)%s: %s; window %.0f s: %d requests (%.2f/s), prompt p50 %.0f "
            "p90 %.0f, output p50 %.0f p90 %.0f, prefix hit %.2f, waiting %d, observed ttft "
            "p90 %.0f ms, tpot p90 %.1f ms",
            current, decision.split, outcome,
            "" if decision.targets_met else "; NO SPLIT MEETS THE TARGETS, keeping the best",
            decision.reason, window.seconds, window.num_arrivals, window.arrival_rate,
            window.prompt_tokens.quantile(0.5), window.prompt_tokens.quantile(0.9),
            window.output_tokens.quantile(0.5), window.output_tokens.quantile(0.9),
            window.prefix_hit_rate, window.num_waiting, window.ttft_ms.quantile(0.9),
            window.itl_ms.quantile(0.9),
        )  # fmt: skip
        return decision

    def _outcome(self, window: LoadWindow, decision: Decision) -> str:
        if window.num_arrivals == 0 and not decision.changed:
            return "no_load"
        return "change" if decision.changed else "hold"

    async def _start_policy(self, fleet: Fleet) -> bool:
        """The policy, once the fleet's profile is in Redis."""
        profile = await self._profile(fleet)
        if profile is None:
            log.warning(
                "no profile of model %s's workers in Redis yet (they publish theirs at start; "
                "pdserve profile measures one); not planning", self.config.model,
            )  # fmt: skip
            return False
        split = fleet.split
        total = split.total if split is not None else 1
        self.max_workers = self.config.max_workers or total
        self.policy = Planner(
            profile,
            self.config.targets,
            PlannerConfig(
                min_workers=min(self.config.min_workers, self.max_workers),
                max_workers=self.max_workers,
                fixed_total=self.config.connector == "local" and not self.config.max_workers,
                dwell_s=self.config.dwell_s,
            ),
        )
        log.info(
            "planning model %s with the profile of %s (measured %s); targets ttft %.0f ms, "
            "itl %.0f ms; %d to %d workers",
            self.config.model, profile.key.slug(),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(profile.measured_unix_ms / 1000)),
            self.config.targets.ttft_ms, self.config.targets.itl_ms,
            self.config.min_workers, self.max_workers,
        )  # fmt: skip
        return True

    async def _profile(self, fleet: Fleet) -> WorkerProfile | None:
        """The newest profile of the weight format most of the fleet serves."""
        try:
            profiles = await self.profiles.list(self.config.model)
        except Exception as exc:
            log.warning("cannot read profiles from Redis: %s", exc)
            return None
        formats = [w.weights for w in fleet.workers]
        common = max(set(formats), key=formats.count) if formats else None
        matching = [p for p in profiles if common is None or p.key.weight_format == common]
        return max(matching, key=lambda p: p.measured_unix_ms, default=None)


def _attributes(
    window: LoadWindow, current: Split, decision: Decision
) -> dict[str, AttributeValue]:
    return {
        "pdserve.planner.current": str(current),
        "pdserve.planner.desired": str(decision.split),
        "pdserve.planner.desired_prefill": decision.split.prefill,
        "pdserve.planner.desired_decode": decision.split.decode,
        "pdserve.planner.predicted_ttft_ms": decision.predicted_ttft_ms,
        "pdserve.planner.predicted_itl_ms": decision.predicted_itl_ms,
        "pdserve.planner.targets_met": decision.targets_met,
        "pdserve.planner.reason": decision.reason,
        "pdserve.planner.window_s": window.seconds,
        "pdserve.planner.arrivals": window.num_arrivals,
        "pdserve.planner.prompt_tokens_mean": window.prompt_tokens.mean(),
        "pdserve.planner.output_tokens_mean": window.output_tokens.mean(),
        "pdserve.planner.prefix_hit_rate": window.prefix_hit_rate,
        "pdserve.planner.waiting": window.num_waiting,
    }
