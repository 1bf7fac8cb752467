"""``pdserve profile``: measures how fast an engine is on this machine, prints the samples,
the fits the planner prices work with and how well they hold, and the KV capacity.

The profile is measured in process on an engine built from the engine flags, as a worker
with the same flags would run (common/engine/profiler.py: about 10 s with ``--quick``, the
default, about 60 s with ``--full``), and saved to the local cache,
$PDSERVE_CACHE/profiles/<slug>.json, where a worker of the same model, weight format,
threads and device can take it instead of measuring. ``--json PATH`` also writes it to
PATH, and ``--redis-url`` stores it in Redis for the planner (common/index/profiles.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.cli.engine_args import add_engine_args, engine_config_from_args

if TYPE_CHECKING:  # numpy and torch load only when a profile is measured or printed
    from common.planner.profile import WorkerProfile


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="measure prefill and decode speed and KV capacity of an engine on this machine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", dest="full", action="store_false", help="a few points, about 10 s (default)"
    )
    size.add_argument("--full", dest="full", action="store_true", help="more points, about 60 s")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write it here")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("PDSERVE_REDIS_URL"),
        help="store it in this Redis for the planner (env PDSERVE_REDIS_URL; default: not stored)",
    )
    parser.add_argument(
        "--model-name",
        default=None,
        help="served model name the profile is for (default: the checkpoint directory's "
        "name, as workers serve it)",
    )
    remote = parser.add_argument_group(
        "a running worker's profile (pdserve.worker.v1.WorkerService.GetProfile)"
    )
    remote.add_argument("--worker", default=None, metavar="ID", help="ask this worker instead")
    remote.add_argument(
        "--target", default="localhost:50051", help="the gateway that lists the worker"
    )
    remote.add_argument(
        "--remeasure", action="store_true",
        help="the worker measures again now (it must be idle; it serves nothing meanwhile)",
    )  # fmt: skip
    remote.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    remote.add_argument("--tls-ca", default=os.environ.get("PDSERVE_GATEWAY_CA"))
    add_engine_args(parser)
    parser.set_defaults(func=run, full=False)


def run(args: argparse.Namespace) -> int:
    if args.worker is not None:
        profile = asyncio.run(ask_worker(args))
        if profile is None:
            return 1
        return write(args, profile, save=False)
    from common.engine.engine import Engine
    from common.engine.profiler import measure_profile, profile_key
    from common.models.default_model import resolve_model

    config = engine_config_from_args(args, resolve_model(args.model))
    engine = Engine(config)
    # As workers name it (services/worker/config.py, served_model_name).
    model_name = args.model_name or Path(config.model).name
    profile = measure_profile(engine, profile_key(engine, model_name), quick=not args.full)
    return write(args, profile, save=True)


def write(args: argparse.Namespace, profile: WorkerProfile, save: bool) -> int:
    """Prints ``profile`` and keeps it where the flags say (the local cache when ``save``)."""
    from common.planner.profile_files import save_profile

    print(profile_table(profile))
    if save:
        print(f"\nsaved to {save_profile(profile)}")
    if args.json is not None:
        args.json.write_text(profile.to_json())
        print(f"written to {args.json}")
    if args.redis_url:
        return store(args.redis_url, profile)
    return 0


async def ask_worker(args: argparse.Namespace) -> WorkerProfile | None:
    """The profile a running worker holds (or measures now), found through the gateway."""
    import grpc

    from common.planner.profile import WorkerProfile
    from pdserve.client import GatewayClient
    from pdserve.worker.v1 import worker_pb2, worker_pb2_grpc

    client = GatewayClient(args.target, args.api_key, args.tls_ca)
    try:
        status = await client.cluster_status()
        worker = next((w for w in status.workers if w.worker_id == args.worker), None)
        if worker is None:
            known = ", ".join(w.worker_id for w in status.workers)
            print(f"pdserve profile: no worker {args.worker!r} (the cluster has {known})",
                  file=sys.stderr)  # fmt: skip
            return None
        stub = worker_pb2_grpc.WorkerServiceStub(grpc.aio.insecure_channel(worker.address))
        request = worker_pb2.GetProfileRequest(remeasure=args.remeasure)
        reply = await stub.GetProfile(request, timeout=120)
    except grpc.aio.AioRpcError as exc:
        print(f"pdserve profile: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return None
    finally:
        await client.close()
    return WorkerProfile.from_pb(reply.profile)


def store(url: str, profile: WorkerProfile) -> int:
    import redis.exceptions

    from common.index.profiles import ProfileStore
    from common.index.redis_client import connect

    async def put() -> None:
        client = connect(url)
        try:
            await ProfileStore(client).put(profile)
        finally:
            await client.aclose()

    try:
        asyncio.run(put())
    except redis.exceptions.RedisError as exc:
        print(f"pdserve profile: storing it in Redis at {url} failed: {exc}", file=sys.stderr)
        return 1
    print(f"stored in Redis at {url}")
    return 0


def profile_table(profile: WorkerProfile) -> str:
    """The profile as text: what it is of, KV capacity, each phase's samples against its
    fit, and the fit with its relative errors (what the planner's predictions are worth)."""
    key, pre, dec = profile.key, profile.prefill_fit, profile.decode_fit
    lines = [
        f"profile of {key.model}: weights {key.weight_format or 'float'}, "
        f"threads {key.num_threads or 'default'}, device {key.device}; "
        f"measured in {profile.measure_ms / 1000:.1f} s",
        f"KV capacity: {profile.num_kv_blocks} blocks x {profile.block_size} tokens = "
        f"{profile.kv_capacity_tokens} tokens; max_num_seqs {profile.max_num_seqs}, "
        f"max_num_batched_tokens {profile.max_num_batched_tokens}, "
        f"max_model_len {profile.max_model_len}",
        "",
        "prefill, submission to first token:",
        f"{'prompt':>8} {'cached':>7} {'new':>6} {'ms':>9} {'fit ms':>9} {'error':>7} {'tok/s':>8}",
    ]
    prefill_errors = pre.relative_errors(profile.prefill_samples)
    for s, error in zip(profile.prefill_samples, prefill_errors, strict=True):
        new = s.prompt_tokens - s.cached_tokens
        lines.append(
            f"{s.prompt_tokens:>8} {s.cached_tokens:>7} {new:>6} {s.ms:>9.1f} "
            f"{pre.ms(new, s.cached_tokens):>9.1f} {error:>+7.1%} {new / s.ms * 1000:>8.0f}"
        )
    lines += [
        f"fit: ms = {pre.base_ms:.3g} + {pre.per_token_ms:.4g} x new"
        f" + {pre.per_attended_token_ms:.4g} x new x (cached + new/2)",
        f"     {_error_summary(prefill_errors)}",
        "",
        "decode, one step of every sequence:",
        f"{'batch':>8} {'context':>7} {'step ms':>9} {'fit ms':>9} {'error':>7} {'tok/s':>8}",
    ]
    decode_errors = dec.relative_errors(profile.decode_samples)
    for d, error in zip(profile.decode_samples, decode_errors, strict=True):
        lines.append(
            f"{d.batch_size:>8} {d.context_tokens:>7} {d.step_ms:>9.2f} "
            f"{dec.step_ms(d.batch_size, d.context_tokens):>9.2f} {error:>+7.1%} "
            f"{d.batch_size / d.step_ms * 1000:>8.0f}"
        )
    lines += [
        f"fit: step ms = {dec.base_ms:.3g} + {dec.per_sequence_ms:.4g} x batch"
        f" + {dec.per_context_token_ms:.4g} x batch x context",
        f"     {_error_summary(decode_errors)}",
    ]
    return "\n".join(lines)


def _error_summary(errors: list[float]) -> str:
    sizes = [abs(e) for e in errors]
    return (
        f"fits its samples within {max(sizes):.1%} (median {statistics.median(sizes):.1%}); "
        "the error is (fit - measured) / measured"
    )
