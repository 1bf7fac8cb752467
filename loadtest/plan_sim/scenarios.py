"""What a plan-sim run is made of, per profile and workload: the fleet's constants, the
load at a fleet size, and the SLA targets (all overridable from the command line).

Loads scale with the fleet so that every size is equally busy:
- shift: phase A (1500-token prompts, 8 output tokens) and phase B (50 / 256) in turn at
  one rate, ``load`` x workers x what one worker prefills of phase A's prompts a second;
- mooncake: the trace overlaid to ``rate_per_worker`` x workers requests a second;
- rate-step: 1024 / 128-token requests at 30 %, then 85 %, then 30 % of the rate at which
  the fleet's prefill alone would be busy.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.planner.hosting import Hosting
from common.planner.model import ModelConfig
from common.planner.profile import WorkerProfile
from common.planner.types import Targets
from loadtest.plan_sim import WORKLOADS
from loadtest.plan_sim.cluster import ClusterConfig
from loadtest.plan_sim.workload import Workload, load_shift, mooncake, rate_step

MOONCAKE_RATE = 12031 / 3537.0  # the trace's requests a second


@dataclass(frozen=True)
class Fleet:
    """A profile's fleet constants."""

    hosting: Hosting
    kv_transfer_base_ms: float
    kv_transfer_ms_per_token: float
    startup_s: float
    switch_s: float
    block_tokens: int  # tokens per Mooncake trace block (512 in the trace)
    output_scale: float  # Mooncake output lengths scaled by this
    targets: dict[str, Targets]
    rate_per_worker: float  # Mooncake requests a second per worker


FLEETS = {
    # Cluster scale: one worker per GPU, RDMA-class transfers (~25 GB/s of 128 KiB tokens),
    # a minute to start a worker (pull nothing, load 16 GB of weights), seconds to switch.
    "gpu": Fleet(
        hosting=Hosting(),
        kv_transfer_base_ms=2.0,
        kv_transfer_ms_per_token=0.005,
        startup_s=60.0,
        switch_s=5.0,
        block_tokens=512,
        output_scale=1.0,
        targets={
            "shift": Targets(600, 25),
            "mooncake": Targets(5000, 50),
            "rate-step": Targets(1000, 30),
        },
        rate_per_worker=0.3,
    ),
    # This machine: 2 workers of 2 threads on 2 cores, gRPC KV transfers (~46 KB a token at
    # ~1.8 GB/s), seconds to start a worker process, a trace scaled to SmolLM2's context.
    "cpu": Fleet(
        hosting=Hosting(cores_per_host=2, threads_per_worker=2, workers_per_host=2),
        kv_transfer_base_ms=2.0,
        kv_transfer_ms_per_token=0.03,
        startup_s=15.0,
        switch_s=2.0,
        block_tokens=16,
        output_scale=0.125,
        targets={
            "shift": Targets(6000, 150),
            "mooncake": Targets(3000, 150),
            "rate-step": Targets(6000, 150),
        },
        rate_per_worker=0.4,
    ),
}


def fleet_for(profile: WorkerProfile) -> Fleet:
    return FLEETS["cpu" if profile.key.device == "cpu" else "gpu"]


def build_workload(
    name: str,
    profile: WorkerProfile,
    fleet: Fleet,
    workers: int,
    *,
    load: float,
    rate_per_worker: float | None,
    phase_s: float,
    cycles: int,
    duration_s: float | None,
    seed: int,
) -> Workload:
    # Workers sharing a host's cores add no compute beyond the host's.
    h = fleet.hosting
    busy_equivalent = workers * (h.speed(h.workers_per_host) if h.shared else 1.0)
    if name == "shift":
        per_worker = 1000 / profile.prefill_ms(1500)
        rate = load * busy_equivalent * per_worker
        return load_shift(rate, phase_s=phase_s, cycles=cycles, seed=seed)
    if name == "mooncake":
        per = rate_per_worker if rate_per_worker is not None else fleet.rate_per_worker
        return mooncake(
            rate_scale=per * workers / MOONCAKE_RATE,
            block_tokens=fleet.block_tokens,
            output_scale=fleet.output_scale,
            max_tokens=profile.max_model_len,
            duration_s=duration_s,
            seed=seed,
        )
    if name == "rate-step":
        per_worker = 1000 / profile.prefill_ms(1024)
        full = busy_equivalent * per_worker
        return rate_step(0.3 * full, 0.85 * full, phase_s=phase_s, seed=seed)
    raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")


def cluster_config(
    fleet: Fleet, profile: WorkerProfile, workers: int, local_prefill_tokens: int, seed: int
) -> ClusterConfig:
    return ClusterConfig(
        local_prefill_tokens=local_prefill_tokens,
        kv_transfer_base_ms=fleet.kv_transfer_base_ms,
        kv_transfer_ms_per_token=fleet.kv_transfer_ms_per_token,
        switch_s=fleet.switch_s,
        startup_s=fleet.startup_s,
        hosting=fleet.hosting,
        # The block store holds as much as the fleet's KV pools (memory tier).
        store_tokens=profile.kv_capacity_tokens * workers,
        seed=seed,
    )


def model_config(fleet: Fleet, local_prefill_tokens: int, interval_s: float) -> ModelConfig:
    """The planner's model of the same fleet (what the live planner is configured with)."""
    return ModelConfig(
        local_prefill_tokens=local_prefill_tokens,
        kv_transfer_base_ms=fleet.kv_transfer_base_ms,
        kv_transfer_ms_per_token=fleet.kv_transfer_ms_per_token,
        hosting=fleet.hosting,
        horizon_s=interval_s,
    )
