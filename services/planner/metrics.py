"""The planner's Prometheus metrics: what it wants, what it predicts, what it saw."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from common.planner.types import DECODE, PREFILL, Decision, LoadWindow
from common.telemetry.metrics import metric_name

OUTCOMES = ("hold", "change", "no_load", "apply_failed", "no_profile")


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.desired = Gauge(
            metric_name("planner_desired_workers"),
            "Engine workers the planner wants in each role (an HPA or KEDA may scale the "
            "Deployments to it: planner.mode=metrics).",
            ["role"], registry=registry,
        )  # fmt: skip
        self.current = Gauge(
            metric_name("planner_current_workers"),
            "Engine workers in each role when the planner last looked.",
            ["role"], registry=registry,
        )  # fmt: skip
        self.predicted_ttft = Gauge(
            metric_name("planner_predicted_ttft_seconds"),
            "Time to first token the planner predicts for the split it wants, at its percentile.",
            registry=registry,
        )
        self.predicted_itl = Gauge(
            metric_name("planner_predicted_itl_seconds"),
            "Time per output token the planner predicts for the split it wants, at its "
            "percentile.",
            registry=registry,
        )
        self.targets_met = Gauge(
            metric_name("planner_targets_met"),
            "1 while the split the planner wants is predicted to meet both SLA targets; 0 "
            "when no split within its bounds can (it keeps the best it has).",
            registry=registry,
        )
        self.arrival_rate = Gauge(
            metric_name("planner_observed_arrival_rate"),
            "Requests per second the gateways routed in the last interval.",
            registry=registry,
        )
        self.decisions = Counter(
            metric_name("planner_decisions"),
            "Planning intervals, by outcome: hold, change, no_load (nothing to plan on), "
            "apply_failed (the connector could not apply it), no_profile.",
            ["outcome"], registry=registry,
        )  # fmt: skip
        for outcome in OUTCOMES:
            self.decisions.labels(outcome)
        for role in (PREFILL, DECODE):
            self.desired.labels(role)
            self.current.labels(role)

    def record(self, window: LoadWindow, decision: Decision, current_prefill: int,
               current_decode: int) -> None:  # fmt: skip
        self.desired.labels(PREFILL).set(decision.split.prefill)
        self.desired.labels(DECODE).set(decision.split.decode)
        self.current.labels(PREFILL).set(current_prefill)
        self.current.labels(DECODE).set(current_decode)
        self.predicted_ttft.set(decision.predicted_ttft_ms / 1000)
        self.predicted_itl.set(decision.predicted_itl_ms / 1000)
        self.targets_met.set(float(decision.targets_met))
        self.arrival_rate.set(window.arrival_rate)
