"""``pdserve status``: every live process of the cluster, from the gateway."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import grpc

from common.telemetry.metrics import Samples, scrape
from pdserve.cli.launcher import StackState, run_dir
from pdserve.client import GatewayClient, add_client_args
from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import gateway_pb2

CIRCUIT_NAMES = {
    gateway_pb2.CIRCUIT_STATE_CLOSED: "closed",
    gateway_pb2.CIRCUIT_STATE_OPEN: "open",
    gateway_pb2.CIRCUIT_STATE_HALF_OPEN: "half_open",
}
ROLE_NAMES = {
    common_pb2.WORKER_ROLE_PREFILL: "prefill",
    common_pb2.WORKER_ROLE_DECODE: "decode",
    common_pb2.WORKER_ROLE_BOTH: "both",
    common_pb2.WORKER_ROLE_BLOCK_STORE: "blockstore",
    common_pb2.WORKER_ROLE_GATEWAY: "gateway",
    common_pb2.WORKER_ROLE_PLANNER: "planner",
}
ENGINE_ROLES = (
    common_pb2.WORKER_ROLE_PREFILL,
    common_pb2.WORKER_ROLE_DECODE,
    common_pb2.WORKER_ROLE_BOTH,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="list the cluster's workers and their load")
    add_client_args(parser)
    parser.add_argument(
        "--json", action="store_true", help="a JSON list, one object per process (with its pid)"
    )
    parser.set_defaults(func=run)


def metrics_urls() -> dict[str, str]:
    """Address -> Prometheus endpoint of each process that ``pdserve up`` started here."""
    state = StackState.load(run_dir() / "stack.json")
    if state is None:
        return {}
    return {c.address: c.metrics_url for c in state.children if c.metrics_url}


def summarize(samples: Samples) -> dict[str, float]:
    """The figures ``pdserve status`` shows from a process's metrics (what it has of them)."""
    figures: dict[str, float] = {}
    for key, name in (
        ("requests", "pdserve:request_success_total"),
        ("prompt_tokens", "pdserve:prompt_tokens_total"),
        ("generation_tokens", "pdserve:generation_tokens_total"),
        ("prefix_cache_queries", "pdserve:prefix_cache_queries_total"),
        ("prefix_cache_hits", "pdserve:prefix_cache_hits_total"),
        ("kv_cache_usage_perc", "pdserve:kv_cache_usage_perc"),
        ("kv_transfer_bytes", "pdserve:kv_transfer_bytes_total"),
        ("blockstore_blocks", "pdserve:blockstore_blocks"),
        ("spec_draft_tokens", "pdserve:spec_decode_num_draft_tokens_total"),
        ("spec_accepted_tokens", "pdserve:spec_decode_num_accepted_tokens_total"),
        ("suffix_cached_responses", "pdserve:suffix_decoding_cached_responses"),
        ("suffix_tenants", "pdserve:suffix_decoding_tenants"),
    ):
        if samples.has(name):
            figures[key] = samples.sum(name)
    if figures.get("spec_draft_tokens"):  # a speculating decode worker: kept / proposed
        figures["spec_acceptance_rate"] = figures["spec_accepted_tokens"] / figures["spec_draft_tokens"]
    count = samples.sum("pdserve:time_to_first_token_seconds_count")
    if count:
        figures["ttft_mean_s"] = samples.sum("pdserve:time_to_first_token_seconds_sum") / count
    return figures


async def _metrics_of(url: str | None) -> dict[str, float] | None:
    if url is None:
        return None
    try:
        return summarize(await asyncio.to_thread(scrape, url))
    except (OSError, ValueError):
        return None


async def fetch(
    target: str, api_key: str | None = None, tls_ca: str | None = None
) -> list[dict[str, object]]:
    client = GatewayClient(target, api_key, tls_ca)
    try:
        reply = await client.cluster_status()
    finally:
        await client.close()
    urls = metrics_urls()
    figures = await asyncio.gather(*(_metrics_of(urls.get(w.address)) for w in reply.workers))
    workers: list[dict[str, object]] = [
        {
            "id": w.worker_id,
            "role": ROLE_NAMES.get(w.role, "unknown"),
            "address": w.address,
            "model": w.model,
            "kv_blocks_total": w.num_kv_blocks_total,
            "kv_blocks_free": w.num_kv_blocks_free,
            "running": w.num_running_requests,
            "waiting": w.num_waiting_requests,
            "prefix_cache_hit_rate": round(w.prefix_cache_hit_rate, 4),
            "pid": w.pid,
            "draining": w.draining,
            "weights": w.weight_format,
            "endpoints": list(w.endpoints),
        }
        for w in reply.workers
    ]
    for worker, metrics in zip(workers, figures, strict=True):
        if metrics is not None:
            worker["metrics"] = metrics
    for worker, status in zip(workers, reply.workers, strict=True):
        if status.role in ENGINE_ROLES:
            worker["role_since_unix_ms"] = status.role_since_unix_ms
            worker["num_role_changes"] = status.num_role_changes
            if status.HasField("profile"):
                worker["profile"] = profile_summary(status.profile)
    circuits = {c.worker_id: c for c in reply.circuits}
    for worker, status in zip(workers, reply.workers, strict=True):
        if status.role in ENGINE_ROLES:
            circuit = circuits.get(status.worker_id)
            worker["circuit"] = CIRCUIT_NAMES[circuit.state] if circuit else "closed"
            if circuit is not None:
                worker["consecutive_failures"] = circuit.consecutive_failures
        if status.role == common_pb2.WORKER_ROLE_GATEWAY and reply.HasField("routing_index"):
            index = reply.routing_index
            worker["index_available"] = index.available
            if not index.available:
                worker["index_error"] = index.error
                worker["index_unavailable_since_unix_ms"] = index.unavailable_since_unix_ms
    return workers


