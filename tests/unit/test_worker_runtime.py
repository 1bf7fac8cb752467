"""EngineLoop.generate under a worker runtime: a caller that leaves at any point leaves nothing
in the engine, and a duplicate request_id never disturbs the request that owns it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.engine import Engine, EngineStats, RequestOutput
from common.errors import AlreadyExistsError
from services.worker.config import WorkerConfig
from services.worker.runtime import WorkerRuntime
from tests.factories import make_tiny_checkpoint
from tests.polling import settle_async

PROMPT = list(range(3, 40))  # 37 tokens: 3 blocks of 16
PREFILL_ONLY = SamplingParams(max_tokens=8, temperature=0.0)
Generate = Callable[..., AsyncIterator[RequestOutput]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


def tiny_runtime(model_dir: Path) -> WorkerRuntime:
    engine_config = EngineConfig(
        model=str(model_dir), num_kv_blocks=64, block_size=16, device="cpu", dtype="float32"
    )
    return WorkerRuntime(WorkerConfig(role="prefill", engine=engine_config), Engine(engine_config))


async def consume(outputs: AsyncIterator[RequestOutput]) -> None:
    async for _ in outputs:
        pass


async def settled_stats(runtime: WorkerRuntime, timeout_s: float = 3.0) -> EngineStats:
    """Stats once the engine holds and runs nothing (or at the timeout)."""
    return await settle_async(
        runtime.stats,
        lambda stats: not (stats.num_held or stats.num_running or stats.num_waiting),
        timeout_s,
    )


async def cancel_while_adding(runtime: WorkerRuntime, generate: Generate) -> EngineStats:
    """Cancels the consumer while its add waits behind a busy engine thread."""
    runtime.loop.submit(lambda engine: time.sleep(0.3))
    task = asyncio.create_task(consume(generate("r1", PROMPT, PREFILL_ONLY, prefill_only=True)))
    await asyncio.sleep(0.05)  # the add is queued behind the sleep
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return await settled_stats(runtime)


def run_with_runtime(model_dir: Path, body: Callable[[WorkerRuntime], Any]) -> Any:
    async def main() -> Any:
        runtime = tiny_runtime(model_dir)
        await runtime.start(port=0)
        try:
            return await asyncio.wait_for(body(runtime), timeout=60)
        finally:
            await runtime.stop()

    return asyncio.run(main())


def test_cancelled_during_the_add_is_aborted(tiny_dir: Path) -> None:
    stats = run_with_runtime(tiny_dir, lambda rt: cancel_while_adding(rt, rt.loop.generate))
    assert stats.num_held == 0
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total == 64


def test_cancelled_mid_decode_is_aborted(tiny_dir: Path) -> None:
    async def body(runtime: WorkerRuntime) -> tuple[int, EngineStats]:
        sampling = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        received = 0
        async for out in runtime.loop.generate("r1", PROMPT, sampling):
            received += len(out.new_token_ids)
            if received == 3:
                break
        return received, await settled_stats(runtime)

    received, stats = run_with_runtime(tiny_dir, body)
    assert received == 3
    assert stats.num_running == 0
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


def test_a_duplicate_request_id_does_not_abort_the_request_that_owns_it(tiny_dir: Path) -> None:
    async def body(runtime: WorkerRuntime) -> EngineStats:
        await consume(runtime.loop.generate("r1", PROMPT, PREFILL_ONLY, prefill_only=True))
        with pytest.raises(AlreadyExistsError):
            await consume(runtime.loop.generate("r1", PROMPT, PREFILL_ONLY, prefill_only=True))
        await asyncio.sleep(0.2)  # room for a wrongly queued abort to run
        return await runtime.stats()

    stats = run_with_runtime(tiny_dir, body)
    assert stats.num_held == 1  # the first request's KV, still awaiting its lease
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total - 3


def test_a_duplicate_request_id_leaves_the_first_stream_running(tiny_dir: Path) -> None:
    async def body(runtime: WorkerRuntime) -> int:
        sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        first = runtime.loop.generate("r1", PROMPT, sampling)
        received = len((await anext(first)).new_token_ids)
        with pytest.raises(AlreadyExistsError):
            await consume(runtime.loop.generate("r1", PROMPT, sampling))

        async def rest() -> int:
            return sum([len(out.new_token_ids) async for out in first])

        return received + await asyncio.wait_for(rest(), timeout=5)

    assert run_with_runtime(tiny_dir, body) == 12


def test_a_final_output_never_consumed_still_frees_the_held_kv(tiny_dir: Path) -> None:
    """The prefill finishes (its KV held) and the output is on its way, but the consumer is
    cancelled before it takes it: nobody will lease that KV, so it must be released."""

    async def body(runtime: WorkerRuntime) -> EngineStats:
        task = asyncio.create_task(
            consume(runtime.loop.generate("r1", PROMPT, PREFILL_ONLY, prefill_only=True))
        )
        await asyncio.sleep(0)  # the consumer submits its add and waits for the answer
        time.sleep(1.0)  # block the event loop: the engine adds, prefills, dispatches
        assert runtime.engine.held, "the prefill should have finished by now"
        task.cancel()  # before the loop ever hands the output to the consumer
        with pytest.raises(asyncio.CancelledError):
            await task
        return await settled_stats(runtime)

    stats = run_with_runtime(tiny_dir, body)
    assert stats.num_held == 0
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
