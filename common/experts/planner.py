"""Expert placement planning, EPLB-style (the expert-parallel load balancer of DeepSeek-V3).

Given one MoE layer's load (tokens routed per logical expert), ``D`` devices and ``R``
redundant slots, a plan says how many replicas each expert gets and which device holds
each replica, so that the expected load per device is as even as possible. A replica of an
expert with load ``w`` and ``c`` replicas is expected to serve ``w / c`` (the dispatcher
spreads an expert's tokens evenly over its replicas).

Every device has ``ceil((E + R) / D)`` slots. The plan is the better (lower maximum device
load) of two candidates, each polished by the same local search:

1. **EPLB greedy.** Replicate: each redundant slot goes to the expert whose per-replica
   load is highest (never more replicas than devices). Pack: replicas sorted by load,
   heaviest first, each onto the least-loaded device that has a free slot, preferring a
   device that holds no replica of the same expert (the longest-processing-time rule with
   a capacity constraint; with ``distinct_devices``, only such a device).
2. **The unreplicated placement, improved.** Experts spread evenly in contiguous runs
   (device ``d`` holds experts ``[d*E/D, (d+1)*E/D)``, the usual expert-parallel layout)
   and redundant slots filled one at a time with a replica of an expert on the most loaded
   device, while that does not raise the maximum.

Local search: move a replica off the most loaded device, or swap it with one elsewhere,
whenever that lowers the larger of the two devices' loads; never raises the maximum.

So the plan is never worse balanced than the unreplicated placement (candidate 2 starts
from it and only improves), never uses more than ``E + R`` replicas nor more slots than a
device has, and keeps at least one replica of every expert. Balance is max / mean of the
per-device load; the mean is the same for every plan (total load / D).

Not done here: EPLB's hierarchical mode (expert groups packed onto nodes first, then
GPUs, to keep traffic inside a node), and weighting by anything but tokens routed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

EPS = 1e-9


@dataclass(frozen=True)
class Plan:
    num_experts: int
    num_devices: int
    num_redundant: int
    slots_per_device: int
    replicas: list[int]  # per logical expert: how many replicas (>= 1)
    placement: list[list[int]]  # per device: the logical expert in each used slot
    load_before: list[float]  # per device, unreplicated contiguous placement
    load_after: list[float]  # per device, this plan
    strategy: str  # which candidate won: "eplb" or "baseline+"
    distinct_devices: bool = False  # replicas of one expert never share a device

    @property
    def num_replicas(self) -> int:
        return sum(len(slots) for slots in self.placement)

    @property
    def unused_slots(self) -> int:
        return self.num_devices * self.slots_per_device - self.num_replicas

    @property
    def mean_load(self) -> float:
        return sum(self.load_after) / self.num_devices

    @property
    def balance_before(self) -> float:
        """Max / mean device load of the unreplicated placement (1.0 = even)."""
        return _max_over_mean(self.load_before)

    @property
    def balance_after(self) -> float:
        return _max_over_mean(self.load_after)

    def replicated(self) -> dict[int, int]:
        """Experts given extra replicas -> their replica count."""
        return {e: c for e, c in enumerate(self.replicas) if c > 1}

    def devices_of(self, expert: int) -> list[int]:
        return [d for d, slots in enumerate(self.placement) for e in slots if e == expert]

    def to_json(self) -> dict[str, Any]:
        raw = asdict(self)
        raw.update(
            replicated={str(e): c for e, c in self.replicated().items()},
            num_replicas=self.num_replicas,
            unused_slots=self.unused_slots,
            max_load_before=round(max(self.load_before, default=0.0), 6),
            max_load_after=round(max(self.load_after, default=0.0), 6),
            mean_load=round(self.mean_load, 6),
            balance_before=round(self.balance_before, 6),
            balance_after=round(self.balance_after, 6),
            load_before=[round(x, 6) for x in self.load_before],
            load_after=[round(x, 6) for x in self.load_after],
        )
        return raw


def _max_over_mean(loads: Sequence[float]) -> float:
    total = sum(loads)
    if total <= 0:
        return 1.0
    # max * n / total, not max / (total / n): the mean of subnormal loads underflows to 0.
    return max(loads) * len(loads) / total


def contiguous_placement(num_experts: int, num_devices: int) -> list[list[int]]:
    """The unreplicated layout: runs of consecutive experts, sizes differing by at most 1."""
    return [
        list(range(d * num_experts // num_devices, (d + 1) * num_experts // num_devices))
        for d in range(num_devices)
    ]


class _State:
    """A placement under construction: slots per device and the load each carries."""

    def __init__(self, load: Sequence[float], capacity: int, placement: list[list[int]]):
        self.load = load
        self.capacity = capacity
        self.placement = [list(slots) for slots in placement]
        self.replicas = [0] * len(load)
        for slots in self.placement:
            for e in slots:
                self.replicas[e] += 1

    def share(self, e: int) -> float:
        return self.load[e] / self.replicas[e]

    def device_loads(self) -> list[float]:
        return [sum(self.share(e) for e in slots) for slots in self.placement]

    def add_replica(self, e: int, device: int) -> None:
        self.placement[device].append(e)
        self.replicas[e] += 1


def _greedy_replica_counts(load: Sequence[float], redundant: int, max_per_expert: int) -> list[int]:
    counts = [1] * len(load)
    for _ in range(redundant):
        best, best_share = -1, -1.0
        for e, w in enumerate(load):
            if counts[e] < max_per_expert and w / counts[e] > best_share + EPS:
                best, best_share = e, w / counts[e]
        if best < 0:
            break  # every expert already has a replica on every device
        counts[best] += 1
    return counts


def _pack(
    load: Sequence[float],
    counts: Sequence[int],
    num_devices: int,
    capacity: int,
    distinct: bool,
) -> list[list[int]]:
    """Heaviest replica first onto the least-loaded device with room (LPT), preferring a
    device without that expert among equally loaded ones; with ``distinct`` only such a
    device, the replica being dropped when there is none."""
    items = sorted(
        ((load[e] / c, e) for e, c in enumerate(counts) for _ in range(c)),
        key=lambda item: (-item[0], item[1]),
    )
    placement: list[list[int]] = [[] for _ in range(num_devices)]
    device_load = [0.0] * num_devices
    for share, e in items:
        candidates = [
            d
            for d in range(num_devices)
            if len(placement[d]) < capacity and not (distinct and e in placement[d])
        ]
        if not candidates:
            continue  # distinct: the devices with room all hold e (it keeps >= 1 replica)
        d = min(
            candidates,
            key=lambda d: (round(device_load[d], 9), e in placement[d], len(placement[d]), d),
        )
        placement[d].append(e)
        device_load[d] += share
    return placement


def _better(
    best: tuple[float, bool, int, int, int | None] | None,
    pair: float,
    colocates: bool,
    limit: float,
    distinct: bool,
) -> bool:
    """Whether a change leaving ``pair`` as the larger load of its two devices beats
    ``best``: lower, or as low without co-locating replicas where ``best`` does."""
    if pair >= limit or (distinct and colocates):
        return False
    if best is None or pair < best[0] - EPS:
        return True
    return pair <= best[0] + EPS and best[1] and not colocates


def _local_search(state: _State, max_rounds: int, distinct: bool) -> None:
    """Moves and swaps off the most loaded device while they lower the pair's maximum;
    among equal ones, those that do not put two replicas of an expert on one device (with
    ``distinct``, only those)."""
    for _ in range(max_rounds):
        loads = state.device_loads()
        src = max(range(len(loads)), key=lambda d: (loads[d], -d))
        source = state.placement[src]
        limit = loads[src] - EPS  # a change must bring both devices below this
        # (new pair max, co-locates, index on src, dst, index on dst or None for a move)
        best: tuple[float, bool, int, int, int | None] | None = None
        for i, e in enumerate(source):
            w = state.share(e)
            for dst, slots in enumerate(state.placement):
                if dst == src:
                    continue
                if len(slots) < state.capacity:  # move e to dst
                    pair = max(loads[src] - w, loads[dst] + w)
                    if _better(best, pair, e in slots, limit, distinct):
                        best = (pair, e in slots, i, dst, None)
                for j, f in enumerate(slots):  # swap e with f
                    v = state.share(f)
                    if v >= w - EPS:
                        continue
                    pair = max(loads[src] - w + v, loads[dst] + w - v)
                    colocates = e in slots or f in source
                    if _better(best, pair, colocates, limit, distinct):
                        best = (pair, colocates, i, dst, j)
        if best is None:
            return
        _, _, i, dst, swap = best
        e = state.placement[src][i]
        if swap is None:
            del state.placement[src][i]
            state.placement[dst].append(e)
        else:
            state.placement[src][i], state.placement[dst][swap] = state.placement[dst][swap], e


def _fill_from_baseline(state: _State, redundant: int) -> None:
    """Adds replicas of experts on the most loaded device while the maximum does not rise."""
    num_devices = len(state.placement)
    for _ in range(redundant):
        loads = state.device_loads()
        by_load = sorted(range(num_devices), key=lambda d: -loads[d])
        current = loads[by_load[0]]
        best: tuple[float, int, int] | None = None  # (new max, expert, device)
        for src in (d for d in by_load if loads[d] >= current - EPS):
            for e in set(state.placement[src]):
                w, c = state.load[e], state.replicas[e]
                if w <= 0 or c >= num_devices:
                    continue
                holders = Counter(d for d, slots in enumerate(state.placement) if e in slots)
                relief = w / c - w / (c + 1)  # what each existing replica of e sheds
                held_max = max(loads[d] - n * relief for d, n in holders.items())
                for dst in range(num_devices):
                    if len(state.placement[dst]) >= state.capacity or dst in holders:
                        continue
                    # The largest load among devices neither holding e nor receiving it.
                    rest = next((loads[d] for d in by_load if d != dst and d not in holders), 0.0)
                    new_max = max(held_max, loads[dst] + w / (c + 1), rest)
                    if new_max <= current and (best is None or new_max < best[0] - EPS):
                        best = (new_max, e, dst)
        if best is None:
            return
        state.add_replica(best[1], best[2])


def plan_placement(
    load: Sequence[float], num_devices: int, num_redundant: int, distinct_devices: bool = False
) -> Plan:
    """The placement of one layer's experts (``load[e]`` = tokens routed to expert e).

    ``distinct_devices``: never two replicas of an expert on one device (they would hold
    the same weights twice). Without it a device may take two replicas of a hot expert, as
    EPLB's packing allows: that device then serves twice the replica share.
    """
    num_experts = len(load)
    if num_experts == 0:
        raise ValueError("no experts to place")
    if num_devices < 1:
        raise ValueError(f"--devices must be at least 1, got {num_devices}")
    if num_redundant < 0:
        raise ValueError(f"--redundant must be >= 0, got {num_redundant}")
    if any(w < 0 or not math.isfinite(w) for w in load):
        raise ValueError("expert loads must be finite and non-negative")
    original = [float(w) for w in load]
    # Decisions on loads scaled to a maximum of 1, so that the tolerances are relative.
    scale = max(original) or 1.0
    load = [w / scale for w in original]
    capacity = -(-(num_experts + num_redundant) // num_devices)
    rounds = 4 * (num_experts + num_redundant)

    baseline = contiguous_placement(num_experts, num_devices)

    counts = _greedy_replica_counts(load, num_redundant, num_devices)
    eplb = _State(load, capacity, _pack(load, counts, num_devices, capacity, distinct_devices))
    _local_search(eplb, rounds, distinct_devices)

    improved = _State(load, capacity, baseline)
    _fill_from_baseline(improved, num_redundant)
    _local_search(improved, rounds, distinct_devices)

    candidates = [("eplb", eplb), ("baseline+", improved)]
    strategy, best = min(candidates, key=lambda c: (max(c[1].device_loads()), -sum(c[1].replicas)))
    return Plan(
        num_experts=num_experts,
        num_devices=num_devices,
        num_redundant=num_redundant,
        slots_per_device=capacity,
        replicas=list(best.replicas),
        placement=[sorted(slots) for slots in best.placement],
        load_before=_State(original, capacity, baseline).device_loads(),
        load_after=_State(original, capacity, best.placement).device_loads(),
        strategy=strategy,
        distinct_devices=distinct_devices,
    )
