"""Workloads the simulator replays: the Mooncake trace scaled to a cluster, and synthetic
load shifts and rate steps.

A request's prompt is a sequence of prefix blocks (``blocks``: ids, ``block_tokens``
tokens each, the last one partial); two requests with the same leading ids share that
prefix, which is what the prefix caches see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loadtest.datasets.mooncake import DEFAULT_TRACE, TRACE_BLOCK_TOKENS, read_trace

# Trace hash ids of one copy of the trace are offset by this times the copy's number (the
# trace's ids are below 200,000), all but the ids that every conversation shares.
COPY_ID_STRIDE = 10_000_000


@dataclass(frozen=True)
class SimRequest:
    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] = ()  # prefix block ids; () shares nothing
    cached_tokens: int = -1  # a recorded run's cached tokens; -1: from the prefix caches
    phase: str = ""


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[SimRequest, ...]
    duration_s: float
    block_tokens: int = 16
    phases: tuple[Phase, ...] = field(default_factory=tuple)

    @property
    def rate(self) -> float:
        return len(self.requests) / self.duration_s


def mooncake(
    *,
    rate_scale: float,
    block_tokens: int = TRACE_BLOCK_TOKENS,
    output_scale: float = 1.0,
    max_tokens: int = 131072,
    duration_s: float | None = None,
    path: Path = DEFAULT_TRACE,
    seed: int = 0,
) -> Workload:
    """The trace at ``rate_scale`` times its rate, over its own hour (or ``duration_s``).

    More load than the trace's comes from overlaying copies of it, each shifted in time by a
    random offset (cyclically, so every copy spans the hour) with its own conversations
    (hash ids), sharing only the system prompt every request starts with; a fractional
    copy keeps a random share of its rows. Lengths scale by ``block_tokens / 512``."""
    rows = list(read_trace(path))
    span_s = max(r.timestamp_ms for r in rows) / 1000 + 1.0
    shared = _ids_in_every_row([r.hash_ids for r in rows])
    rng = np.random.default_rng(seed)
    horizon = duration_s if duration_s is not None else span_s
    requests: list[tuple[float, int, int, tuple[int, ...]]] = []
    for copy in range(math.ceil(rate_scale)):
        keep = min(1.0, rate_scale - copy)
        offset = float(rng.uniform(0, span_s)) if copy else 0.0
        kept = rng.random(len(rows)) < keep
        for row, keep_row in zip(rows, kept, strict=True):
            if not keep_row:
                continue
            at = (row.timestamp_ms / 1000 + offset) % span_s
            if at >= horizon:
                continue
            prompt = max(1, math.ceil(row.input_length * block_tokens / TRACE_BLOCK_TOKENS))
            output = max(1, round(row.output_length * output_scale))
            if prompt + output > max_tokens:
                continue
            blocks = tuple(h if h in shared else h + copy * COPY_ID_STRIDE for h in row.hash_ids)
            requests.append((at, prompt, output, blocks))
    requests.sort()
    return Workload(
        name=f"mooncake x{rate_scale:g}",
        requests=tuple(
            SimRequest(i, at, p, o, blocks) for i, (at, p, o, blocks) in enumerate(requests)
        ),
        duration_s=min(horizon, span_s),
        block_tokens=block_tokens,
    )


def _ids_in_every_row(hash_ids: list[tuple[int, ...]]) -> set[int]:
    common = set(hash_ids[0])
    for ids in hash_ids[1:]:
        common &= set(ids)
    return common


@dataclass(frozen=True)
class PhaseSpec:
    name: str
    prompt_tokens: int
    output_tokens: int
    rate: float  # requests/s
    seconds: float


def phased(name: str, specs: list[PhaseSpec], seed: int = 0) -> Workload:
    """Poisson arrivals, each phase at its rate with its fixed lengths; no prefix shared."""
    rng = np.random.default_rng(seed)
    requests: list[SimRequest] = []
    phases: list[Phase] = []
    start = 0.0
    for spec in specs:
        end = start + spec.seconds
        phases.append(Phase(spec.name, start, end))
        if spec.rate > 0:
            at = start + float(rng.exponential(1 / spec.rate))
            while at < end:
                requests.append(SimRequest(
                    len(requests), at, spec.prompt_tokens, spec.output_tokens, phase=spec.name
                ))  # fmt: skip
                at += float(rng.exponential(1 / spec.rate))
        start = end
    return Workload(name, tuple(requests), start, phases=tuple(phases))


def load_shift(
    rate: float,
    *,
    phase_s: float = 600.0,
    cycles: int = 2,
    a: tuple[int, int] = (1500, 8),
    b: tuple[int, int] = (50, 256),
    seed: int = 0,
) -> Workload:
    """The issue's shift: phase A (long prompts, short outputs) and phase B (short prompts,
    long outputs) in turn at the same arrival rate."""
    specs = []
    for _ in range(cycles):
        specs.append(PhaseSpec("A", a[0], a[1], rate, phase_s))
        specs.append(PhaseSpec("B", b[0], b[1], rate, phase_s))
    return phased(f"shift {a[0]}/{a[1]} <-> {b[0]}/{b[1]} at {rate:g}/s", specs, seed)


def rate_step(
    low: float,
    high: float,
    *,
    prompt_tokens: int = 1024,
    output_tokens: int = 128,
    phase_s: float = 600.0,
    seed: int = 0,
) -> Workload:
    """Low, high, low rate of one request shape: the fleet must grow and shrink."""
    specs = [
        PhaseSpec("low", prompt_tokens, output_tokens, low, phase_s),
        PhaseSpec("high", prompt_tokens, output_tokens, high, phase_s),
        PhaseSpec("low2", prompt_tokens, output_tokens, low, phase_s),
    ]
    return phased(f"rate step {low:g} -> {high:g} -> {low:g}/s", specs, seed)
