"""Would syncing suffix decoding's global tree across decode workers pay? A model-free replay.

Each decode worker keeps its own global trees of past responses
(common/engine/speculative/suffix.py). With N workers a request's worker has seen about 1/N
of the fleet's responses; a tree synced across the fleet (through Redis or the block
store) would hold them all, at best as if one worker had served everything. What the trees
can gain does not depend on the model's speed: with greedy decoding a verify keeps exactly
the guesses that match the request's real continuation. So this replays real greedy
outputs (bench_spec's workloads through the engine, made once and cached) through
SuffixProposers as N workers would see them, and counts per verify step the tokens a step
yields (the matching guesses plus the verify's own) with every guess verified: the bound
that the adaptive policy then trims by what rows cost.

- Fleet: ``--workers`` decode workers (1 = one tree over everything = a fleet whose trees
  are synced, at best); requests are dealt round-robin (the gateway balances load; its
  prefix-affinity routing would keep more of one workload on one worker, so round-robin
  is the split's worst case).
- Timing: ``--concurrency`` requests run at once in lockstep, one step each per round;
  every verified token enters its worker's trees as it is made, as on a worker.
- Order: each workload's requests in bench_spec's order (fresh prompts, variants in turn).

Printed per workload and fleet size: tokens per step, guesses kept / proposed, and how much
of the tokens a synced fleet makes per step a split fleet keeps. Also the cost of a sync:
the microseconds per token to put a response into a tree (each worker would pay it for
every response of the fleet).

    .venv/bin/python -m loadtest.sim_suffix_fleet [--workers 1,2,4] [--concurrency 16]
        [--requests 64] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.contract.sampling import SamplingParams
from common.engine.request import Request
from common.engine.speculative.config import SpeculativeConfig

DEFAULT_SPEC = {"method": "suffix", "num_speculative_tokens": 16,
                "suffix_decoding_max_spec_factor": 2}  # fmt: skip
CACHE_DIR = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


@dataclass
class Record:
    prompt: list[int]
    output: list[int]


@dataclass
class Replay:
    steps: int = 0
    tokens: int = 0
    proposed: int = 0
    kept: int = 0
    seconds_in_trees: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


def replay(
    records: Sequence[Record], workers: int, concurrency: int, spec: dict | None = None
) -> Replay:
    """Runs ``records`` through ``workers`` SuffixProposers, ``concurrency`` at a time in
    lockstep, every guess verified against the record's real output (greedy)."""
    from common.engine.speculative.suffix import SuffixProposer

    config = SpeculativeConfig.from_dict(spec or DEFAULT_SPEC)
    proposers = [SuffixProposer(config) for _ in range(workers)]
    sampling = SamplingParams(max_tokens=1 << 20, temperature=0.0)
    pending = deque(enumerate(records))
    running: list[tuple[Request, Record, int]] = []
    result = Replay()
    while pending or running:
        while pending and len(running) < concurrency:
            i, rec = pending.popleft()
            # The first output token comes with the prompt (the prefill's): no guess.
            req = Request(f"r{i}", rec.prompt, sampling, cache_salt="tenant",
                          output_token_ids=rec.output[:1])  # fmt: skip
            running.append((req, rec, i % workers))
            result.tokens += min(1, len(rec.output))
        still = []
        for req, rec, w in running:
            done = req.num_output_tokens
            left = len(rec.output) - done
            if left > 0:
                started = time.perf_counter()
                guesses = proposers[w].propose(req, min(config.num_speculative_tokens, left - 1))
                result.seconds_in_trees += time.perf_counter() - started
                truth = rec.output[done:]
                n = 0
                while n < len(guesses) and guesses[n] == truth[n]:
                    n += 1
                req.token_ids += truth[: n + 1]
                result.steps += 1
                result.tokens += n + 1
                result.proposed += len(guesses)
                result.kept += n
                left -= n + 1
            if left > 0:
                still.append((req, rec, w))
            else:
                proposers[w].forget(req.request_id)
        running = still
    return result


def insert_cost_us(records: Sequence[Record]) -> float:
    """Microseconds per token to put the records' responses into a global tree."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    depth = SpeculativeConfig.from_dict(DEFAULT_SPEC).suffix_decoding_max_tree_depth
    cache = SuffixDecodingCache(depth, -1)
    tokens = 0
    started = time.perf_counter()
    for i, rec in enumerate(records):
        cache.start_request(i, rec.prompt)
        cache.add_active_response(i, rec.output)
        cache.stop_request(i)
        tokens += len(rec.output)
    return (time.perf_counter() - started) * 1e6 / max(tokens, 1)


def make_records(workload: str, requests: int, max_tokens: int, threads: int) -> list[Record]:
    """bench_spec's prompts of ``workload`` (its variants in turn) and the engine's greedy
    outputs for them, at concurrency 16; cached under ~/.cache/pdserve/sim_suffix_fleet."""
    from loadtest import bench_spec

    chats = []
    for _, _, round_chats in bench_spec.plan(workload, [16], rounds=(requests + 15) // 16):
        chats += round_chats
    chats = chats[:requests]
    key = hashlib.sha256(json.dumps([chats, max_tokens]).encode()).hexdigest()[:16]
    path = CACHE_DIR / "sim_suffix_fleet" / f"{workload}-{key}.json"
    if path.exists():
        return [Record(**r) for r in json.loads(path.read_text())]
    import torch

    from common.engine.config import EngineConfig
    from common.engine.llm import LLM
    from common.models.default_model import resolve_model

    torch.set_num_threads(threads)
    llm = LLM(EngineConfig(model=resolve_model(None), num_threads=threads))
    prompts = [llm.tokenizer.encode_chat(c) for c in chats]
    outputs = bench_spec.run_round(llm, prompts, 16, max_tokens).outputs
    records = [Record(p, o) for p, o in zip(prompts, outputs, strict=True)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([vars(r) for r in records]))
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="copy,chat,agentic")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64, help="per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC))
    args = parser.parse_args()
    spec = json.loads(args.speculative_config)
    fleets = [int(w) for w in args.workers.split(",")]
    print(f"speculation {json.dumps(spec)}; {args.requests} requests a workload, "
          f"{args.concurrency} at once, round-robin over the workers, every guess verified")  # fmt: skip
    for workload in args.workloads.split(","):
        records = make_records(workload, args.requests, args.max_tokens, args.threads)
        results = {n: replay(records, n, args.concurrency, spec) for n in fleets}
        whole = results[min(fleets)].tokens_per_step
        for n, r in results.items():
            share = r.tokens_per_step / whole if whole else 0.0
            rate = r.kept / r.proposed if r.proposed else 0.0
            print(f"{workload:<8} workers {n}: {r.tokens_per_step:5.2f} tokens a step "
                  f"({share:5.1%} of {min(fleets)} worker's), kept {r.kept}/{r.proposed} "
                  f"({rate:5.1%}), {r.steps} steps for {r.tokens} tokens")  # fmt: skip
        print(f"{workload:<8} a response into a tree: {insert_cost_us(records):.2f} us a token")


if __name__ == "__main__":
    main()
