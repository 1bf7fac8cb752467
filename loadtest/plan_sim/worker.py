"""One simulated engine worker: the engine's scheduler (common/engine/scheduler.py) as a
discrete-event model priced by a WorkerProfile.

Each step: the decode rows (one token each), then the prefill chunks of admitted prompts in
admission order while the token budget (max_num_batched_tokens) lasts; a waiting request
is admitted while max_num_seqs and the KV pool allow (it reserves its whole final length:
no preemption). A step costs the decode fit for its rows (their mean context) plus each
chunk's share of the prefill fit; a step carrying a prompt's first chunk costs at least the
prefill fit's base (the larger of the two bases, not their sum), so one prompt alone takes
exactly ``profile.prefill_ms``.

Steps that carry no chunk and change no row are not simulated one by one: a run of n of
them is one event (the rows' contexts grow by one a step, so n steps cost
``n * A + per_context * rows * n(n-1)/2``), cut short at the next step boundary when a
request arrives that could be admitted. On a host whose cores are shared (``Hosting``) a
step's work runs at the speed of the workers busy on that host, re-timed when that changes.

# b = decode rows, W(n) = work (ms at full speed) of the run's first n steps
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from itertools import count
from typing import TYPE_CHECKING

from common.planner.hosting import Hosting
from common.planner.profile import WorkerProfile

if TYPE_CHECKING:
    from loadtest.plan_sim.cluster import Request
    from loadtest.plan_sim.events import EventLoop

PREFILL_ONLY = 0  # a prefill worker's job: done at the first token
LOCAL = 1  # prefilled by the decode worker that then decodes it
IMPORT = 2  # prefilled elsewhere: joins the batch with its KV
RESUME = 3  # migrated mid-stream: recomputes its tail here, then decodes on


class Job:
    """A request's stay on one worker."""

    __slots__ = (
        "cached", "context", "done", "finish_step", "gen0", "join_step", "kind", "kv", "req",
        "target", "todo",
    )  # fmt: skip

    def __init__(
        self, req: Request, kind: int, context: int, cached: int, kv: int, gen0: int
    ) -> None:
        self.req = req
        self.kind = kind
        self.context = context  # tokens of context once prefilled
        self.cached = cached  # of which served from a prefix cache
        self.todo = 0 if kind == IMPORT else context - cached  # tokens to compute here
        self.done = 0
        self.kv = kv  # KV tokens reserved while here
        self.gen0 = gen0  # tokens generated when it joins the batch
        self.join_step = 0
        self.finish_step = 0
        self.target = -1  # a prefill job's decode worker


class Host:
    """Workers sharing cores: each busy one runs at ``hosting.speed(busy)``."""

    __slots__ = ("busy", "hosting", "workers")

    def __init__(self, hosting: Hosting) -> None:
        self.hosting = hosting
        self.workers: list[SimWorker] = []
        self.busy = 0

    def changed(self, loop: EventLoop, by: SimWorker) -> None:
        speed = self.hosting.speed(self.busy)
        for w in self.workers:
            if w.busy and w is not by:
                w.retime(loop.now, speed)


