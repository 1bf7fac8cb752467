"""The open-loop load generator: sends each request at its arrival time, whether or not
earlier ones have finished (at most ``max_concurrency`` in flight, if set), and collects
what every stream looked like.

A request that belongs to a session (a multi-turn conversation) also waits for the
previous turn to finish. Time spent waiting for a concurrency slot or a previous turn is
not part of that request's latencies (as in vLLM: the clock starts when it is sent).
Warm-ups (the first request, repeated) go before the measured run, under a cache salt of
their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from loadtest.arrival import arrival_offsets
from loadtest.backends.base import Backend, RequestOutput, SendOptions
from loadtest.datasets.base import SampleRequest


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    seed: int = 0
    fixed_schedule: bool = True  # send at the dataset's own arrival times when it has them
    request_id_prefix: str = "bench-"
    unique_cache_salt: bool = False  # a salt per request: no request reuses another's KV
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")


@dataclass
class LoadOutcome:
    outputs: list[RequestOutput]
    duration_s: float
    start_time: float  # perf_counter at the start of the measured run
    offsets_s: list[float]  # the scheduled send offsets


def schedule(requests: Sequence[SampleRequest], config: LoadConfig) -> list[float]:
    traced = [r.arrival_s for r in requests]
    if config.fixed_schedule and traced and all(t is not None for t in traced):
        return [float(t) for t in traced]  # type: ignore[arg-type]
    return arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)


def _failed(request: SampleRequest, request_id: str, exc: BaseException) -> RequestOutput:
    now = time.perf_counter()
    return RequestOutput(request_id, request.prompt_len, request.category, error=str(exc),
                         status_code=type(exc).__name__, start_time=now, end_time=now)  # fmt: skip


async def _send(
    backend: Backend, request: SampleRequest, request_id: str, options: SendOptions
) -> RequestOutput:
    try:
        return await backend.send(request, request_id, options)
    except Exception as exc:  # a backend bug must not end the run; it is one failed request
        return _failed(request, request_id, exc)


async def run_load(
    backend: Backend,
    requests: Sequence[SampleRequest],
    options: SendOptions,
    config: LoadConfig,
) -> LoadOutcome:
    if not requests:
        raise ValueError("no requests to send")
    slots: contextlib.AbstractAsyncContextManager[object] = (
        asyncio.Semaphore(config.max_concurrency)
        if config.max_concurrency
        else contextlib.nullcontext()
    )
    run_tag = f"{config.request_id_prefix}{time.time_ns() % 10**9}-"

    def options_for(request_id: str) -> SendOptions:
        if config.unique_cache_salt:
            return SendOptions(options.ignore_eos, options.temperature, f"salt-{request_id}")
        return options

    if config.num_warmups:

        async def warm(i: int) -> RequestOutput:
            async with slots:
                request_id = f"{run_tag}warmup-{i}"
                # Their own salt: a warm-up never leaves KV that a measured request could reuse.
                warmup = SendOptions(options.ignore_eos, options.temperature, f"{run_tag}warmup")
                return await _send(backend, requests[0], request_id, warmup)

        await asyncio.gather(*(warm(i) for i in range(config.num_warmups)))

    offsets = schedule(requests, config)
    progress = tqdm(total=len(requests), disable=config.disable_tqdm, desc="requests")
    finished: dict[str, asyncio.Event] = {}
    start = time.perf_counter()

    async def one(request: SampleRequest, offset: float, after: asyncio.Event | None,
                  done: asyncio.Event) -> RequestOutput:  # fmt: skip
        try:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if after is not None:
                await after.wait()
            request_id = f"{run_tag}{request.request_id}"
            async with slots:
                output = await _send(backend, request, request_id, options_for(request_id))
            progress.update(1)
            return output
        finally:
            done.set()

    tasks = []
    for request, offset in zip(requests, offsets, strict=True):
        after = finished.get(request.session_id) if request.session_id else None
        done = asyncio.Event()
        if request.session_id:
            finished[request.session_id] = done
        tasks.append(asyncio.create_task(one(request, offset, after, done)))
    outputs = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    progress.close()
    return LoadOutcome(outputs, duration, start, offsets)
