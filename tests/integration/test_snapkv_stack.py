"""SnapKV disaggregated (issue 18, item 4): ``pdserve up --kv-compression snapkv`` with a
prefill and a decode worker. The prefill worker compresses each long prompt and leases only
the kept blocks (KvHandle.kept_block_indices); the decode worker pulls exactly those and
decodes the tokens the in-process engine with the same compression decodes. A request's own
sampling.kv_compression wins over the worker default, and a budget with no room is
INVALID_ARGUMENT at the gateway."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.contract.eviction import KvCompression
from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.llm import LLM
from common.telemetry.metrics import scrape
from pdserve.client import RemoteCompletion
from tests.integration.conftest import Stack, up_stack
from tests.integration.test_kv_int8_stack import complete_in_order, layout_of
from tests.prompts import prompt_with_context

pytestmark = pytest.mark.slow

BUDGET = 256  # tokens: 16 blocks of 16
PROMPTS = [prompt_with_context(40, i) for i in range(2)]  # about 600 tokens each
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def snap_stack(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with up_stack(
        smollm_dir, tmp_path_factory, "snapkv", "--prefill", "1", "--decode", "1",
        "--kv-compression", "snapkv", "--snapkv-budget-tokens", str(BUDGET),
        "--kv-cache-memory", "128MiB", env_drop=("PDSERVE_METRICS_PORT",),
    ) as stack:  # fmt: skip
        yield stack


@pytest.fixture(scope="module")
def llm(smollm_dir: Path) -> LLM:
    return LLM(EngineConfig(model=str(smollm_dir), kv_compression="snapkv",
                            snapkv_budget_tokens=BUDGET, num_kv_blocks=128))  # fmt: skip


def _pulled(stack: Stack, run: object) -> tuple[float, float]:
    """Blocks and bytes the decode worker pulled from the prefill worker during ``run()``."""
    url = stack.children()["decode-0"].metrics_url
    assert url
    before = scrape(url)
    run()  # type: ignore[operator]
    after = scrape(url)
    blocks = after.sum("pdserve:kv_transfer_blocks_total", peer="producer") - before.sum(
        "pdserve:kv_transfer_blocks_total", peer="producer"
    )
    num_bytes = after.sum("pdserve:kv_transfer_bytes_total", peer="producer") - before.sum(
        "pdserve:kv_transfer_bytes_total", peer="producer"
    )
    return blocks, num_bytes


def test_the_decode_worker_pulls_the_kept_blocks_and_decodes_as_the_engine(
    snap_stack: Stack, llm: LLM
) -> None:
    lengths = [len(llm.encode(p)) for p in PROMPTS]
    assert all(n > 2 * BUDGET for n in lengths), lengths
    prefill_url = snap_stack.children()["prefill-0"].metrics_url
    assert prefill_url
    before = scrape(prefill_url)
    remote: list[RemoteCompletion] = []
    blocks, num_bytes = _pulled(
        snap_stack, lambda: remote.extend(complete_in_order(snap_stack, PROMPTS, GREEDY, "snap"))
    )
    local = llm.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in remote] == [c.token_ids for c in local]
    assert llm.engine.num_compressed == len(PROMPTS)
    # Each prompt moved its 16 kept blocks, not its ~38.
    assert blocks == len(PROMPTS) * BUDGET // 16
    assert num_bytes == blocks * layout_of(llm.engine).bytes_per_block
    # The prefill worker counts what it kept and dropped.
    after = scrape(prefill_url)

    def counted(name: str) -> float:
        return after.sum(f"pdserve:snapkv_{name}_total") - before.sum(
            f"pdserve:snapkv_{name}_total"
        )

    assert counted("prompts_compressed") == len(PROMPTS)
    assert counted("blocks_kept") == blocks
    assert counted("blocks_dropped") == sum(-(-n // 16) for n in lengths) - blocks


def test_a_requests_own_budget_wins_and_a_bad_one_is_refused(snap_stack: Stack, llm: LLM) -> None:
    mine = KvCompression(budget_tokens=384, window_tokens=16)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True, kv_compression=mine)
    remote: list[RemoteCompletion] = []
    blocks, _ = _pulled(
        snap_stack,
        lambda: remote.extend(complete_in_order(snap_stack, PROMPTS[:1], sampling, "own")),
    )
    (local,) = llm.generate(PROMPTS[:1], sampling)
    assert remote[0].token_ids == local.token_ids
    assert blocks == 384 // 16

    bad = SamplingParams(max_tokens=4, kv_compression=KvCompression(budget_tokens=32))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        complete_in_order(snap_stack, PROMPTS[:1], bad, "bad")
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.kv_compression.budget_tokens" in (caught.value.details() or "")
