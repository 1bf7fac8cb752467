"""Prompt logprobs across the prefill/decode hop, on real workers (a tiny random llama) and
a block store in process: the prefill worker returns them in PrefillResponse and the decode
worker on the first message of a local prefill, equal to transformers' log-softmax, computed
from every position although the store and the workers' caches hold the prompt."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from pdserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from services.blockstore import server as blockstore_server
from services.blockstore.config import BlockStoreConfig
from services.worker.serve import start_worker
from services.worker.server import add_servicers
from tests.services.test_kv_load_fallback import (
    MAX_TOKENS,
    PROMPT,
    close_all,
    request,
    run,
    start_decoder,
    worker_config,
)

TOP = 2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.factories import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


@pytest.fixture(scope="module")
def expected(tiny_dir: Path) -> torch.Tensor:
    """[P-1, V]: transformers' log-softmax of each prompt token after the ones before."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check(entries: Any, expected: torch.Tensor) -> None:
    assert len(entries) == len(PROMPT) - 1
    for i, entry in enumerate(entries):
        assert entry.token_id == PROMPT[i + 1]
        assert entry.logprob == pytest.approx(expected[i, PROMPT[i + 1]].item(), abs=1e-4)
        values, ids = torch.topk(expected[i], TOP)
        assert [t.token_id for t in entry.top_logprobs] == ids.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)


async def wait_stored(store: Any, model: str, num_blocks: int) -> None:
    for _ in range(200):
        if len(store.store.committed_hashes().get(model, ())) >= num_blocks:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the store never held {num_blocks} blocks of {model}")


def test_both_hops_return_prompt_logprobs_computed_in_full(
    tiny_dir: Path, expected: torch.Tensor
) -> None:
    async def body() -> None:
        cleanup: list[Callable[[], Awaitable[Any]]] = []
        try:
            store = await blockstore_server.start(BlockStoreConfig(capacity_bytes=64 << 20, port=0))
            cleanup.append(store.stop)
            address = f"127.0.0.1:{store.port}"
            decoder = await start_decoder(tiny_dir, address, cleanup)
            first = request("r-plain", local_prefill=True)
            plain = [m async for m in decoder.stub.Decode(first, timeout=30)]
            tokens = [t for m in plain for t in m.token_ids]
            assert all(not m.prompt_logprobs for m in plain)
            await wait_stored(store, decoder.runtime.model, len(PROMPT) // 16)

            # Decode, local prefill: the first message carries them; nothing is imported
            # from the store and nothing is served from the worker's own cache.
            scored = request("r-decode", local_prefill=True)
            scored.sampling.prompt_logprobs = TOP
            messages = [m async for m in decoder.stub.Decode(scored, timeout=30)]
            check(messages[0].prompt_logprobs, expected)
            assert all(not m.prompt_logprobs for m in messages[1:])
            assert [t for m in messages for t in m.token_ids] == tokens
            last = messages[-1]
            assert (last.cached_tokens, last.imported_tokens) == (0, 0)
            assert last.computed_tokens == len(PROMPT)

            # Prefill worker: in PrefillResponse, although the store holds the prompt.
            server, prefill = await start_worker(
                worker_config(tiny_dir, "prefill", address), add_servicers
            )
            cleanup += [prefill.stop, lambda: server.stop(0)]
            async with grpc.aio.insecure_channel(prefill.address) as channel:
                message = prefill_pb2.PrefillRequest(
                    request_id="r-prefill", prompt_token_ids=PROMPT, lease_id="lease-pl"
                )
                message.sampling.max_tokens = MAX_TOKENS
                message.sampling.temperature = 0.0
                message.sampling.ignore_eos = True
                message.sampling.prompt_logprobs = TOP
                prefilled = await prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(
                    message, timeout=30
                )
                check(prefilled.prompt_logprobs, expected)
                assert (prefilled.cached_tokens, prefilled.computed_tokens) == (0, len(PROMPT))
                assert prefilled.first_token_id == tokens[0]

                # Out of range: INVALID_ARGUMENT naming the field.
                message.request_id, message.lease_id = "r-bad", "lease-bad"
                message.sampling.prompt_logprobs = 21
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(message, timeout=30)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "sampling.prompt_logprobs" in (caught.value.details() or "")

            # The decode worker continues from the handle (sampling without them, as the
            # gateway sends it) and adds no prompt logprobs of its own.
            follow = request(
                "r-prefill",
                kv_handle=prefilled.kv_handle,
                generated_token_ids=[prefilled.first_token_id],
            )
            rest = [m async for m in decoder.stub.Decode(follow, timeout=30)]
            assert [t for m in rest for t in m.token_ids] == tokens[1:]
            assert all(not m.prompt_logprobs for m in rest)
            assert await decoder.all_free()
            stats = await prefill.stats()
            assert stats.num_held == 0
        finally:
            await close_all(cleanup)

    run(body)


def test_decode_messages_name_the_field_for_bad_values(tiny_dir: Path) -> None:
    async def body() -> None:
        cleanup: list[Callable[[], Awaitable[Any]]] = []
        try:
            decoder = await start_decoder(tiny_dir, None, cleanup)
            bad = request("r-bad", local_prefill=True)
            bad.sampling.prompt_logprobs = 1000
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in decoder.stub.Decode(bad, timeout=30):
                    pass
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sampling.prompt_logprobs" in (caught.value.details() or "")
            assert await decoder.all_free()
        finally:
            await close_all(cleanup)

    run(body)
