"""WorkerRuntime: what an engine worker holds around its engine, whatever its role, and its
lifecycle.

It owns the engine thread (EngineLoop), the leases on exported KV, and two parts of its own
module each: the worker's entries in Redis (services/worker/index_sync.py: the registry
heartbeat, the prefix index, expert load) and the block store as a second source of KV
(services/worker/store_tier.py). Redis and the block store are optional and never fail a
request: the index is advisory, the store is a cache.

Its role (services/worker/roles.py) says which face takes new calls; ``set_role`` changes
it in place: the engine, its prefix cache, the published blocks and the leases stay.

Draining (SIGTERM, see services/worker/serve.py): ``begin_drain`` marks the worker draining in
the registry at once, so routers skip it, and ``admit`` refuses new calls with
``DrainingError`` (UNAVAILABLE); ``wait_idle`` waits for the calls in flight and the leases
on exported KV; ``end_streams`` ends whatever is left, so that callers resume elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Coroutine, Iterator
from typing import Any

from prometheus_client import CollectorRegistry

from common.engine.engine import Engine, EngineStats
from common.engine.engine_loop import EngineLoop
from common.engine.profiler import profile_key
from common.errors import (
    DrainingError,
    FailedPreconditionError,
    NotFoundError,
    RoleChangedError,
)
from common.index.profiles import ProfileStore
from common.index.registry import WorkerInfo
from common.kv.hashing import hash_prompt_blocks
from common.kv.layout import KvLayout
from common.kv.leases import LeaseTable
from common.planner.profile import ProfileKey, WorkerProfile
from common.planner.profile_files import load_profile, save_profile
from common.planner.types import DECODE
from common.rpc.channels import ChannelPool
from common.rpc.roles import ROLE_PB
from common.telemetry.tracing import tracer
from pdserve.common.v1 import common_pb2
from services.worker.config import WorkerConfig
from services.worker.expert_load import ExpertLoadTracker
from services.worker.index_sync import IndexSync
from services.worker.kv_import import KvImporter
from services.worker.metrics import WorkerMetrics
from services.worker.roles import RoleChange, Roles
from services.worker.store_tier import StoreTier

log = logging.getLogger(__name__)

BACKGROUND_GRACE_S = 5.0  # what stop() waits for background bookkeeping
# What a role change waits for the decode calls it ended to send their status.
STREAMS_MOVED_WAIT_S = 10.0
# Most a worker waits for another of its profile key to measure (and its claim lasts).
PROFILE_CLAIM_S = 90.0


class WorkerRuntime:
    def __init__(
        self,
        config: WorkerConfig,
        engine: Engine,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.model = config.served_model_name
        self.loop = EngineLoop(engine, name=f"{config.role}-engine")
        self.roles = Roles(config.role)
        spec = engine.spec
        self.layout = KvLayout(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            engine.block_size,
            engine.runner.kv_cache.dtype,
        )
        assert self.layout.wire_shape == engine.runner.kv_wire_shape, "wire layouts disagree"
        self.tier = engine.runner.device.type
        self.leases = LeaseTable(config.lease_ttl_s, on_release=self._release_engine_blocks)
        self.metrics = WorkerMetrics(metrics_registry or CollectorRegistry(), self.model)
        self.metrics.watch_engine(self.loop, self.leases)
        # MoE models: expert load, read from the engine every interval (publish_expert_load).
        self.expert_load: ExpertLoadTracker | None = None
        if spec.is_moe:
            self.expert_load = ExpertLoadTracker(config.expert_load_window_s)
            self.metrics.watch_expert_load(self.expert_load, config.expert_metrics_per_expert)
        self.channels = ChannelPool(config.tls)
        self.worker_id = ""
        self.address = ""
        self.sync = IndexSync(
            config, self.loop, self.metrics, self.tier, self.expert_load, self.entry
        )
        self.store = StoreTier(config, self.layout, self.metrics, self.in_background)
        self.kv = KvImporter(self)
        self._tasks: list[asyncio.Task[Any]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self.draining = False
        self.num_active_calls = 0  # Prefill / Decode calls admitted and not yet ended
        self.decode_calls: set[str] = set()  # request ids of the Decode calls admitted
        # Decode calls that ended with RoleChangedError (each moves on to another decode
        # worker): what set_role counts as moved, and clears.
        self.moved_by_role: set[str] = set()
        self.held_profile: WorkerProfile | None = None  # measured, or read from Redis
        self.metrics.watch_role(self.roles)

    async def start(self, port: int) -> None:
        self.worker_id = self.config.resolved_worker_id(port)
        self.address = self.config.advertised_address(port)
        self.loop.start()
        if self.config.redis_url:
            await self.sync.connect(self.worker_id)
        await self._take_profile()
        if self.config.redis_url:
            self._tasks.append(asyncio.create_task(self.sync.heartbeat_forever()))
        if self.expert_load is not None:
            self._tasks.append(asyncio.create_task(self.sync.expert_load_forever()))
        self.store.open()
        self._tasks.append(asyncio.create_task(self.leases.run_expiry()))
        log.info("worker %s serving at %s, role %s", self.worker_id, self.address, self.role)

    async def stop(self) -> None:
        self.sync.stop_beating()
        for task in self._tasks:
            task.cancel()
        # Bookkeeping still running (store writes, lease releases retried against a producer
        # that does not answer) gets a few seconds, then is cancelled.
        self.store.hurry()
        if self._background:
            _, late = await asyncio.wait(list(self._background), timeout=BACKGROUND_GRACE_S)
            for task in late:
                task.cancel()
        for task in [*self._tasks, *self._background]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.leases.release_all()
        await self.sync.close()
        await self.store.close()
        await self.channels.close()
        self.loop.stop()

    # -- admission and draining ---------------------------------------------------------------

    @property
    def role(self) -> str:
        return self.roles.role

    @contextlib.contextmanager
    def admit(self, face: str, request_id: str) -> Iterator[None]:
        """Wraps one call of ``face`` (prefill, decode); refuses it while draining or when
        the role takes no such calls."""
        if self.draining:
            raise DrainingError(f"worker {self.worker_id} is draining")
        self.roles.admit(face, self.worker_id)
        self.num_active_calls += 1
        decoding = face == DECODE and request_id not in self.decode_calls
        if decoding:
            self.decode_calls.add(request_id)
        try:
            yield
        except RoleChangedError:
            if decoding:
                self.moved_by_role.add(request_id)
            raise
        finally:
            self.num_active_calls -= 1
            if decoding:
                self.decode_calls.discard(request_id)

    async def set_role(self, role: str) -> RoleChange:
        """Changes the role in place (services/worker/roles.py). Leaving the decode role
        ends the streams decoding here with ROLE_CHANGED (their gateways continue them on
        other decode workers) and waits for their calls to end; the new role is registered
        before this returns."""
        started = time.monotonic()
        if self.draining:
            raise FailedPreconditionError(
                f"worker {self.worker_id} is draining; its role no longer changes"
            )
        with tracer().start_as_current_span("role_change") as span:
            previous = self.roles.begin(role, self.worker_id)
            # Taken now: from here on each of these streams ends at its next output. (One whose
            # last message went out just before is in this list but ends without moving: the
            # count below is of the calls that ended with RoleChangedError.)
            moved = sorted(self.decode_calls) if not self.roles.serves(DECODE) else []
            self.moved_by_role.clear()
            try:
                if previous != role:
                    self.metrics.role_changed(previous, role)
                    # Registered first: a gateway that reads the registry to place a moved
                    # stream sees the new role, not this worker as a decode worker.
                    await self._register_now()
                if moved:
                    self.loop.fail(
                        moved,
                        RoleChangedError(
                            f"worker {self.worker_id} changed its role from {previous} to "
                            f"{role}; the stream continues on another decode worker"
                        ),
                    )
                    await self._wait_calls_ended(moved, STREAMS_MOVED_WAIT_S)
            finally:
                self.roles.end()
            num_moved = sum(1 for r in moved if r in self.moved_by_role)
            self.moved_by_role.clear()
            change = RoleChange(previous, role, num_moved, (time.monotonic() - started) * 1000)
            span.set_attributes(
                {
                    "pdserve.worker_id": self.worker_id,
                    "pdserve.role.previous": previous,
                    "pdserve.role": role,
                    "pdserve.role.streams_moved": change.num_streams_moved,
                }
            )
        log.info(
            "role %s -> %s in %.1f ms (%d decode streams moved on)",
            previous, role, change.elapsed_ms, change.num_streams_moved,
        )  # fmt: skip
        return change

    async def _register_now(self) -> None:
        if self.sync.registry is None:
            return
        try:
            await asyncio.wait_for(self.sync.heartbeat_once(), timeout=2.0)
        except Exception as exc:  # the next heartbeat registers it
            log.warning("could not register the new role at once: %s", exc)

    async def _wait_calls_ended(self, request_ids: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(r in self.decode_calls for r in request_ids):
            if time.monotonic() >= deadline:
                log.warning("decode calls still open %.0f s after the role change", timeout_s)
                return
            await asyncio.sleep(0.01)

    async def begin_drain(self) -> None:
        """No new calls from now on; the registry says so at once (routers skip us)."""
        self.draining = True
        await self._register_now()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no call is in flight and no lease pins exported KV; False if
        ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while self.num_active_calls or len(self.leases):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def end_streams(self) -> None:
        """Ends every request still in the engine with UNAVAILABLE (reason DRAINING), so
        that its caller resumes it elsewhere; their blocks are freed."""
        self.loop.fail_all(
            DrainingError(
                f"worker {self.worker_id} ended its drain grace period; "
                "resume the request elsewhere"
            )
        )

    # -- profile ----------------------------------------------------------------------------

    async def _take_profile(self) -> None:
        """At start, before serving (common/engine/profiler.py): the profile of this key
        from Redis or the local cache, else measured now; then kept in both."""
        mode = self.config.profile
        if mode == "off":
            return
        key = self.profile_key()
        store = ProfileStore(self.sync.redis) if self.sync.redis is not None else None
        profile = None
        if mode == "auto":
            profile = await self._stored_profile(store, key)
        if profile is None:
            profile = await self._measure(key)
            log.info("profile %s measured in %.1f s", key.slug(), profile.measure_ms / 1000)
            save_profile(profile)
        # The speed is the key's; the capacity and bounds are this engine's own.
        engine = self.engine
        self.held_profile = dataclasses.replace(
            profile,
            block_size=engine.block_size,
            num_kv_blocks=engine.runner.num_blocks,
            max_num_seqs=engine.config.max_num_seqs,
            max_num_batched_tokens=engine.config.max_num_batched_tokens,
            max_model_len=engine.max_model_len,
        )
        profile = self.held_profile
        if store is not None:
            try:
                await store.put(profile)
                await store.release(key)
            except Exception as exc:  # the planner waits for the next worker's
                log.warning("could not publish the profile to Redis: %s", exc)

    async def _stored_profile(
        self, store: ProfileStore | None, key: ProfileKey
    ) -> WorkerProfile | None:
        """From Redis, else the local cache. When neither has it and another worker of the
        key is measuring it (its claim in Redis), waits for that one's."""
        if store is None:
            return load_profile(key)
        try:
            profile = await store.get(key) or load_profile(key)
            if profile is not None or await store.claim(key, self.worker_id, PROFILE_CLAIM_S):
                return profile
            log.info("another worker is measuring profile %s; waiting for it", key.slug())
            deadline = time.monotonic() + PROFILE_CLAIM_S
            while time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                if (profile := await store.get(key)) is not None:
                    return profile
        except Exception as exc:  # Redis is advisory: measure here
            log.warning("reading profiles from Redis failed: %s", exc)
        return None

    async def _measure(self, key: ProfileKey) -> WorkerProfile:
        from common.engine.profiler import measure_profile

        return await self.loop.call(lambda engine: measure_profile(engine, key, quick=True))

    async def profile(self, remeasure: bool = False) -> WorkerProfile:
        """The profile held, or measured now on the idle engine (FAILED_PRECONDITION while
        requests run: they would skew it and wait seconds for it)."""
        if remeasure:
            stats = await self.stats()
            if stats.num_running or stats.num_waiting or self.num_active_calls:
                raise FailedPreconditionError(
                    f"worker {self.worker_id} runs {stats.num_running + stats.num_waiting} "
                    "requests; measure an idle worker (set its role elsewhere first)"
                )
            self.held_profile = await self._measure(self.profile_key())
            save_profile(self.held_profile)
            if self.sync.redis is not None:
                await ProfileStore(self.sync.redis).put(self.held_profile)
        if self.held_profile is None:
            raise NotFoundError(f"worker {self.worker_id} holds no profile; remeasure")
        return self.held_profile

    def profile_key(self) -> ProfileKey:
        return profile_key(self.engine, self.model)

    # -- status -----------------------------------------------------------------------------

    async def stats(self) -> EngineStats:
        return await self.loop.call(lambda e: e.stats())

    def status_pb(self, stats: EngineStats) -> common_pb2.WorkerStatus:
        status = common_pb2.WorkerStatus(
            worker_id=self.worker_id,
            role=ROLE_PB[self.role],
            address=self.address,
            model=self.model,
            num_kv_blocks_total=stats.num_kv_blocks_total,
            num_kv_blocks_free=stats.num_kv_blocks_free,
            num_running_requests=stats.num_running,
            num_waiting_requests=stats.num_waiting,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            pid=os.getpid(),
            draining=self.draining,
            weight_format=self.engine.weight_identity or "",
            role_since_unix_ms=self.roles.since_unix_ms,
            num_role_changes=self.roles.num_changes,
        )
        if self.held_profile is not None:
            self.held_profile.to_pb(status.profile)
        return status

    def entry(self, stats: EngineStats) -> WorkerInfo:
        """This worker's registry entry for the engine's figures ``stats``."""
        return WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            address=self.address,
            model=self.model,
            num_kv_blocks_total=stats.num_kv_blocks_total,
            num_kv_blocks_free=stats.num_kv_blocks_free,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_pending_tokens=stats.num_pending_tokens,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            max_model_len=self.engine.max_model_len,
            pid=os.getpid(),
            draining=self.draining,
            weights=self.engine.weight_identity or "",
            metrics_port=self.config.metrics_port,
            role_since_unix_ms=self.roles.since_unix_ms,
        )

    # -- KV bookkeeping -------------------------------------------------------------------------

    def block_hashes(self, token_ids: list[int], cache_salt: str | None) -> list[int]:
        return [
            int(h)
            for h in hash_prompt_blocks(
                token_ids,
                self.engine.block_size,
                cache_salt or None,
                seed=self.engine.config.hash_seed,
                weights=self.engine.weight_identity,
            )
        ]

    def in_background(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Runs bookkeeping that must not delay or fail a request."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _release_engine_blocks(self, request_id: str) -> None:
        await self.loop.call(lambda e: e.release(request_id))
