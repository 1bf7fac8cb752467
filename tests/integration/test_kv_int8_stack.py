"""int8 KV disaggregated (issue 18, item 3): ``pdserve up --kv-dtype int8`` with a prefill
and a decode worker and a block store with a disk tier. The KV moves with its scales
(KvLayout.scales_offset_bytes): over KvTransferService, into the block store and onto its
disk. Greedy output through the stack equals the in-process engine with the same KV dtype;
a pulled block is a quarter of float32's bytes plus its scales; the store's blocks, and
after a restart of the store its disk's, are the in-process engine's codes and scales,
bit for bit."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.llm import LLM
from common.kv.block_store_client import BlockStoreClient
from common.kv.hashing import hash_prompt_blocks
from common.kv.layout import KvLayout
from common.telemetry.metrics import scrape
from pdserve.client import GatewayClient, RemoteCompletion, collect
from tests.integration.conftest import Stack, up_stack
from tests.polling import settle
from tests.prompts import prompt_with_context

pytestmark = pytest.mark.slow

PROMPTS = [prompt_with_context(8, i) for i in range(3)]  # about 130 tokens: remote prefill
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def int8_stack(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    disk = tmp_path_factory.mktemp("int8-disk")
    with up_stack(
        smollm_dir, tmp_path_factory, "int8", "--prefill", "1", "--decode", "1",
        "--kv-dtype", "int8", "--kv-cache-memory", "128MiB", "--blockstore-disk-dir", str(disk),
        "--blockstore-disk-capacity", "64MiB", env_drop=("PDSERVE_METRICS_PORT",),
    ) as stack:  # fmt: skip
        yield stack


@pytest.fixture(scope="module")
def llm(smollm_dir: Path) -> LLM:
    return LLM(EngineConfig(model=str(smollm_dir), kv_dtype="int8", num_kv_blocks=64))


def complete_in_order(
    stack: Stack, prompts: list[str], sampling: SamplingParams = GREEDY, salt: str = "int8"
) -> list[RemoteCompletion]:
    """Streams the prompts through the stack's gateway one after another, each under the
    cache salt ``{salt}-{i}``."""

    async def run() -> list[RemoteCompletion]:
        client = GatewayClient(stack.target)
        results = []
        try:
            for i, prompt in enumerate(prompts):
                result = RemoteCompletion()
                async for message in client.stream(prompt=prompt, sampling=sampling,
                                                   cache_salt=f"{salt}-{i}"):  # fmt: skip
                    collect(result, message)
                results.append(result)
        finally:
            await client.close()
        return results

    return asyncio.run(run())


def test_int8_kv_through_the_stack_equals_the_engine_and_moves_a_quarter(
    int8_stack: Stack, llm: LLM
) -> None:
    stack = int8_stack
    decode_url = stack.children()["decode-0"].metrics_url
    assert decode_url
    before = scrape(decode_url)
    remote = complete_in_order(stack, PROMPTS)
    local = llm.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in remote] == [c.token_ids for c in local]

    after = scrape(decode_url)
    name = "pdserve:kv_transfer_bytes_total"
    received = after.sum(name, peer="producer") - before.sum(name, peer="producer")
    blocks = after.sum("pdserve:kv_transfer_blocks_total", peer="producer") - before.sum(
        "pdserve:kv_transfer_blocks_total", peer="producer"
    )
    assert blocks >= 3 * 8  # every prompt's KV was pulled from the prefill worker
    layout = layout_of(llm.engine)
    float32 = KvLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                       layout.block_size, torch.float32)  # fmt: skip
    scales = layout.num_layers * 2 * layout.num_kv_heads * 4
    assert received / blocks == layout.bytes_per_block == float32.bytes_per_block // 4 + scales


def test_the_block_store_and_its_disk_keep_the_codes_and_their_scales(
    int8_stack: Stack, llm: LLM
) -> None:
    stack = int8_stack
    prompt = prompt_with_context(10, 7)
    complete_in_order(stack, [prompt])
    ids = llm.encode(prompt)
    layout = layout_of(llm.engine)
    hashes = hash_prompt_blocks(ids, layout.block_size, "int8-0",
                                seed=llm.engine.config.hash_seed,
                                weights=llm.engine.weight_identity)  # fmt: skip
    num_full = len(ids) // layout.block_size
    # The in-process engine's blocks of the same prompt and salt, exported.
    engine = llm.engine
    engine.add_request("x", ids, SamplingParams(max_tokens=2), cache_salt="int8-0",
                       prefill_only=True)  # fmt: skip
    for _ in range(8):
        if "x" in engine.held:
            break
        engine.step()
    want = engine.export_kv("x").data[:num_full]
    engine.release("x")
    store_address = stack.children()["blockstore"].address

    async def stored() -> torch.Tensor:
        client = BlockStoreClient(store_address, stack.model_dir.name, layout)
        try:
            return await client.get(hashes[:num_full], timeout_s=10)
        finally:
            await client.close()

    def fetch() -> torch.Tensor | None:
        try:
            return asyncio.run(stored())
        except Exception:
            return None  # the prefill worker's write-behind is not in yet

    got = settle(fetch, lambda data: data is not None, 15.0, 0.2)
    assert got is not None and torch.equal(got, want)
    restarted = stack.cli("restart", "blockstore", timeout=300)
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    from_disk = settle(fetch, lambda data: data is not None, 15.0, 0.2)
    assert from_disk is not None and torch.equal(from_disk, want)


def layout_of(engine: Engine) -> KvLayout:
    """The engine's blocks on the wire, as a worker describes them."""
    spec = engine.spec
    return KvLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, engine.block_size,
                    engine.runner.kv_dtype)  # fmt: skip