def profile_summary(message: common_pb2.WorkerProfile) -> dict[str, object]:
    """What ``pdserve status`` shows of a worker's profile: its key, what one prefill and one
    decode step cost by the fits, and its KV capacity."""
    from common.planner.profile import WorkerProfile

    profile = WorkerProfile.from_pb(message)
    return {
        "weights": profile.key.weight_format or "float",
        "threads": profile.key.num_threads,
        "device": profile.key.device,
        "prefill_512_ms": round(profile.prefill_ms(512), 1),
        "prefill_2048_ms": round(profile.prefill_ms(2048), 1),
        "decode_step_1x512_ms": round(profile.decode_step_ms(1, 512), 2),
        "decode_step_16x512_ms": round(profile.decode_step_ms(16, 512), 2),
        "kv_capacity_tokens": profile.kv_capacity_tokens,
        "measured_unix_ms": profile.measured_unix_ms,
    }


def run(args: argparse.Namespace) -> int:
    try:
        workers = asyncio.run(fetch(args.target, args.api_key, args.tls_ca))
    except grpc.aio.AioRpcError as exc:
        print(f"pdserve status: {args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(workers, indent=2))
        return 0
    header = (f"{'id':<14} {'role':<10} {'address':<22} {'pid':>7} {'kv free/total':>15} {'run':>4} "
              f"{'wait':>5} {'hit rate':>8} {'requests':>8} {'prompt tok':>10} {'gen tok':>8} "
              f"{'ttft ms':>8}  weights")  # fmt: skip
    print(header)
    for w in workers:
        blocks = f"{w['kv_blocks_free']}/{w['kv_blocks_total']}" if w["kv_blocks_total"] else "-"
        m: dict[str, float] = w.get("metrics") or {}  # type: ignore[assignment]
        ttft = f"{m['ttft_mean_s'] * 1000:.1f}" if "ttft_mean_s" in m else "-"
        weights = str(w["weights"] or ("float" if w["role"] in ("prefill", "decode") else "-"))
        if "spec_acceptance_rate" in m:
            weights += f"  spec accepted {m['spec_acceptance_rate']:.0%}"
        if "suffix_cached_responses" in m:
            weights += (f"  suffix trees: {m['suffix_cached_responses']:.0f} responses, "
                        f"{m['suffix_tenants']:.0f} tenants")  # fmt: skip
        print(f"{w['id']!s:<14} {w['role']!s:<10} {w['address']!s:<22} {w['pid'] or '-'!s:>7} {blocks:>15} "
              f"{w['running']!s:>4} {w['waiting']!s:>5} {w['prefix_cache_hit_rate']!s:>8} "
              f"{_count(m, 'requests'):>8} {_count(m, 'prompt_tokens'):>10} "
              f"{_count(m, 'generation_tokens'):>8} {ttft:>8}  {weights}"
              f"{'  draining' if w['draining'] else ''}")  # fmt: skip
    for line in health_lines(workers):
        print(line)
    for line in role_lines(workers):
        print(line)
    return 0


def role_lines(workers: list[dict[str, object]]) -> list[str]:
    """Each engine worker's role since when, and the profile the planner prices it with."""
    lines = []
    now_ms = time.time() * 1000
    for w in workers:
        since = w.get("role_since_unix_ms")
        if not isinstance(since, int) or not since:
            continue
        changes = w.get("num_role_changes") or 0
        line = f"{w['id']}: {w['role']} for {(now_ms - since) / 1000:.0f} s ({changes} role changes)"
        profile = w.get("profile")
        if isinstance(profile, dict):
            line += (
                f"; profile ({profile['threads']} threads, {profile['device']}): prefill 512 "
                f"tokens {profile['prefill_512_ms']} ms, 2048 {profile['prefill_2048_ms']} ms; "
                f"decode step 1x512 {profile['decode_step_1x512_ms']} ms, 16x512 "
                f"{profile['decode_step_16x512_ms']} ms; KV {profile['kv_capacity_tokens']} "
                "tokens"
            )
        lines.append(line)
    return lines


def health_lines(workers: list[dict[str, object]]) -> list[str]:
    """What the gateway says about Redis and the workers it avoids, as text."""
    lines = []
    for w in workers:
        for url in w.get("endpoints") or []:  # type: ignore[attr-defined]
            what = "KServe v2 gRPC" if url.startswith("grpc") else "OpenAI-compatible HTTP API"
            lines.append(f"{w['id']}: {what} at {url}")
        if w["role"] == "gateway" and w.get("index_available") is False:
            since_ms = w["index_unavailable_since_unix_ms"]
            assert isinstance(since_ms, int)
            since = time.strftime("%H:%M:%S", time.localtime(since_ms / 1000))
            lines.append(
                f"routing index (Redis): UNAVAILABLE since {since} ({w['index_error']}); "
                "routing by load only on the last known workers"
            )
        elif w["role"] == "gateway" and w.get("index_available") is True:
            lines.append("routing index (Redis): available")
        if w.get("circuit", "closed") != "closed":
            lines.append(
                f"circuit breaker {w['circuit']}: {w['id']} "
                f"({w['consecutive_failures']} failed calls in a row); the gateway avoids it"
            )
    return lines


def _count(figures: dict[str, float], key: str) -> str:
    return str(int(figures[key])) if key in figures else "-"