class SimWorker:
    def __init__(
        self,
        worker_id: int,
        profile: WorkerProfile,
        host: Host,
        loop: EventLoop,
        *,
        on_first_token: Callable[[SimWorker, Job, float], None],
        on_prefilled: Callable[[SimWorker, Job], None],
        on_finished: Callable[[SimWorker, Job], None],
        on_load: Callable[[SimWorker], None],
    ) -> None:
        self.worker_id = worker_id
        self.profile = profile
        self.host = host
        host.workers.append(self)
        self.loop = loop
        self.on_first_token = on_first_token
        self.on_prefilled = on_prefilled
        self.on_finished = on_finished
        self.on_load = on_load
        p, d = profile.prefill_fit, profile.decode_fit
        self._pf = (p.base_ms, p.per_token_ms, p.per_attended_token_ms)
        self._df = (d.base_ms, d.per_sequence_ms, d.per_context_token_ms)
        self.kv_capacity = profile.kv_capacity_tokens
        self.waiting: deque[Job] = deque()
        self.prefilling: deque[Job] = deque()
        self.rows: list[tuple[int, int, Job]] = []  # heap of (finish_step, tiebreak, job)
        self._tiebreak = count()
        self.steps_done = 0
        self.sum_ctx = 0  # context tokens over the rows, at steps_done
        self.kv_used = 0
        self.pending_tokens = 0  # prompt tokens queued or computing (the routers' load)
        self.inbound = 0  # requests on their way here (KV in transfer)
        # The step run in progress.
        self.busy = False
        self._token = 0
        self._n = 0  # steps in the run
        self._b = 0
        self._a = 0.0  # W(n) = a * n + c * n * (n - 1)
        self._c = 0.0
        self._chunks: list[tuple[Job, int]] = []
        self._start_s = 0.0
        self._mark_s = 0.0  # when _work was last brought up to date
        self._work = 0.0
        self._speed = 1.0

    # -- what the router reads --------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        """Running rows and prompts, waiting ones and those on their way (decode load)."""
        return len(self.rows) + len(self.prefilling) + len(self.waiting) + self.inbound

    @property
    def kv_free(self) -> int:
        return self.kv_capacity - self.kv_used

    # -- work arriving ----------------------------------------------------------------------

    def enqueue(self, job: Job) -> None:
        self.waiting.append(job)
        self.pending_tokens += job.todo
        self.on_load(self)
        if not self.busy:
            self._next_run()
        elif self._n > 1 and self._can_admit(job):
            self._cut()

    def _can_admit(self, job: Job) -> bool:
        return (
            len(self.rows) + len(self.prefilling) < self.profile.max_num_seqs
            and self.kv_used + job.kv <= self.kv_capacity
        )

    # -- runs of steps ----------------------------------------------------------------------

    def _next_run(self) -> None:
        self._admit()
        b = len(self.rows)
        base, per_row, per_ctx = self._df
        decode_ms = base + per_row * b + per_ctx * self.sum_ctx if b else 0.0
        chunks: list[tuple[Job, int]] = []
        budget = self.profile.max_num_batched_tokens - b
        chunk_ms = 0.0
        first_chunk = False
        for job in self.prefilling:
            if budget <= 0:
                break
            take = min(job.todo - job.done, budget)
            chunks.append((job, take))
            chunk_ms += self._chunk_ms(job, take)
            first_chunk = first_chunk or job.done == 0
            budget -= take
        if chunks:
            if first_chunk:  # a prompt's first chunk pays the prefill's base, rows or not
                chunk_ms += self._pf[0] - (min(self._pf[0], base) if b else 0.0)
            self._start(1, b, decode_ms + chunk_ms, 0.0, chunks)
        elif b:
            n = self.rows[0][0] - self.steps_done
            assert n >= 1, f"worker {self.worker_id}: a row finishing at step {self.rows[0][0]}"
            self._start(n, b, decode_ms, per_ctx * b / 2, chunks)
        else:
            self._set_busy(False)

    def _admit(self) -> None:
        while self.waiting:
            job = self.waiting[0]
            if not self._can_admit(job):
                if self.kv_used == 0 and not self.rows and not self.prefilling:
                    raise AssertionError(f"job of {job.kv} KV tokens admitted nowhere")
                return
            self.waiting.popleft()
            self.kv_used += job.kv
            if job.kind == IMPORT:
                self._join(job)
            else:
                self.prefilling.append(job)

    def _chunk_ms(self, job: Job, take: int) -> float:
        """The prefill fit's share for tokens [done, done + take) of the job (its base
        apart): the whole prompt's chunks add up to its prefill time."""
        _, per_token, per_pair = self._pf
        c, lo, hi = job.cached, job.done, job.done + take
        return per_token * take + per_pair * (hi * (c + hi / 2) - lo * (c + lo / 2))

    def _start(self, n: int, b: int, a: float, c: float, chunks: list[tuple[Job, int]]) -> None:
        self._n, self._b, self._a, self._c, self._chunks = n, b, a, c, chunks
        now = self.loop.now
        self._start_s = self._mark_s = now
        self._work = 0.0
        self._set_busy(True)
        self._schedule()

    def _run_work(self, n: int) -> float:
        return self._a * n + self._c * n * (n - 1)

    def _schedule(self) -> None:
        self._token += 1
        remaining_ms = self._run_work(self._n) - self._work
        self.loop.at(self._mark_s + remaining_ms / self._speed / 1000, self._ended, self._token)

    def _steps_by(self, now: float) -> int:
        """Steps of the run finished by ``now``."""
        work = self._work + (now - self._mark_s) * 1000 * self._speed
        a, c = self._a, self._c
        if c > 0:  # c n^2 + (a - c) n <= work
            n = int((-(a - c) + math.sqrt((a - c) ** 2 + 4 * c * work)) / (2 * c))
        else:
            n = int(work / a) if a > 0 else self._n
        while n > 0 and self._run_work(n) > work * (1 + 1e-12):
            n -= 1
        return min(n, self._n)

    def _cut(self) -> None:
        """End the run at the boundary of the step in progress."""
        boundary = self._steps_by(self.loop.now) + 1
        if boundary < self._n:
            self._work += (self.loop.now - self._mark_s) * 1000 * self._speed
            self._mark_s = self.loop.now
            self._n = boundary
            self._schedule()

    def retime(self, now: float, speed: float) -> None:
        """The host's speed changed under the run in progress."""
        self._work += (now - self._mark_s) * 1000 * self._speed
        self._mark_s = now
        self._speed = speed
        self._schedule()

    def _set_busy(self, busy: bool) -> None:
        if busy == self.busy:
            return
        self.busy = busy
        host = self.host
        host.busy += 1 if busy else -1
        if host.hosting.shared:
            self._speed = host.hosting.speed(host.busy)
            host.changed(self.loop, self)

    # -- a run's end --------------------------------------------------------------------------

    def _ended(self, token: int) -> None:
        if token != self._token:
            return  # re-timed, cut or evicted since
        now = self.loop.now
        n, b = self._n, self._b
        self.steps_done += n
        self.sum_ctx += b * n
        for job, take in self._chunks:
            job.done += take
            if job.done >= job.todo:
                self._prefilled(job, now)
        while self.rows and self.rows[0][0] <= self.steps_done:
            _, _, job = heapq.heappop(self.rows)
            self._leave(job)
            self.on_finished(self, job)
        self._next_run()

    def _prefilled(self, job: Job, now: float) -> None:
        self.prefilling.remove(job)
        self.pending_tokens -= job.todo
        if job.kind == PREFILL_ONLY:
            self.kv_used -= job.kv
            self.on_load(self)
            self.on_prefilled(self, job)
            return
        if job.kind == LOCAL:
            self.on_first_token(self, job, now)
        if self._remaining(job) > 0:
            self._join(job)
        else:
            self.kv_used -= job.kv
            self.on_finished(self, job)
        self.on_load(self)

    def _remaining(self, job: Job) -> int:
        return job.req.spec.output_tokens - job.gen0

    def _join(self, job: Job) -> None:
        job.join_step = self.steps_done
        job.finish_step = self.steps_done + self._remaining(job)
        self.sum_ctx += job.context
        heapq.heappush(self.rows, (job.finish_step, next(self._tiebreak), job))

    def _leave(self, job: Job) -> None:
        self.sum_ctx -= job.context + (self.steps_done - job.join_step)
        self.kv_used -= job.kv
        self.on_load(self)

    # -- leaving a role -----------------------------------------------------------------------

    def evict(self) -> tuple[list[tuple[Job, int]], list[Job]]:
        """Everything here stops now: the decode rows with the tokens each has generated,
        and the jobs not yet decoding (to be routed again from the start)."""
        done_now = self.steps_done + (self._steps_by(self.loop.now) if self.busy and self._b else 0)
        rows = [(job, job.gen0 + done_now - job.join_step) for _, _, job in self.rows]
        jobs = [*self.prefilling, *self.waiting]
        self.rows.clear()
        self.prefilling.clear()
        self.waiting.clear()
        self.sum_ctx = self.kv_used = self.pending_tokens = 0
        self._token += 1
        self._set_busy(False)
        self.on_load(self)
        return rows, jobs
