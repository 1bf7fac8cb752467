"""StreamingLLM through the stack: a request asking for eviction (SamplingParams.kv_eviction)
may ask for more tokens than the context holds, and its greedy output through the gateway
(prefill worker, KV import, decode worker evicting as it goes) is the in-process engine's
under the same eviction, token for token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common.contract.eviction import KvEviction
from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.llm import LLM
from pdserve.client import GatewayClient, RemoteCompletion, collect
from tests.integration.conftest import Stack
from tests.integration.test_bad_input import model_info

pytestmark = pytest.mark.slow

PROMPT = "Write a long story about a lighthouse keeper and the ships she guides home."


def test_a_stream_through_the_stack_equals_the_engine_under_the_same_eviction(
    stack: Stack, smollm_dir: Path
) -> None:
    eviction = KvEviction(sink_tokens=16, window_tokens=64)
    sampling = SamplingParams(max_tokens=240, ignore_eos=True, kv_eviction=eviction)

    async def run() -> RemoteCompletion:
        client = GatewayClient(stack.target)
        result = RemoteCompletion()
        try:
            async for message in client.stream(prompt=PROMPT, sampling=sampling,
                                               cache_salt="streaming"):  # fmt: skip
                collect(result, message)
        finally:
            await client.close()
        return result

    remote = asyncio.run(run())
    llm = LLM(EngineConfig(model=str(smollm_dir), num_kv_blocks=64))
    (local,) = llm.generate([PROMPT], sampling)
    assert len(remote.token_ids) == 240  # 16 + 64 tokens kept of a prompt and 240 more
    assert remote.token_ids == local.token_ids
    # A dense engine's output parts from it once the first tokens leave the window.
    (dense,) = llm.generate([PROMPT], SamplingParams(max_tokens=240, ignore_eos=True))
    assert dense.token_ids != local.token_ids


def test_a_stream_may_ask_for_more_tokens_than_the_context(stack: Stack) -> None:
    limit = asyncio.run(model_info(stack.target)).max_context_tokens
    eviction = KvEviction(sink_tokens=16, window_tokens=64)
    sampling = SamplingParams(max_tokens=limit + 100, ignore_eos=True, kv_eviction=eviction)

    async def run() -> int:
        client = GatewayClient(stack.target)
        received = 0
        try:
            stream = client.stream(prompt=PROMPT, sampling=sampling, cache_salt="past-context")
            async for message in stream:
                received += len(message.token_ids)
                if received >= 32:  # accepted and streaming: enough
                    break
        finally:
            await client.close()
        return received

    assert asyncio.run(run()) >= 32
