"""Speculative decoding (prompt lookup) against none, both arms in one process, same run.

Workloads, each a list of chat prompts for the default model (SmolLM2-135M-Instruct):

- ``copy``: copy-heavy traffic. A document in the prompt and a request to quote it or edit
  it (repeat, fix a word, turn it into a list), and multi-turn chat whose last turn asks
  for an earlier answer again: the output repeats text the context holds.
- ``chat``: open chat, questions whose answers the context does not contain.
- ``agentic``: an agent's traffic. Tool calls: a system prompt lists tools as JSON, each task
  asks for the next call as JSON, some after earlier calls and their results in the
  conversation; and code edits: one Python file, each request asks for one change and the
  whole file back. Answers repeat structure across requests (the same JSON shape, the same
  file), which a suffix tree over past responses can guess (``"method": "suffix"``).

For each workload and concurrency (1: one request at a time; 16: sixteen at once, the
prompts cycled) both engines run the same requests greedily, in alternating rounds
(``--rounds``) so that a machine whose speed drifts moves both arms alike. Printed per
cell: TPOT (mean over requests of (last token - first token) / (tokens - 1)), output tok/s
(all tokens / wall time of the round), for the speculating arm the acceptance rate (kept
/ proposed) and mean acceptance length (tokens per verify round, the bonus included), and
the ratios none / speculation (TPOT) and speculation / none (tok/s); medians over rounds.
Outputs are checked identical between the arms (greedy).

Run it on a quiet machine:

    .venv/bin/python -m loadtest.bench_spec [--threads 2] [--rounds 3] [--max-tokens 128]
        [--speculative-config JSON] [--concurrency 1,16] [--json out.json]
    # suffix decoding (the global tree carries each round's answers into the next)
    .venv/bin/python -m loadtest.bench_spec --speculative-config \
        '{"method": "suffix", "num_speculative_tokens": 16, "suffix_decoding_max_spec_factor": 2}'
    # self-speculation: the float32 target drafted by its own GGUF
    .venv/bin/python -m loadtest.bench_spec --quantization none --workloads chat \
        --speculative-config '{"method": "draft_model", "model": "'$HOME/.cache/pdserve/models/SmolLM2-135M-Instruct'", "quantization": "gguf", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field

import common.openmp  # noqa: F401  (before torch, run as a script too: OpenMP's wait policy)

# isort: split
import torch

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.llm import LLM
from common.models.default_model import resolve_model
from tests.prompts import QUESTIONS, passage

DEFAULT_SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 8, '
    '"prompt_lookup_min": 2}'
)

_DOC = (
    "Release notes, version 2.4. The scheduler now admits requests in arrival order and "
    "preempts the newest one when memory runs out. Prefix caching is on by default. The "
    "block store keeps evicted blocks for an hour. Metrics are exported under the pdserve "
    "prefix. The command line gained a status command that lists every worker."
)


def copy_prompts() -> list[list[dict[str, str]]]:
    docs = [_DOC, passage(5, offset=1), passage(4, offset=6)]
    chats: list[list[dict[str, str]]] = []
    for doc in docs:
        chats.append([{"role": "user", "content": f"{doc}\n\nRepeat the text above exactly."}])
        chats.append([{"role": "user", "content": f"Fix the spelling in this text and return "
                       f"all of it:\n\n{doc.replace('the', 'teh', 2)}"}])  # fmt: skip
        chats.append([{"role": "user", "content": f"Quote the text below word for word, as a "
                       f"numbered list of its sentences.\n\n{doc}"}])  # fmt: skip
        chats.append([
            {"role": "user", "content": "Write a note for the team about the release."},
            {"role": "assistant", "content": doc},
            {"role": "user", "content": "Send me that note again, exactly as before."},
        ])  # fmt: skip
    return chats


def chat_prompts() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


_TOOLS = (
    'You can call these tools. Answer with one JSON object {"name": ..., "arguments": {...}} '
    "and nothing else.\n"
    '{"name": "get_weather", "description": "Current weather of a city", "parameters": '
    '{"city": "string", "unit": "celsius or fahrenheit"}}\n'
    '{"name": "search_flights", "description": "Flights between two cities on a date", '
    '"parameters": {"origin": "string", "destination": "string", "date": "YYYY-MM-DD"}}\n'
    '{"name": "send_email", "description": "Send an email", "parameters": {"to": "string", '
    '"subject": "string", "body": "string"}}'
)
_TASKS = [
    "What is the weather in Paris right now, in celsius?",
    "Is it cold in Oslo today? Use fahrenheit.",
    "Find me a flight from Berlin to Rome on 2026-03-14.",
    "Find flights from Madrid to Lisbon on 2026-05-02.",
    "Email bob@example.com that the meeting moved to Friday.",
    "Tell alice@example.com the report is ready, subject Report.",
]
_FILE = '''import json
from pathlib import Path


def load_config(path):
    with open(path) as f:
        return json.load(f)


def save_config(path, config):
    Path(path).write_text(json.dumps(config, indent=2))


def merge(base, override):
    result = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = value
    return result
'''
_EDITS = [
    "Rename the function merge to deep_merge everywhere.",
    "Add a docstring to load_config.",
    "Add type hints to save_config.",
    "Make load_config return an empty dict when the file does not exist.",
]


def agentic_prompts() -> list[list[dict[str, str]]]:
    chats: list[list[dict[str, str]]] = []
    for task in _TASKS:
        chats.append([{"role": "system", "content": _TOOLS}, {"role": "user", "content": task}])
    # The next call after an earlier one and its result: the same shapes again.
    chats.append([
        {"role": "system", "content": _TOOLS},
        {"role": "user", "content": "Check the weather in Rome, then email it to bob@example.com."},
        {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "Rome", '
                                         '"unit": "celsius"}}'},
        {"role": "user", "content": 'Tool result: {"temperature": 17, "sky": "clear"}'},
    ])  # fmt: skip
    for edit in _EDITS:
        chats.append([{"role": "user", "content": f"{_FILE}\n{edit} Return the whole file."}])
    return chats


@dataclass
class Round:
    tpot_ms: float
    tok_s: float
    outputs: list[list[int]]
    proposed: int = 0
    kept: int = 0
    rounds: int = 0


@dataclass
class Cell:
    none: list[Round] = field(default_factory=list)
    spec: list[Round] = field(default_factory=list)


def run_round(llm: LLM, prompts: list[list[int]], concurrency: int, max_tokens: int) -> Round:
    engine = llm.engine
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    stats_before = engine.spec_stats.copy()
    outputs: dict[str, list[int]] = {}
    stamps: dict[str, list[float]] = {}
    start = time.perf_counter()
    pending = list(enumerate(prompts))
    running: set[str] = set()
    while pending or running:
        while pending and len(running) < concurrency:
            i, ids = pending.pop(0)
            rid = f"b{i}-{time.perf_counter_ns()}"
            engine.add_request(rid, ids, sampling)
            running.add(rid)
            outputs[rid] = []
            stamps[rid] = []
        for out in engine.step():
            if out.new_token_ids:
                outputs[out.request_id] += out.new_token_ids
                stamps[out.request_id] += [time.perf_counter()] * len(out.new_token_ids)
            if out.finished:
                running.discard(out.request_id)
    wall = time.perf_counter() - start
    tpots = [
        (s[-1] - s[0]) / (len(s) - 1) * 1000 for s in stamps.values() if len(s) > 1
    ]
    after = engine.spec_stats
    return Round(
        tpot_ms=statistics.mean(tpots),
        tok_s=sum(len(o) for o in outputs.values()) / wall,
        outputs=list(outputs.values()),
        proposed=after.num_draft_tokens - stats_before.num_draft_tokens,
        kept=after.num_accepted_tokens - stats_before.num_accepted_tokens,
        rounds=after.num_drafts - stats_before.num_drafts,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--speculative-config", default=DEFAULT_SPEC)
    parser.add_argument("--workloads", default="copy,chat,agentic")
    parser.add_argument(
        "--quantization", default=None,
        help="the target's weight format (default: auto); with a draft_model config in "
        "another format, self-speculation, e.g. none drafted by gguf",
    )  # fmt: skip
    parser.add_argument("--json", default=None, help="write every round's figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model(None)  # converted (and its GGUF linked) on first use
    quant = {"quantization": args.quantization} if args.quantization else {}
    none = LLM(EngineConfig(model=model, num_threads=args.threads, **quant))
    spec = LLM(EngineConfig(model=model, num_threads=args.threads, **quant,
                            speculative_config=args.speculative_config))  # fmt: skip
    workloads = {"copy": copy_prompts, "chat": chat_prompts, "agentic": agentic_prompts}
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    print(f"speculation: {args.speculative_config}; {args.threads} threads, "
          f"{args.max_tokens} tokens at most, greedy, {args.rounds} rounds", flush=True)  # fmt: skip
    cells: dict[tuple[str, int], Cell] = {}
    for name in args.workloads.split(","):
        chats = workloads[name]()
        encoded = [none.tokenizer.encode_chat(c) for c in chats]
        for concurrency in concurrencies:
            prompts = encoded if concurrency == 1 else [
                encoded[i % len(encoded)] for i in range(max(16, len(encoded)))]  # fmt: skip
            run_round(none, prompts[:2], concurrency, 8)  # warm both arms
            run_round(spec, prompts[:2], concurrency, 8)
            cell = cells[(name, concurrency)] = Cell()
            for r in range(args.rounds):
                arms = [("none", none, cell.none), ("spec", spec, cell.spec)]
                for _, llm, rounds in arms if r % 2 == 0 else arms[::-1]:
                    rounds.append(run_round(llm, prompts, concurrency, args.max_tokens))
                if cell.none[-1].outputs != cell.spec[-1].outputs:
                    raise SystemExit(f"{name} c{concurrency}: outputs differ between the arms")
            print(report_line(name, concurrency, cell), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({f"{k[0]}-c{k[1]}": {arm: [vars(r) | {"outputs": None} for r in rounds]
                       for arm, rounds in (("none", c.none), ("spec", c.spec))}
                       for k, c in cells.items()}, f, indent=1)  # fmt: skip


def report_line(name: str, concurrency: int, cell: Cell) -> str:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    tpot_none, tpot_spec = med([r.tpot_ms for r in cell.none]), med([r.tpot_ms for r in cell.spec])
    toks_none, toks_spec = med([r.tok_s for r in cell.none]), med([r.tok_s for r in cell.spec])
    proposed = sum(r.proposed for r in cell.spec)
    kept = sum(r.kept for r in cell.spec)
    rounds = sum(r.rounds for r in cell.spec)
    rate = kept / proposed if proposed else 0.0
    length = 1 + kept / rounds if rounds else 1.0
    return (f"{name:<5} c{concurrency:<3} TPOT {tpot_none:6.2f} -> {tpot_spec:6.2f} ms "
            f"({tpot_none / tpot_spec:4.2f}x)  tok/s {toks_none:6.1f} -> {toks_spec:6.1f} "
            f"({toks_spec / toks_none:4.2f}x)  accepted {rate:5.1%}, mean length {length:4.2f}, "
            f"{rounds} verify rounds; outputs identical")  # fmt: skip


if __name__ == "__main__":
    main()
