"""Prompt logprobs through a ``pdserve up`` stack: a long prompt (prefilled on a prefill
worker) and a short one (prefilled by the decode worker) get them on the first message,
equal to the engine's own distributions in this process; ``pdserve perplexity --target``
measures what the in-process command does."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import grpc
import pytest
import torch

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.llm import LLM
from pdserve.client import GatewayClient
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.integration.conftest import Stack
from tests.integration.test_perplexity import topics_text

pytestmark = pytest.mark.slow

TOP = 3


@pytest.fixture(scope="module")
def llm(stack: Stack) -> LLM:
    """The stack's weight format (the default: the GGUF as stored), in this process."""
    return LLM(EngineConfig(model=str(stack.model_dir), num_kv_blocks=64))


def generate(
    stack: Stack, token_ids: list[int], prompt_logprobs: int | None = None
) -> list[gateway_pb2.GenerateResponse]:
    """Every message of a greedy 3-token Generate of ``token_ids``."""
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=prompt_logprobs)

    async def run() -> list[gateway_pb2.GenerateResponse]:
        client = GatewayClient(stack.target)
        try:
            stream = client.stream(token_ids=token_ids, sampling=params, timeout_s=120)
            return [m async for m in stream]
        finally:
            await client.close()

    return asyncio.run(run())


def test_prompt_logprobs_through_the_gateway_equal_the_engine(stack: Stack, llm: LLM) -> None:
    ids = llm.tokenizer.hf(topics_text(4000), add_special_tokens=False).input_ids
    # 300 tokens go through a prefill worker; 10 (under --local-prefill-tokens 16) are
    # prefilled by the decode worker itself. The first also runs once plainly, so the
    # stack holds its blocks: the scored request must not use them.
    long, short = ids[:300], ids[300:310]
    plain = generate(stack, long)
    for prompt in (long, short):
        messages = generate(stack, prompt, prompt_logprobs=TOP)
        first, rest = messages[0], messages[1:]
        assert first.token_ids, "the prompt logprobs come with the first token"
        assert all(not m.prompt_logprobs for m in rest)
        assert messages[-1].usage.cached_tokens == 0
        rows = llm.score(prompt)  # [P-1, V]
        entries = first.prompt_logprobs
        assert len(entries) == len(prompt) - 1
        got = torch.tensor([e.logprob for e in entries])
        want = rows.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
        assert [e.token_id for e in entries] == prompt[1:]
        assert torch.allclose(got, want, atol=2e-3), (got - want).abs().max()
        for entry, row in zip(entries, rows, strict=True):
            values = torch.topk(row, TOP).values
            top = torch.tensor([t.logprob for t in entry.top_logprobs])
            assert torch.allclose(top, values, atol=2e-3)
            assert all(abs(row[t.token_id].item() - t.logprob) < 2e-3 for t in entry.top_logprobs)
    assert [t for m in plain for t in m.token_ids] == [
        t for m in generate(stack, long, prompt_logprobs=0) for t in m.token_ids
    ]


def test_out_of_range_prompt_logprobs_are_invalid_argument(stack: Stack) -> None:
    async def run() -> grpc.aio.AioRpcError:
        request = gateway_pb2.GenerateRequest(raw_prompt="Hello there")
        request.sampling.prompt_logprobs = 21
        async with grpc.aio.insecure_channel(stack.target) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Generate(request, timeout=60):
                    pass
        return caught.value

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.prompt_logprobs" in (error.details() or "")


def test_perplexity_through_the_gateway(stack: Stack, llm: LLM, tmp_path: Path) -> None:
    path = tmp_path / "topics.txt"
    path.write_text(topics_text(6000), encoding="utf-8")
    done = stack.cli(
        "perplexity", str(path), "--target", stack.target, "--model", str(stack.model_dir),
        "--context", "256", "--max-tokens", "600", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    ids = llm.tokenizer.hf(path.read_text(), add_special_tokens=False).input_ids[:600]
    total, count = 0.0, 0
    for start in range(0, len(ids), 256):
        window = ids[start : start + 256]
        rows = llm.score(window)
        targets = torch.tensor(window[1:]).unsqueeze(1)
        total -= float(rows.gather(1, targets).sum(dtype=torch.float64))
        count += len(window) - 1
    assert report["num_scored_tokens"] == count
    assert report["num_windows"] == 3
    assert report["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-4)
