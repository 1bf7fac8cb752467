"""The simulated fleet: engine workers in roles, the gateway's routing, KV transfers, prefix
caches, and the changes a plan makes (roles switched in place, workers started and
stopped).

A request's life: routed (``Router``); prefilled on a prefill worker, whose first token is
its TTFT, then its KV moves to the decode worker (``kv_transfer_ms``) and joins the batch;
or prefilled locally by the decode worker. A worker leaving the decode role (switched or
stopped) ends its streams: each continues on another decode worker, which recomputes its
tail after fetching the prompt's KV from the block store (the gateway's migration); what
it had not started is routed again. A role change takes ``switch_s``, a new worker
``startup_s``, before serving; both count as worker-seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.planner.hosting import Hosting
from common.planner.profile import WorkerProfile
from common.planner.types import DECODE, PREFILL, Split
from loadtest.plan_sim.events import EventLoop
from loadtest.plan_sim.observe import WindowRecorder
from loadtest.plan_sim.prefix import PrefixIndex
from loadtest.plan_sim.routing import Router
from loadtest.plan_sim.worker import IMPORT, LOCAL, PREFILL_ONLY, RESUME, Host, Job, SimWorker
from loadtest.plan_sim.workload import SimRequest


@dataclass(frozen=True)
class ClusterConfig:
    local_prefill_tokens: int = 16  # services/gateway/config.py's default
    overlap_weight: float = 1.0
    kv_transfer_base_ms: float = 2.0
    kv_transfer_ms_per_token: float = 0.03
    switch_s: float = 5.0
    startup_s: float = 60.0
    hosting: Hosting = field(default_factory=Hosting)
    store_tokens: int = 0  # the block store's capacity; 0: none
    # An engine refuses a request while this many wait (common/engine/config.py's
    # max_waiting: RESOURCE_EXHAUSTED, every queue bounded); the request fails.
    max_waiting: int = 512
    seed: int = 0


class Request:
    __slots__ = ("finish_s", "first_s", "migrations", "rejected", "spec")

    def __init__(self, spec: SimRequest) -> None:
        self.spec = spec
        self.first_s = -1.0
        self.finish_s = -1.0
        self.migrations = 0
        self.rejected = False


@dataclass
class WorkerRecord:
    worker: SimWorker
    role: str  # the role it holds or is switching to
    started_s: float
    stopped_s: float = -1.0
    ready_s: float = 0.0  # serving from then on
    last_change_s: float = 0.0


class Cluster:
    def __init__(
        self, profile: WorkerProfile, config: ClusterConfig, block_tokens: int, loop: EventLoop
    ) -> None:
        self.profile = profile
        self.config = config
        self.block_tokens = block_tokens
        self.loop = loop
        capacity_blocks = profile.kv_capacity_tokens // block_tokens
        self.index = PrefixIndex(config.store_tokens // block_tokens)
        self._pool_blocks = capacity_blocks
        self.router = Router(
            self.index, block_tokens, config.local_prefill_tokens, config.overlap_weight,
            config.seed,
        )  # fmt: skip
        self.records: dict[int, WorkerRecord] = {}
        self._hosts: list[Host] = []
        self._parked: list[tuple[Request, int]] = []  # (request, tokens generated): no decode
        self.recorder = WindowRecorder(0.0)
        self.num_role_changes = 0

    # -- workers --------------------------------------------------------------------------------

    def _host(self) -> Host:
        per_host = self.config.hosting.workers_per_host
        for host in self._hosts:
            if len(host.workers) < per_host:
                return host
        host = Host(self.config.hosting)
        self._hosts.append(host)
        return host

    def add_worker(self, role: str, ready_s: float) -> WorkerRecord:
        wid = len(self.records)
        worker = SimWorker(
            wid, self.profile, self._host(), self.loop,
            on_first_token=self._first_token, on_prefilled=self._prefilled,
            on_finished=self._finished, on_load=self.router.load_changed,
        )  # fmt: skip
        self.index.add_worker(wid, self._pool_blocks)
        record = WorkerRecord(worker, role, self.loop.now, ready_s=ready_s)
        self.records[wid] = record
        self.loop.at(ready_s, self._ready, wid)
        return record

    def _ready(self, wid: int) -> None:
        record = self.records[wid]
        if record.stopped_s >= 0 or record.ready_s > self.loop.now + 1e-9:
            return  # stopped, or switched again before it was ready
        self.router.serve(record.worker, record.role)
        if record.role == DECODE and self._parked:
            parked, self._parked = self._parked, []
            for request, generated in parked:
                self._resume(request, generated)

    def live(self) -> list[WorkerRecord]:
        return [r for r in self.records.values() if r.stopped_s < 0]

    def split(self) -> Split:
        """The split the fleet is becoming (workers starting or switching count in their new
        role)."""
        live = self.live()
        prefill = sum(1 for r in live if r.role == PREFILL)
        return Split(prefill, max(len(live) - prefill, 1))

    def worker_seconds(self, end_s: float) -> float:
        return sum(
            (min(r.stopped_s, end_s) if r.stopped_s >= 0 else end_s) - min(r.started_s, end_s)
            for r in self.records.values()
        )

    def num_waiting(self) -> int:
        return sum(len(r.worker.waiting) for r in self.live()) + len(self._parked)

    # -- a plan -----------------------------------------------------------------------------

    def apply(self, target: Split) -> None:
        """Becomes ``target``: role switches first (no start-up), then starts or stops."""
        now = self.loop.now
        live = self.live()
        by_role = {PREFILL: [r for r in live if r.role == PREFILL],
                   DECODE: [r for r in live if r.role == DECODE]}  # fmt: skip
        want = {PREFILL: target.prefill, DECODE: target.decode}
        for role, other in ((PREFILL, DECODE), (DECODE, PREFILL)):
            spare = len(by_role[other]) - want[other]
            short = want[role] - len(by_role[role])
            for record in self._cheapest(by_role[other], min(spare, short)):
                self._switch(record, role, now)
                by_role[other].remove(record)
                by_role[role].append(record)
        for role in (PREFILL, DECODE):
            for _ in range(want[role] - len(by_role[role])):
                self.add_worker(role, now + self.config.startup_s)
            for record in self._cheapest(by_role[role], len(by_role[role]) - want[role]):
                self._stop(record, now)

    def _cheapest(self, records: list[WorkerRecord], n: int) -> list[WorkerRecord]:
        """The ``n`` workers whose leaving costs least: not yet serving first, then the
        least loaded, then the longest in their role."""
        if n <= 0:
            return []
        now = self.loop.now

        def cost(r: WorkerRecord) -> tuple[int, int, float]:
            w = r.worker
            return (int(r.ready_s <= now), w.num_requests + w.pending_tokens, r.last_change_s)

        return sorted(records, key=cost)[:n]

    def _switch(self, record: WorkerRecord, role: str, now: float) -> None:
        self.num_role_changes += 1
        record.role = role
        record.last_change_s = now
        record.ready_s = now + self.config.switch_s
        self._leave(record)
        self.loop.at(record.ready_s, self._ready, record.worker.worker_id)

    def _stop(self, record: WorkerRecord, now: float) -> None:
        record.stopped_s = now
        self._leave(record)
        self.index.drop_worker(record.worker.worker_id)
        record.worker.host.workers.remove(record.worker)  # its cores go to the next start

    def _leave(self, record: WorkerRecord) -> None:
        self.router.withdraw(record.worker)
        rows, jobs = record.worker.evict()
        for job, generated in rows:
            self._resume(job.req, generated)
        for job in jobs:
            request = job.req
            if job.kind == RESUME:
                self._resume(request, job.gen0 - 1)
            elif job.kind == IMPORT:  # its KV is in this pool, waiting for a place
                self._resume(request, 1)
            else:
                self.route(request)

    # -- a request's life -------------------------------------------------------------------

    def arrive(self, spec: SimRequest) -> Request:
        request = Request(spec)
        self.route(request, fresh=True)
        return request

    def route(self, request: Request, fresh: bool = False) -> None:
        spec = request.spec
        route = self.router.choose(spec.prompt_tokens, spec.blocks, max(spec.cached_tokens, 0))
        if route is None:
            self._parked.append((request, 0))
            if fresh:
                self.recorder.routed(spec.prompt_tokens, 0)
            return
        target = route.prefill or route.decode
        cached, fetch_ms = self._cached(target, spec)
        if fresh:
            self.recorder.routed(spec.prompt_tokens, cached)
        kv_need = spec.prompt_tokens + spec.output_tokens
        if kv_need > self.profile.kv_capacity_tokens:
            request.rejected = True
            return
        if route.prefill is None:
            job = Job(request, LOCAL, spec.prompt_tokens, cached, kv_need, 1)
            self._enqueue(route.decode, job, fetch_ms)
            return
        job = Job(request, PREFILL_ONLY, spec.prompt_tokens, cached, spec.prompt_tokens, 1)
        job.target = route.decode.worker_id
        self._enqueue(route.prefill, job, fetch_ms)

    def _cached(self, worker: SimWorker, spec: SimRequest) -> tuple[int, float]:
        """Prompt tokens ``worker`` finds cached (its pool or the block store), and the
        time to fetch what the block store adds."""
        if spec.cached_tokens >= 0:
            return min(spec.cached_tokens, spec.prompt_tokens - 1), 0.0
        if not spec.blocks:
            return 0, 0.0
        bt = self.block_tokens
        own = self.index.depth(worker.worker_id, spec.blocks) * bt
        stored = self.index.store_depth(spec.blocks) * bt if self.index.store_blocks else 0
        cached = min(max(own, stored), spec.prompt_tokens - 1)
        return cached, self._transfer_ms(max(cached - own, 0)) if cached > own else 0.0

    def _transfer_ms(self, tokens: int) -> float:
        c = self.config
        return c.kv_transfer_base_ms + c.kv_transfer_ms_per_token * tokens

    def _admit(self, worker: SimWorker, job: Job) -> None:
        if len(worker.waiting) >= self.config.max_waiting:
            job.req.rejected = True
            return
        worker.enqueue(job)

    def _enqueue(self, worker: SimWorker, job: Job, delay_ms: float) -> None:
        if delay_ms <= 0:
            self._admit(worker, job)
            return
        worker.inbound += 1
        self.loop.at(self.loop.now + delay_ms / 1000, self._fetched, (worker, job))

    def _fetched(self, arg: tuple[SimWorker, Job]) -> None:
        worker, job = arg
        worker.inbound -= 1
        request = job.req
        record = self.records[worker.worker_id]
        role = PREFILL if job.kind == PREFILL_ONLY else DECODE
        if record.stopped_s >= 0 or record.role != role or record.ready_s > self.loop.now:
            if job.kind == RESUME:
                self._resume(request, job.gen0 - 1)
            else:
                self.route(request)
            return
        self._admit(worker, job)

    def _full_blocks(self, spec: SimRequest) -> tuple[int, ...]:
        return spec.blocks[: spec.prompt_tokens // self.block_tokens]

    def _first_token(self, worker: SimWorker, job: Job, now: float) -> None:
        request = job.req
        if job.kind == LOCAL and request.spec.blocks:
            self.index.insert(worker.worker_id, self._full_blocks(request.spec))
        if request.first_s < 0:
            request.first_s = now
            self.recorder.first_token((now - request.spec.arrival_s) * 1000)

    def _prefilled(self, worker: SimWorker, job: Job) -> None:
        """A prefill worker's job is done: the first token goes out, the KV moves."""
        request = job.req
        spec = request.spec
        self._first_token(worker, job, self.loop.now)
        if spec.blocks:
            self.index.insert(worker.worker_id, self._full_blocks(spec))
        if spec.output_tokens <= 1:
            self._done(request)
            return
        decode = self.records[job.target].worker
        decode.inbound += 1
        self.router.load_changed(decode)
        delay = self._transfer_ms(spec.prompt_tokens) / 1000
        self.loop.at(self.loop.now + delay, self._transferred, (request, decode))

    def _transferred(self, arg: tuple[Request, SimWorker]) -> None:
        request, decode = arg
        decode.inbound -= 1
        record = self.records[decode.worker_id]
        spec = request.spec
        if record.stopped_s >= 0 or record.role != DECODE or record.ready_s > self.loop.now:
            self.router.load_changed(decode)
            self._resume(request, 1)
            return
        if spec.blocks:
            self.index.insert(decode.worker_id, self._full_blocks(spec))
        kv = spec.prompt_tokens + spec.output_tokens
        self._admit(decode, Job(request, IMPORT, spec.prompt_tokens, spec.prompt_tokens, kv, 1))

    def _resume(self, request: Request, generated: int) -> None:
        """The stream continues on another decode worker: the prompt's KV from the block
        store, the ``generated`` tokens recomputed."""
        spec = request.spec
        decode = self.router.least_decode()
        if decode is None:
            self._parked.append((request, generated))
            return
        if generated == 0:  # parked before it was routed at all
            self.route(request)
            return
        request.migrations += 1
        kv = spec.prompt_tokens + spec.output_tokens
        job = Job(request, RESUME, spec.prompt_tokens + generated, spec.prompt_tokens, kv,
                  generated + 1)  # fmt: skip
        if job.gen0 > spec.output_tokens:
            self._done(request)
            return
        self._enqueue(decode, job, self._transfer_ms(spec.prompt_tokens))

    def _finished(self, worker: SimWorker, job: Job) -> None:
        self._done(job.req)

    def _done(self, request: Request) -> None:
        request.finish_s = self.loop.now
        output = request.spec.output_tokens
        if output > 1 and request.first_s >= 0:
            itl_ms = (request.finish_s - request.first_s) * 1000 / (output - 1)
        else:
            itl_ms = 0.0
        self.recorder.finished(output, itl_ms)
