"""A worker's Prometheus metrics: its requests, its engine, its KV transfers.

Engine figures (running, waiting, KV usage, prefix cache, preemptions) are read at scrape
time on the engine thread (``EngineLoop.submit``), so a scrape sees the engine as it is,
never a heartbeat-old copy; when the engine is busy past ``SNAPSHOT_TIMEOUT_S`` the last
snapshot serves instead.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.engine.engine import Engine, EngineStats
from common.engine.engine_loop import EngineLoop
from common.engine.grammar import GrammarStats
from common.engine.speculative.stats import SpecDecodeStats
from common.kv.leases import LeaseTable
from common.planner.types import ENGINE_ROLES
from common.telemetry.metrics import (
    TRANSFER_BUCKETS_S,
    RedisHealth,
    RequestMetrics,
    metric_name,
)
from services.worker.expert_load import ExpertLoadCollector, ExpertLoadTracker
from services.worker.roles import Roles

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 1.0

# Where KV came from or went: the producer of a handle (KvTransferService) or the block store.
PRODUCER = "producer"
BLOCK_STORE = "block_store"
RECEIVED = "received"
SENT = "sent"
# What became of a request whose KV pull from its producer failed (decode workers).
KV_LOAD_OUTCOMES = ("block_store", "recompute", "failed")


@dataclass(frozen=True)
class EngineSnapshot:
    stats: EngineStats
    prefix_query_tokens: int
    prefix_hit_tokens: int
    spec: SpecDecodeStats | None = None  # engines with a --speculative-config
    grammar: GrammarStats | None = None  # structured output
    suffix: dict[str, int] | None = None  # method suffix: its trees (SuffixProposer.stats)


def read_snapshot(engine: Engine) -> EngineSnapshot:
    """Engine thread only."""
    spec = engine.spec_stats.copy() if engine.speculative is not None else None
    suffix_stats = getattr(engine.proposer, "stats", None)
    return EngineSnapshot(
        engine.stats(), engine.kv.prefix_query_tokens, engine.kv.prefix_hit_tokens, spec,
        dataclasses.replace(engine.grammars.stats),
        suffix_stats() if suffix_stats is not None else None,
    )  # fmt: skip


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name
        self.requests = RequestMetrics(registry, model_name)
        transfer_labels = ["peer", "direction"]
        self._transfer_bytes = Counter(
            metric_name("kv_transfer_bytes"),
            "KV bytes moved, by peer (producer, block_store) and direction (received, sent).",
            transfer_labels, registry=registry,
        )  # fmt: skip
        self._transfer_blocks = Counter(
            metric_name("kv_transfer_blocks"), "KV blocks moved, by peer and direction.",
            transfer_labels, registry=registry,
        )  # fmt: skip
        self._transfer_seconds = Histogram(
            metric_name("kv_transfer_duration_seconds"),
            "Duration of one KV transfer, by peer and direction.",
            transfer_labels, registry=registry, buckets=TRANSFER_BUCKETS_S,
        )  # fmt: skip
        self._transfer_failures = Counter(
            metric_name("kv_transfer_failures"), "KV transfers that failed, by peer and direction.",
            transfer_labels, registry=registry,
        )  # fmt: skip
        for peer, direction in ((PRODUCER, RECEIVED), (BLOCK_STORE, RECEIVED), (BLOCK_STORE, SENT)):
            for family in (self._transfer_bytes, self._transfer_blocks, self._transfer_failures):
                family.labels(peer, direction)  # every series exists from the start, at 0
        self.redis = RedisHealth(registry)
        self.block_store_up = Gauge(
            metric_name("block_store_up"),
            "1 while this worker uses the block store; 0 while it skips a failing one.",
            registry=registry,
        )
        self.block_store_up.set(1)
        self._index_republished = Counter(
            metric_name("prefix_index_republished_blocks"),
            "Blocks published to the prefix index again after Redis lost or missed them.",
            registry=registry,
        )
        self.kv_load_fallbacks = Counter(
            metric_name("kv_load_fallbacks"),
            "Requests whose KV could not be pulled from its producer, by outcome: block_store "
            "(every full block from there), recompute (the rest computed here), failed.",
            ["outcome"], registry=registry,
        )  # fmt: skip
        for outcome in KV_LOAD_OUTCOMES:
            self.kv_load_fallbacks.labels(outcome)
        self._role = Gauge(
            metric_name("worker_role"),
            "1 for the role this engine worker serves now (prefill, decode, both), 0 for the "
            "others.",
            ["role"], registry=registry,
        )  # fmt: skip
        self._role_changes = Counter(
            metric_name("worker_role_changes"),
            "Role changes in place (pdserve role, the planner), by the roles left and taken.",
            ["from_role", "to_role"], registry=registry,
        )  # fmt: skip

    def watch_role(self, roles: Roles) -> None:
        """``worker_role`` read at scrape time from ``roles``."""
        for role in ENGINE_ROLES:
            self._role.labels(role).set_function(functools.partial(_is_role, roles, role))

    def role_changed(self, previous: str, role: str) -> None:
        self._role_changes.labels(previous, role).inc()

    def index_republished(self, num_blocks: int) -> None:
        self._index_republished.inc(num_blocks)

    def transferred(
        self, peer: str, direction: str, num_bytes: int, num_blocks: int, seconds: float
    ) -> None:
        self._transfer_bytes.labels(peer, direction).inc(num_bytes)
        self._transfer_blocks.labels(peer, direction).inc(num_blocks)
        self._transfer_seconds.labels(peer, direction).observe(seconds)

    def transfer_failed(self, peer: str, direction: str) -> None:
        self._transfer_failures.labels(peer, direction).inc()

    def watch_engine(self, loop: EngineLoop, leases: LeaseTable) -> None:
        self.registry.register(EngineCollector(self.model_name, engine_reader(loop), leases))

    def watch_expert_load(self, tracker: ExpertLoadTracker, per_expert: bool = False) -> None:
        """MoE models: imbalance per layer (and, opt-in, tokens per expert)."""
        self.registry.register(ExpertLoadCollector(self.model_name, tracker, per_expert))


def _is_role(roles: Roles, role: str) -> float:
    return float(roles.role == role)


def engine_reader(loop: EngineLoop) -> Callable[[], EngineSnapshot | None]:
    """Reads a snapshot on the engine thread from any thread; the last one (or None) when
    the engine does not answer within SNAPSHOT_TIMEOUT_S."""
    last: list[EngineSnapshot] = []

    def read() -> EngineSnapshot | None:
        future: concurrent.futures.Future[EngineSnapshot] = concurrent.futures.Future()

        def on_engine(engine: Engine) -> None:
            # Never raises: an exception here would stop the engine thread.
            with contextlib.suppress(Exception):
                try:
                    future.set_result(read_snapshot(engine))
                except Exception as exc:
                    future.set_exception(exc)

        loop.submit(on_engine)
        try:
            snapshot = future.result(timeout=SNAPSHOT_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            return last[0] if last else None
        except Exception:
            log.exception("reading engine figures for metrics failed")
            return last[0] if last else None
        last[:] = [snapshot]
        return snapshot

    return read


class EngineCollector(Collector):
    def __init__(
        self,
        model_name: str,
        read: Callable[[], EngineSnapshot | None],
        leases: LeaseTable,
    ) -> None:
        self.model_name = model_name
        self.read = read
        self.leases = leases

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(None))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self.read()))

    def _families(self, snapshot: EngineSnapshot | None) -> list[Metric]:
        def gauge(name: str, doc: str, value: float | None) -> Metric:
            family = GaugeMetricFamily(metric_name(name), doc, labels=["model_name"])
            if value is not None:
                family.add_metric([self.model_name], value)
            return family

        def counter(name: str, doc: str, value: float | None) -> Metric:
            family = CounterMetricFamily(metric_name(name), doc, labels=["model_name"])
            if value is not None:
                family.add_metric([self.model_name], value)
            return family

        stats = snapshot.stats if snapshot else None
        usage = None
        if stats is not None and stats.num_kv_blocks_total:
            usage = 1 - stats.num_kv_blocks_free / stats.num_kv_blocks_total
        return [
            gauge("num_requests_running", "Requests in the engine's running batch.",
                  stats.num_running if stats else None),
            gauge("num_requests_waiting", "Requests waiting for their first step.",
                  stats.num_waiting if stats else None),
            gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", usage),
            counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                    snapshot.prefix_query_tokens if snapshot else None),
            counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                    snapshot.prefix_hit_tokens if snapshot else None),
            counter("num_preemptions", "Requests preempted for lack of KV blocks.",
                    stats.num_preemptions if stats else None),
            counter("snapkv_prompts_compressed",
                    "Prompts compressed by SnapKV (--kv-compression, sampling.kv_compression).",
                    stats.num_compressed if stats else None),
            counter("snapkv_blocks_kept", "KV blocks compressed prompts kept.",
                    stats.num_compressed_kept_blocks if stats else None),
            counter("snapkv_blocks_dropped", "KV blocks compressed prompts freed.",
                    stats.num_compressed_dropped_blocks if stats else None),
            gauge("kv_leases_active", "Exported KV held under a lease for a consumer.",
                  len(self.leases)),
            counter("kv_lease_expiries", "Leases that expired unreleased.",
                    self.leases.num_expired),
            *self._spec_families(snapshot.spec if snapshot else None, counter),
            *self._suffix_families(snapshot.suffix if snapshot else None, gauge),
            *self._grammar_families(snapshot.grammar if snapshot else None, counter),
        ]  # fmt: skip

    @staticmethod
    def _suffix_families(
        suffix: dict[str, int] | None, gauge: Callable[[str, str, float | None], Metric]
    ) -> list[Metric]:
        """Suffix decoding's global trees, for engines that run it (absent otherwise)."""
        if suffix is None:
            return []
        return [
            gauge("suffix_decoding_cached_responses",
                  "Past responses held in the tenants' suffix trees (bounded by "
                  "suffix_decoding_max_cached_requests).", suffix["cached_responses"]),
            gauge("suffix_decoding_cached_tokens",
                  "Tokens of those responses (bounded by the worker's token budget).",
                  suffix["cached_tokens"]),
            gauge("suffix_decoding_tenants", "Tenants (cache salts) with a suffix tree here.",
                  suffix["tenants"]),
        ]  # fmt: skip

    def _grammar_families(
        self, grammar: GrammarStats | None, counter: Callable[[str, str, float | None], Metric]
    ) -> list[Metric]:
        """Structured output: grammars compiled and what their token masks cost."""
        g = grammar or GrammarStats()
        return [
            counter("structured_output_grammars_compiled",
                    "Constraints compiled against the tokenizer (compiled-grammar cache misses).",
                    g.num_compiled),
            counter("structured_output_grammar_cache_hits",
                    "Constrained requests whose grammar was compiled already.", g.num_cache_hits),
            counter("structured_output_compile_seconds",
                    "Seconds spent compiling grammars.", g.compile_seconds),
            counter("structured_output_mask_steps",
                    "Engine steps that computed token masks for constrained rows.",
                    g.num_mask_steps),
            counter("structured_output_mask_seconds",
                    "Seconds spent computing token masks (divide by mask_steps: per step).",
                    g.mask_seconds),
        ]  # fmt: skip

    def _spec_families(
        self, spec: SpecDecodeStats | None, counter: Callable[[str, str, float | None], Metric]
    ) -> list[Metric]:
        """vLLM's spec_decode_* counters, for engines that speculate (absent otherwise)."""
        if spec is None:
            return []
        per_position = CounterMetricFamily(
            metric_name("spec_decode_num_accepted_tokens_per_pos"),
            "Speculative rounds whose proposal at this position (from 0) was kept.",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(spec.accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], count)
        return [
            counter("spec_decode_num_drafts", "Speculative verify rounds (a request, a step).",
                    spec.num_drafts),
            counter("spec_decode_num_draft_tokens", "Proposed tokens verified.",
                    spec.num_draft_tokens),
            counter("spec_decode_num_accepted_tokens", "Proposed tokens kept.",
                    spec.num_accepted_tokens),
            per_position,
        ]  # fmt: skip
