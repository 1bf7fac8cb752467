"""Suffix decoding through a real stack: ``pdserve up --speculative-config '{"method":
"suffix", ...}'`` on both decode workers, SmolLM2 in its default weight format, copy-heavy
prompts. Greedy output equals the plain engine's; a second round of the same tenant's
prompts is guessed from the first round's answers (the decode workers' global trees); and a
decode worker SIGKILLed mid-stream loses and repeats nothing (a migrated stream's tree is
rebuilt from its tokens on the survivor)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.engine.llm import LLM
from pdserve.client import GatewayClient, RemoteCompletion, collect
from tests.integration.conftest import Stack, up_stack
from tests.integration.test_decode_migration import SHORT_PUT_EXPIRY
from tests.integration.test_speculative_stack import (
    GREEDY,
    PROMPTS,
    _spec_counters,
    llm,  # noqa: F401  (the module's fixture: the plain engine)
    sigkill_mid_stream,
)

pytest.importorskip("arctic_inference.suffix_decoding", reason="scripts/setup.sh builds it")
pytestmark = pytest.mark.slow

SUFFIX = ('{"method": "suffix", "num_speculative_tokens": 8, "adaptive": false, '
          '"suffix_decoding_max_spec_factor": 2}')  # fmt: skip


@pytest.fixture(scope="module")
def spec_stack(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with up_stack(
        smollm_dir, tmp_path_factory, "suffix", "--kv-cache-memory", "256MiB",
        "--speculative-config", SUFFIX, "--drain-grace-s", "1", *SHORT_PUT_EXPIRY,
        env_drop=("PDSERVE_METRICS_PORT",),
    ) as stack:  # fmt: skip
        yield stack


def _round(stack: Stack, salt: str) -> list[RemoteCompletion]:
    async def one(client: GatewayClient, prompt: str) -> RemoteCompletion:
        result = RemoteCompletion()
        async for message in client.stream(prompt=prompt, sampling=GREEDY, cache_salt=salt):
            collect(result, message)
        return result

    async def run() -> list[RemoteCompletion]:
        client = GatewayClient(stack.target)
        try:
            return list(await asyncio.gather(*(one(client, p) for p in PROMPTS)))
        finally:
            await client.close()

    return asyncio.run(run())


def test_greedy_output_through_a_suffix_stack_is_the_plain_engines(
    spec_stack: Stack,
    llm: LLM,  # noqa: F811
) -> None:
    want = llm.generate(PROMPTS, GREEDY)
    kept = []
    for round_ in range(2):
        before = _spec_counters(spec_stack)
        got = _round(spec_stack, "tenant-suffix")
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids, round_
            assert g.text == w.text
        proposed, accepted = (
            a - b for a, b in zip(_spec_counters(spec_stack), before, strict=True)
        )
        print(f"round {round_}: {accepted:.0f} of {proposed:.0f} guesses kept")
        kept.append(accepted)
    assert kept[0] > 0  # the prompts' own text, copied
    assert kept[1] >= kept[0]  # and the first round's answers beside it


def test_sigkill_of_a_suffix_decoding_worker_loses_and_repeats_nothing(
    spec_stack: Stack,
    llm: LLM,  # noqa: F811
) -> None:
    sigkill_mid_stream(spec_stack, llm)
