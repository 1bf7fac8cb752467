"""What the block store's disk tier buys after a restart: TTFT and prefix hits of the same
long prompts, cold, then after the whole stack (every worker and the block store) was
stopped and started again on the same disk directory, and once more warm.

One ``pdserve up`` stack (1 prefill + 1 decode worker) with a block store whose memory holds
a fraction of the prompts' blocks (``--blockstore-capacity``) and a disk tier; each request
is one of ``--num-prompts`` distinct documents of real English (CPython's pydoc topics,
about ``--prompt-tokens`` tokens each) asking for a few tokens, one at a time. The passes:

- cold: nothing cached anywhere; the prefill worker computes every prompt, and the block
  store writes its blocks behind to memory and disk;
- restarted: ``pdserve down``, then ``pdserve up`` on the same directory: worker caches and
  the store's memory are empty; the store reindexes its files and republishes them, so the
  prefill worker loads each prompt's blocks from the store (from disk) instead of computing;
- warm: the same prompts again on the restarted stack (worker caches hold them now).

A memory-only block store, restarted, is the cold pass again (nothing survives). The table
gives TTFT p50 per pass, the paired per-prompt ratio to cold, and the prompt tokens served
from cache (usage.cached_tokens).

    .venv/bin/python -m loadtest.bench_disk_tier
    .venv/bin/python -m loadtest.bench_disk_tier --num-prompts 4   # a quick check

Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.bench_llamacpp import OtherWork, log, noise_note, pdserve_stack


@dataclass
class Timed:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    text: str


def documents(num: int, tokens: int) -> list[str]:
    """``num`` distinct passages of real English, about ``tokens`` tokens each."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics))
    words = text.split()
    per = int(tokens * 0.7)  # about 1.4 tokens a word in this text
    assert len(words) >= num * per, "not enough text"
    return [" ".join(words[i * per : (i + 1) * per]) for i in range(num)]


async def one_pass(target: str, prompts: list[str], max_tokens: int) -> list[Timed]:
    from common.contract.sampling import SamplingParams
    from pdserve.client import GatewayClient

    client = GatewayClient(target)
    results = []
    try:
        for prompt in prompts:
            start = time.perf_counter()
            first = None
            prompt_tokens = cached = 0
            text = ""
            sampling = SamplingParams(max_tokens=max_tokens)
            async for message in client.stream(prompt=prompt, sampling=sampling):
                if message.token_ids and first is None:
                    first = time.perf_counter()
                text += message.text
                if message.HasField("usage"):
                    prompt_tokens = message.usage.prompt_tokens
                    cached = message.usage.cached_tokens
            assert first is not None, "a request ended without a token"
            results.append(Timed(first - start, prompt_tokens, cached, text))
    finally:
        await client.close()
    return results


def settle(directory: Path, quiet_s: float = 3.0, limit_s: float = 120.0) -> int:
    """Waits until the disk tier's files stop growing (the write-behind caught up)."""
    deadline = time.monotonic() + limit_s
    size, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = sum(p.stat().st_size for p in directory.glob("seg-*.pdkv"))
        if now != size:
            size, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.5)
    return size


def stack_pids(run_dir: Path) -> list[int]:
    from pdserve.cli.launcher import StackState

    state = StackState.load(run_dir / "stack.json")
    return [c.pid for c in state.children if c.pid] if state else []


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.result_dir or tempfile.mkdtemp(prefix="disk-tier-"))
    out.mkdir(parents=True, exist_ok=True)
    disk = out / "kv"
    up = [*shlex.split(args.up_args), "--blockstore-capacity", args.blockstore_capacity,
          "--blockstore-disk-dir", str(disk), "--blockstore-disk-capacity", "4GiB"]  # fmt: skip
    prompts = documents(args.num_prompts, args.prompt_tokens)
    passes: dict[str, list[Timed]] = {}
    noise: dict[str, float] = {}
    with pdserve_stack(out / "stack-1", up) as (target, _env):
        asyncio.run(one_pass(target, ["Warm up the stack."] * 2, args.max_tokens))
        with OtherWork(stack_pids(out / "stack-1")) as meter:
            passes["cold"] = asyncio.run(one_pass(target, prompts, args.max_tokens))
        noise["cold"] = meter.fraction
        written = settle(disk)
    log(f"  disk tier after the cold pass and a clean stop: {written / 2**20:.1f} MiB")
    with pdserve_stack(out / "stack-2", up) as (target, _env):
        asyncio.run(one_pass(target, ["Warm up the stack."] * 2, args.max_tokens))
        with OtherWork(stack_pids(out / "stack-2")) as meter:
            passes["restarted"] = asyncio.run(one_pass(target, prompts, args.max_tokens))
        noise["restarted"] = meter.fraction
        with OtherWork(stack_pids(out / "stack-2")) as meter:
            passes["warm"] = asyncio.run(one_pass(target, prompts, args.max_tokens))
        noise["warm"] = meter.fraction

    cold = passes["cold"]
    summary: dict[str, Any] = {"num_prompts": len(prompts), "disk_bytes": written}
    lines = [f"{'pass':<10} {'TTFT p50':>9} {'paired ratio to cold':>21} "
             f"{'cached / prompt tokens':>24}  same output as cold"]  # fmt: skip
    for name, results in passes.items():
        ttft = statistics.median(r.ttft_s for r in results) * 1000
        ratio = statistics.median(
            r.ttft_s / c.ttft_s for r, c in zip(results, cold, strict=True)
        )
        cached = sum(r.cached_tokens for r in results)
        total = sum(r.prompt_tokens for r in results)
        same = sum(r.text == c.text for r, c in zip(results, cold, strict=True))
        summary[name] = {"ttft_p50_ms": ttft, "ttft_ratio_to_cold": ratio,
                         "cached_tokens": cached, "prompt_tokens": total,
                         "same_output": same, "other_work": noise[name]}  # fmt: skip
        lines.append(f"{name:<10} {ttft:>7.1f}ms {ratio:>21.3f} {cached:>11}/{total:<12} "
                     f"{same}/{len(results)}{noise_note(noise[name])}")  # fmt: skip
    table = "\n".join(lines)
    log("\n" + table)
    (out / "disk_tier.json").write_text(json.dumps(summary, indent=2))
    (out / "disk_tier.txt").write_text(table + "\n")
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--up-args", default="--kv-cache-memory 512MiB",
                        help="more pdserve up flags, one string")  # fmt: skip
    parser.add_argument("--blockstore-capacity", default="64MiB",
                        help="the store's memory: a fraction of the prompts' blocks")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--result-dir", default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
