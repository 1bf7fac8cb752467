"""Every process's Prometheus endpoint counts a known workload exactly, and ``pdserve
status`` shows the same numbers."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from common.contract.sampling import SamplingParams
from common.telemetry.metrics import Samples, scrape
from pdserve.client import GatewayClient, RemoteCompletion
from tests.integration.conftest import ObservedStack
from tests.polling import settle

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
NAMES = ("gateway", "prefill-0", "decode-0", "blockstore")


def complete_in_order(stack: ObservedStack, prompts: list[list[int]]) -> list[RemoteCompletion]:
    async def run() -> list[RemoteCompletion]:
        client = GatewayClient(stack.target)
        try:
            return [await client.complete(token_ids=p, sampling=GREEDY) for p in prompts]
        finally:
            await client.close()

    return asyncio.run(run())


class Delta:
    """Differences between two scrapes of one process."""

    def __init__(self, before: Samples, after: Samples) -> None:
        self.before, self.after = before, after

    def __call__(self, name: str, **labels: str) -> float:
        return self.after.sum(name, **labels) - self.before.sum(name, **labels)


def test_counts_after_a_known_workload(observed_stack: ObservedStack) -> None:
    stack = observed_stack
    children = stack.children()
    urls = {name: children[name].metrics_url for name in NAMES}
    assert all(urls.values()), urls  # pdserve up gave every process an endpoint
    before = {name: scrape(url) for name, url in urls.items() if url}

    rng = random.Random(11)
    long_prompt = [rng.randrange(1000, 40000) for _ in range(100)]  # 6 full blocks + 4
    short_prompt = [rng.randrange(1000, 40000) for _ in range(10)]
    # A: remote prefill (nobody holds it); B: the same prompt, which the decode worker now
    # holds 96 tokens of, so it prefills the last 4 itself; C: short, prefilled locally.
    a, b, c = complete_in_order(stack, [long_prompt, long_prompt, short_prompt])
    assert [r.finish_reason for r in (a, b, c)] == ["length"] * 3
    assert [r.cached_tokens for r in (a, b, c)] == [0, 96, 0]

    def settled() -> dict[str, Samples]:
        """After the background puts to the block store (A's prompt blocks from the prefill
        worker, C's first block written behind by the decode worker) and lease release."""

        def done(now: dict[str, Samples]) -> bool:
            put = Delta(before["blockstore"], now["blockstore"])(
                "pdserve:grpc_server_handled_total", grpc_method="CommitPut"
            )
            return put == 2 and now["prefill-0"].sum("pdserve:kv_leases_active") == 0

        return settle(
            lambda: {name: scrape(url) for name, url in urls.items() if url}, done, 15.0, 0.1
        )

    after = settled()
    gateway, prefill, decode, store = (Delta(before[n], after[n]) for n in NAMES)

    # The gateway: what the clients saw.
    assert gateway("pdserve:request_success_total", finished_reason="length") == 3
    assert gateway("pdserve:request_success_total") == 3
    assert gateway("pdserve:prompt_tokens_total") == 100 + 100 + 10
    assert gateway("pdserve:generation_tokens_total") == 3 * MAX_TOKENS
    assert gateway("pdserve:time_to_first_token_seconds_count") == 3
    assert gateway("pdserve:e2e_request_latency_seconds_count") == 3
    assert gateway("pdserve:request_queue_time_seconds_count") == 3
    assert gateway("pdserve:inter_token_latency_seconds_count") == 3 * (MAX_TOKENS - 1)
    assert gateway("pdserve:prefix_cache_queries_total") == 210
    assert gateway("pdserve:prefix_cache_hits_total") == 96
    assert gateway("pdserve:routing_decisions_total", reason="load") == 1
    assert gateway("pdserve:routing_decisions_total", reason="local_prefill_cached") == 1
    assert gateway("pdserve:routing_decisions_total", reason="local_prefill_short") == 1
    assert gateway("pdserve:routing_decisions_total") == 3
    assert after["gateway"].sum("pdserve:num_requests_running") == 0
    assert after["gateway"].sum("pdserve:redis_up") == 1
    assert gateway("pdserve:grpc_server_handled_total", grpc_method="Generate", grpc_code="OK") == 3

    # The prefill worker saw A only: its prompt, its first token, no prefix hit.
    assert prefill("pdserve:request_success_total", finished_reason="prefilled") == 1
    assert prefill("pdserve:request_success_total") == 1
    assert prefill("pdserve:prompt_tokens_total") == 100
    assert prefill("pdserve:generation_tokens_total") == 1
    assert prefill("pdserve:prefix_cache_queries_total") == 100
    assert prefill("pdserve:prefix_cache_hits_total") == 0
    assert prefill("pdserve:time_to_first_token_seconds_count") == 1
    assert prefill("pdserve:kv_lease_expiries_total") == 0
    assert prefill("pdserve:grpc_server_handled_total", grpc_method="PullBlocks") == 1
    assert prefill("pdserve:grpc_server_handled_total", grpc_method="ReleaseLease") == 1
    sent = prefill("pdserve:kv_transfer_bytes_total", peer="block_store", direction="sent")
    assert prefill("pdserve:kv_transfer_blocks_total", peer="block_store", direction="sent") == 6

    # The decode worker: all three requests; A's KV pulled (7 blocks), B's prefix a hit.
    assert decode("pdserve:request_success_total", finished_reason="length") == 3
    assert decode("pdserve:prompt_tokens_total") == 210
    assert decode("pdserve:generation_tokens_total") == (MAX_TOKENS - 1) + 2 * MAX_TOKENS
    assert decode("pdserve:prefix_cache_queries_total") == 100 + 10  # A's KV was imported
    assert decode("pdserve:prefix_cache_hits_total") == 96
    received = decode("pdserve:kv_transfer_bytes_total", peer="producer", direction="received")
    assert decode("pdserve:kv_transfer_blocks_total", peer="producer", direction="received") == 7
    assert received / 7 == sent / 6 > 0  # whole blocks of one layout
    assert decode("pdserve:kv_transfer_duration_seconds_count", peer="producer") == 1
    assert decode("pdserve:kv_transfer_failures_total") == 0
    # Write-behind: the decode worker computed one full block itself, C's first (its 10
    # prompt tokens and 6 of the 7 computed output tokens); A's and B's first 6 blocks were
    # imported or cached, and neither filled a 7th (100 + 7 computed tokens < 112).
    assert decode("pdserve:kv_transfer_blocks_total", peer="block_store", direction="sent") == 1
    assert after["decode-0"].sum("pdserve:num_requests_running") == 0
    assert after["decode-0"].sum("pdserve:num_requests_waiting") == 0
    assert 0 <= after["decode-0"].sum("pdserve:kv_cache_usage_perc") < 1

    # The block store: A's 6 full blocks put once, and C's one block written behind; looked
    # up by A's prefill and B's decode.
    assert store("pdserve:grpc_server_handled_total", grpc_method="BeginPut") == 2
    assert store("pdserve:grpc_server_handled_total", grpc_method="ContainsBlocks") == 2
    assert store("pdserve:grpc_server_handled_total", grpc_method="GetBlocks") == 0
    assert store("pdserve:blockstore_blocks") == 7
    for samples in after.values():
        assert samples.has("process_cpu_seconds_total")

    # `pdserve status` reads the same numbers from the same endpoints.
    status = stack.cli("status", "--target", stack.target, "--json")
    assert status.returncode == 0, status.stderr
    by_id = {w["id"]: w for w in json.loads(status.stdout)}
    for worker_id, name in (
        ("gateway-0", "gateway"),
        ("prefill-0", "prefill-0"),
        ("decode-0", "decode-0"),
    ):
        figures = by_id[worker_id]["metrics"]
        samples = after[name]
        for key, metric in (
            ("requests", "pdserve:request_success_total"),
            ("prompt_tokens", "pdserve:prompt_tokens_total"),
            ("generation_tokens", "pdserve:generation_tokens_total"),
        ):
            assert figures[key] == samples.sum(metric), (worker_id, key)
    assert by_id["blockstore-0"]["metrics"]["blockstore_blocks"] == after["blockstore"].sum(
        "pdserve:blockstore_blocks"
    )
