"""The two pools a split prices: the prefill workers (an M/G/c queue) and the decode workers
(continuous batching, with the prompts they prefill themselves riding in their steps).

Requests are priced by class: each point of the prompt-length distribution (index i) and
of the output-length distribution (index j), assumed independent. Arrays:
# I = prompt classes, J = output classes
Times are ms, rates are per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from common.planner.forecast import LoadForecast
from common.planner.profile import WorkerProfile
from common.planner.queueing import Wait, erlang_b, mgc_wait

# The model prices at most this many points of each length distribution.
MAX_CLASSES = 16


@dataclass(frozen=True)
class Correction:
    """Multipliers on the profile's times, learnt from what the split in force did
    (``feedback.py``): 1.0 trusts the profile."""

    prefill: float = 1.0
    decode: float = 1.0


@dataclass(frozen=True)
class LoadClasses:
    """A forecast as the arrays the pools price."""

    arrival_rate: float  # with the backlog spread over the time to drain it
    prompt: np.ndarray  # [I] tokens
    prompt_weight: np.ndarray  # [I] sums to 1
    cached: np.ndarray  # [I] prompt tokens served from a prefix cache
    uncached: np.ndarray  # [I]
    prefill_ms: np.ndarray  # [I] the whole prefill on an idle worker
    transfer_ms: np.ndarray  # [I] the prompt's KV from the prefill to the decode worker
    decode_steps: np.ndarray  # [J] tokens after the first
    output_weight: np.ndarray  # [J] sums to 1
    context_tokens: float  # a decoding row's context, averaged over decode steps
    kv_tokens_per_row: float  # KV a running row holds (its prompt and all its output)

    @classmethod
    def of(
        cls,
        load: LoadForecast,
        profile: WorkerProfile,
        *,
        backlog_drain_s: float,
        kv_transfer_base_ms: float,
        kv_transfer_ms_per_token: float,
    ) -> LoadClasses:
        prompts = load.prompt_tokens.compact(MAX_CLASSES)
        outputs = load.output_tokens.compact(MAX_CLASSES)
        prompt = np.maximum(np.asarray(prompts.values, dtype=float), 1.0)
        pw = np.asarray(prompts.weights, dtype=float)
        pw = pw / pw.sum()
        output = np.maximum(np.asarray(outputs.values, dtype=float), 1.0)
        ow = np.asarray(outputs.weights, dtype=float)
        ow = ow / ow.sum()
        hit = min(max(load.prefix_hit_rate, 0.0), 1.0)
        cached = np.minimum(prompt * hit, prompt - 1)
        prefill = np.array([profile.prefill_ms(p, c) for p, c in zip(prompt, cached, strict=True)])
        steps = output - 1
        mean_steps = float(ow @ steps)
        mean_prompt = float(pw @ prompt)
        if mean_steps > 0:
            context = mean_prompt + float(ow @ (steps * (steps + 1))) / (2 * mean_steps)
            kv_per_row = mean_prompt + float(ow @ (steps * output)) / mean_steps
        else:
            context, kv_per_row = mean_prompt, mean_prompt + 1
        return cls(
            arrival_rate=load.arrival_rate + load.backlog / backlog_drain_s,
            prompt=prompt,
            prompt_weight=pw,
            cached=cached,
            uncached=prompt - cached,
            prefill_ms=prefill,
            transfer_ms=kv_transfer_base_ms + kv_transfer_ms_per_token * prompt,
            decode_steps=steps,
            output_weight=ow,
            context_tokens=context,
            kv_tokens_per_row=kv_per_row,
        )

    def local_mask(self, colocated: bool, local_prefill_tokens: int) -> np.ndarray:
        """[I] True where the decode worker prefills the prompt itself (the gateway's
        conditional disaggregation: what is left after the cached prefix is short)."""
        if colocated:
            return np.ones_like(self.prompt, dtype=bool)
        return self.uncached < local_prefill_tokens


@dataclass(frozen=True)
class PrefillPool:
    """``servers`` prefill workers serving the prompts not prefilled locally.

    A step reads the weights once for every prompt in it, so under load short prompts
    share the prefill's base cost: a prompt's service is its marginal time plus the base
    over the prompts per step (the queue's length, up to what the token budget holds),
    found with the queue it produces."""

    wait: Wait
    service_ms: np.ndarray  # [I] (classes prefilled locally included, unused)
    utilization: float  # per worker; >= 1 is overload

    @classmethod
    def price(
        cls,
        load: LoadClasses,
        remote: np.ndarray,  # [I] bool
        servers: int,
        profile: WorkerProfile,
        speed: float,
        correction: Correction,
        horizon_s: float,
    ) -> PrefillPool:
        full = load.prefill_ms * correction.prefill / speed
        share = float(load.prompt_weight @ remote)
        if servers == 0 or share <= 0:
            return cls(Wait(), full, 0.0)
        base = min(profile.prefill_fit.base_ms * correction.prefill / speed, float(full.min()))
        marginal = full - base
        w = load.prompt_weight * remote / share
        rate = load.arrival_rate * share
        most_per_step = max(1.0, profile.max_num_batched_tokens / float(w @ load.uncached))

        def queue(per_step: float) -> tuple[Wait, float]:
            service = marginal + base / per_step
            mean = float(w @ service)
            scv = max(float(w @ service**2) / mean**2 - 1, 0.0)
            return mgc_wait(rate, mean, scv, servers, horizon_s)

        def excess(per_step: float) -> float:
            """Prompts per step the queue supplies, less ``per_step`` (falls with it)."""
            wait, _ = queue(per_step)
            return 1 + rate * wait.mean_ms / 1000 / servers - per_step

        lo, hi = 1.0, most_per_step
        if excess(hi) >= 0:
            lo = hi
        elif excess(lo) > 0:
            for _ in range(30):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
        per_step = lo
        wait, rho = queue(per_step)
        # A prompt's own step(s) also compute the others batched with it.
        own = full + (per_step - 1) * float(w @ marginal)
        return cls(wait, own, rho)


@dataclass(frozen=True)
class DecodePool:
    """One of ``workers`` decode workers (the load is spread evenly by the router).

    ``step_ms`` is a decode step of the batch a request finds (itself and ``batch`` others).
    Other requests' prompts prefilled on the same worker ride in its steps as chunks of
    ``chunk_ms``: a stream absorbs those that arrive from the moment it is there (its own
    prefill, or its KV transfer) to its last token, at ``foreign_chunks_per_s``; each adds
    ``chunk_ms`` to one of its steps. This interference is what makes disaggregation pay.

    The router sends a request to the worker with the fewest: while some worker is idle a
    new prompt goes there, so it neither queues behind another prompt nor lands its chunks
    in another's stream. Both happen only when every other worker holds a request. The
    busy workers are an Erlang loss system: a request takes an idle worker if there is one
    and holds it for its time in the system; when none is idle it joins a busy one without
    taking another. So ``others_busy`` is Erlang B over the other workers (within a few
    points of the simulator's share of requests landing on a busy worker, at 0.7 to 1.6
    requests per worker).
    """

    batch: float  # mean running rows an arriving request finds
    max_batch: float  # max_num_seqs or what the KV pool holds, whichever is fewer
    step_ms: float
    interval_ms: float  # a stream's mean time per token, chunks included
    chunk_ms: float
    foreign_chunks_per_s: float
    exposure_ms: float  # before its first decode step, a stream already takes chunks
    prefill_busy: float  # share of the worker's time spent on local prefill chunks
    local_wait: Wait  # before a local prefill's first chunk
    local_ttft_ms: np.ndarray  # [I] a local prefill's time to first token after its wait
    admission_ms: float  # overload: a request waits this long for a place in the batch
    saturated: str  # "" or what runs out: "decode steps", "max_num_seqs", "KV", "prefill"
    load: float  # demand over capacity (tokens, or local prefill time): >= 1 is overload

    @property
    def busy(self) -> float:
        """Share of time the worker computes (its host mates slow down meanwhile)."""
        decoding = 1 - math.exp(-self.batch) if self.batch > 0 else 0.0
        return min(1.0, self.prefill_busy + (1 - self.prefill_busy) * decoding)

    def chunk_share(self, steps: float) -> float:
        """The share of a stream's ``steps`` decode steps that carry a foreign chunk."""
        if steps < 1 or self.chunk_ms <= 0:
            return 0.0
        chunks = self.foreign_chunks_per_s * (self.exposure_ms + steps * self.interval_ms) / 1000
        return min(1.0, chunks / steps)

    @classmethod
    def price(
        cls,
        load: LoadClasses,
        local: np.ndarray,  # [I] bool
        workers: int,
        profile: WorkerProfile,
        speed: float,
        correction: Correction,
        *,
        horizon_s: float,
        kv_headroom: float,
    ) -> DecodePool:
        rate = load.arrival_rate / workers
        fit = profile.decode_fit
        scale = correction.decode / speed
        # A step of n rows: a + b * n.
        a = fit.base_ms * scale
        b = (fit.per_sequence_ms + fit.per_context_token_ms * load.context_tokens) * scale
        mean_steps = max(float(load.output_weight @ load.decode_steps), 1e-9)
        kv_rows = kv_headroom * profile.kv_capacity_tokens / max(load.kv_tokens_per_row, 1.0)
        max_batch = float(max(1.0, min(profile.max_num_seqs, kv_rows)))
        limit = "max_num_seqs" if profile.max_num_seqs <= kv_rows else "KV"

        # A chunk riding a decode step costs its marginal time; the step carrying a prompt's
        # first chunk costs at least the prefill's base (the larger base, not both).
        full = load.prefill_ms * correction.prefill / speed
        prefill_base = min(
            profile.prefill_fit.base_ms * correction.prefill / speed, float(full.min())
        )
        riding = full - min(prefill_base, a)
        lw = load.prompt_weight * local
        budget = profile.max_num_batched_tokens

        batch, others_busy, interval = 0.0, 1.0, a + b
        for _ in range(5):  # rows, chunk budget, idle workers and step interval settle
            idle = math.exp(-batch)
            chunk_cost = idle * full + (1 - idle) * riding  # [I]
            chunks = np.ceil(load.uncached / max(budget - batch, budget / 2))  # [I]
            mean_chunks = float(lw @ chunks)
            chunk_ms = float(lw @ chunk_cost) / mean_chunks if mean_chunks > 0 else 0.0
            foreign = others_busy * rate * mean_chunks  # chunks/s landing in a stream's steps
            exposure = float(load.prompt_weight @ np.where(local, chunk_cost, load.transfer_ms))
            seen = min(foreign * chunk_ms / 1000, 0.95)  # share of a stream's time in them
            k = rate * mean_steps / 1000
            step_interval = a + b  # (1 + rows) rows, rows from Little's law below
            # Little: rows = rate x steps x interval, interval = (step + seen x exposure /
            # steps) / (1 - seen), the step growing with the rows.
            lead = seen * exposure / mean_steps
            kb = k * b / (1 - seen)
            batch = k * (step_interval + lead) / (1 - seen) / (1 - kb) if kb < 1 else math.inf
            batch = min(batch, max_batch - 1)
            step = a + b * (1 + batch)
            interval = (step + lead) / (1 - seen)
            per_worker = rate * (float(lw @ chunk_cost) + mean_steps * interval) / 1000
            others_busy = _others_busy(workers, per_worker)
        prefill_busy = rate * float(lw @ chunk_cost) / 1000
        saturated = ""
        admission = 0.0
        demand = rate * mean_steps  # tokens/s the rows must produce
        capacity = max_batch / interval * 1000
        if demand > capacity * (1 - 1e-9) and float(load.output_weight @ load.decode_steps) > 0:
            saturated = "decode steps" if kb >= 1 else limit
            admission = (demand / capacity - 1) / (demand / capacity) * horizon_s * 1000 / 2
        if prefill_busy >= 0.98:
            saturated = saturated or "prefill"
        local_wait = _local_wait(
            lw, chunk_cost + step * load.uncached / max(budget - batch, budget / 2),
            rate, workers, per_worker, horizon_s,
        )  # fmt: skip
        return cls(
            batch=batch,
            max_batch=max_batch,
            step_ms=step,
            interval_ms=interval,
            chunk_ms=chunk_ms,
            foreign_chunks_per_s=foreign,
            exposure_ms=exposure,
            prefill_busy=min(prefill_busy, 1.0),
            local_wait=Wait(
                local_wait.p_wait, local_wait.mean_if_waiting_ms, local_wait.fixed_ms + admission
            ),
            # On an idle worker a prompt's first step is its own; on a busy one it waits for
            # the step in progress, then rides in steps with the rows.
            local_ttft_ms=idle * full + (1 - idle) * (step / 2 + riding + chunks * step),
            admission_ms=admission,
            saturated=saturated,
            load=max(demand / capacity if capacity > 0 else 0.0, prefill_busy),
        )


def _others_busy(workers: int, per_worker: float) -> float:
    """P(every other worker holds a request) for ``per_worker`` requests per worker on
    average (1 for a lone worker)."""
    return erlang_b(workers - 1, per_worker * (workers - 1))


def _local_wait(
    lw: np.ndarray,  # [I] weight of locally prefilled prompt classes
    occupancy: np.ndarray,  # [I] a local prompt's hold on its worker (chunks and steps)
    rate: float,
    workers: int,
    per_worker: float,
    horizon_s: float,
) -> Wait:
    """A local prompt's wait for the prompts ahead of it on its worker (one server): only
    when no worker is idle, and then when its worker is prefilling, the share of busy time
    prefill takes."""
    share = float(lw.sum())
    if share <= 0:
        return Wait()
    w = lw / share
    mean = float(w @ occupancy)
    scv = max(float(w @ occupancy**2) / mean**2 - 1, 0.0) if mean > 0 else 0.0
    wait, rho = mgc_wait(rate * share, mean, scv, 1, horizon_s)
    all_busy = erlang_b(workers, per_worker * workers)
    prefilling = min(1.0, rho / min(1.0, max(per_worker, 1e-9)))
    return Wait(min(wait.p_wait, all_busy * prefilling), wait.mean_if_waiting_ms, wait.fixed_ms)
