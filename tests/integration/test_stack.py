"""The whole stack over real processes: parity, concurrency, prefix routing, no leaks."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.llm import LLM
from pdserve.cli.launcher import StackState
from pdserve.client import GatewayClient, RemoteCompletion
from tests.factories import hf_greedy
from tests.integration.conftest import Stack
from tests.prompts import passage, prompt_with_context

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


def complete_all(
    stack: Stack, prompts: list[str], sampling: SamplingParams, **kwargs: object
) -> list[RemoteCompletion]:
    async def run() -> list[RemoteCompletion]:
        client = GatewayClient(stack.target)
        try:
            return list(
                await asyncio.gather(
                    *(client.complete(prompt=p, sampling=sampling, **kwargs) for p in prompts)
                )
            )
        finally:
            await client.close()

    return asyncio.run(run())


def test_greedy_through_the_stack_equals_engine_and_transformers(stack: Stack) -> None:
    prompts = [prompt_with_context(0, 0), prompt_with_context(2, 3), prompt_with_context(9, 6)]
    remote = complete_all(stack, prompts, GREEDY)

    llm = LLM(EngineConfig(model=str(stack.model_dir), num_kv_blocks=256))
    local = llm.generate(prompts, GREEDY)
    encoded = [llm.encode(p) for p in prompts]
    expected, _ = hf_greedy(stack.model_dir, encoded, GREEDY.max_tokens, ignore_eos=False)
    for r, here, want in zip(remote, local, expected, strict=True):
        assert r.token_ids == here.token_ids == want
        assert r.text == here.text
        assert r.finish_reason == here.finish_reason
        assert r.prompt_tokens == len(here.prompt_token_ids)


def test_32_concurrent_streams_complete(stack: Stack) -> None:
    before = stack.wait_all_free()
    prompts = [prompt_with_context(i % 7, i) for i in range(32)]
    results = complete_all(stack, prompts, SamplingParams(max_tokens=24, temperature=0.8, seed=1))
    assert len(results) == 32
    for r in results:
        assert r.finish_reason in ("stop", "length")
        assert r.token_ids and r.text
    after = stack.wait_all_free()
    assert [w["kv_blocks_free"] for w in after] == [w["kv_blocks_free"] for w in before]


def test_repeated_long_prefix_hits_the_worker_holding_it(stack: Stack) -> None:
    # A unique opening, so nothing past the system prompt's blocks is cached from other tests.
    context = "Report 5501-Q. " + passage(24, offset=4)  # ~350 tokens shared
    first = f"{context}\n\nWhat is the first sentence about? Answer in detail, with every fact you find."
    second = f"{context}\n\nName every place that the text mentions, and say what happens at each of them."
    before = {w["id"]: w for w in stack.workers()}
    (one,) = complete_all(stack, [first], GREEDY)
    mid = {w["id"]: w for w in stack.workers()}
    (two,) = complete_all(stack, [second], GREEDY)
    after = {w["id"]: w for w in stack.workers()}
    assert one.cached_tokens <= 32  # at most the system prompt's blocks
    assert two.cached_tokens >= 320, two.cached_tokens
    # The second request's hit came from the prefill worker that computed the first one: only
    # its hit rate rises.
    prefill_ids = [i for i, w in after.items() if w["role"] == "prefill"]
    rose = [
        i
        for i in prefill_ids
        if after[i]["prefix_cache_hit_rate"] > mid[i]["prefix_cache_hit_rate"]
    ]
    assert len(rose) == 1, (before, mid, after)
    stack.wait_all_free()


def test_cli_generate_and_status_json(stack: Stack) -> None:
    result = stack.cli(
        "generate",
        "--target",
        stack.target,
        "--json",
        "--max-tokens",
        "16",
        "Say hello.",
        "Count to three.",
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["Say hello.", "Count to three."]
    assert all(r["token_ids"] and r["finish_reason"] in ("stop", "length") for r in records)
    status = stack.cli("status", "--target", stack.target, "--json")
    workers = json.loads(status.stdout)
    roles = sorted(w["role"] for w in workers)
    # pdserve up --gateways 2: both gateways, each with its own pid.
    assert roles == ["blockstore", "decode", "decode", "gateway", "gateway", "prefill", "prefill"]
    assert sorted(w["id"] for w in workers if w["role"] == "gateway") == ["gateway-0", "gateway-1"]
    pids = {child.address: child.pid for child in stack.children().values()}
    for w in workers:
        assert set(w) >= {
            "id",
            "role",
            "address",
            "pid",
            "draining",
            "kv_blocks_total",
            "kv_blocks_free",
            "running",
            "waiting",
            "prefix_cache_hit_rate",
        }
        # Each process's own pid, the one pdserve up started: a test or operator can signal it.
        assert w["pid"] == pids[w["address"]], w
        assert w["draining"] is False


def test_the_second_gateway_takes_the_next_port_and_answers_alike(stack: Stack) -> None:
    state = StackState.load(stack.run_dir / "stack.json")
    assert state is not None and len(state.gateway_endpoints) == 2
    first, second = state.gateway_endpoints
    host, port = stack.target.rsplit(":", 1)
    assert first["grpc"] == stack.target and second["grpc"] == f"{host}:{int(port) + 1}"
    assert first["http"] == state.http and second["http"] not in ("", first["http"])
    assert stack.children()["gateway-1"].address == second["grpc"]
    answers = []
    for target in (first["grpc"], second["grpc"]):
        result = stack.cli("generate", "--target", target, "--json", "--max-tokens", "12",
                           "Name a color.")  # fmt: skip
        assert result.returncode == 0, result.stderr
        answers.append(json.loads(result.stdout)["token_ids"])
    assert answers[0] == answers[1] and len(answers[0]) > 0


def test_tenants_with_different_salts_never_share_cached_prefixes(stack: Stack) -> None:
    prompt = "Audit memo 8812-Z. " + passage(12, offset=2)
    # Salts no other test on this stack uses: a prompt under the chat template shares its
    # first block with every other chat prompt of the same salt.
    tenant_a, tenant_b = (f"tenant-{uuid.uuid4().hex[:8]}" for _ in range(2))
    (a1,) = complete_all(stack, [prompt], GREEDY, cache_salt=tenant_a)
    (b1,) = complete_all(stack, [prompt], GREEDY, cache_salt=tenant_b)
    (a2,) = complete_all(stack, [prompt], GREEDY, cache_salt=tenant_a)
    assert a1.cached_tokens == 0 and b1.cached_tokens == 0
    assert a2.cached_tokens >= 160
    assert a1.token_ids == b1.token_ids == a2.token_ids
    stack.wait_all_free()
