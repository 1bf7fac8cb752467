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

For each workload and concurrency (1: one request at a time; 16: sixteen at once) both
engines run the same requests greedily, in alternating rounds (``--rounds``) so that a
machine whose speed drifts moves both arms alike. Each round's prompts are new to the run:
a global tree over past responses sees what real traffic would share (sentence parts, the
tools' JSON shapes, the file under edit), never the same request answered before. Printed per
cell: TPOT (mean over requests of (last token - first token) / (tokens - 1)), output tok/s
(all tokens / wall time of the round), for the speculating arm the acceptance rate (kept
/ proposed) and mean acceptance length (tokens per verify round, the bonus included), and
the ratios none / speculation (TPOT) and speculation / none (tok/s); medians over rounds.
Outputs are checked identical between the arms (greedy).

Run it on a quiet machine:

    .venv/bin/python -m loadtest.bench_spec [--threads 2] [--rounds 3] [--max-tokens 128]
        [--speculative-config JSON] [--concurrency 1,16] [--json out.json]
    # suffix decoding (the global tree carries what earlier rounds answered into the next)
    .venv/bin/python -m loadtest.bench_spec --speculative-config \
        '{"method": "suffix", "num_speculative_tokens": 16, "suffix_decoding_max_spec_factor": 2}'
    # self-speculation: the float32 target drafted by its own GGUF
    .venv/bin/python -m loadtest.bench_spec --quantization none --workloads chat \
        --speculative-config '{"method": "draft_model", "model": "'$HOME/.cache/pdserve/models/SmolLM2-135M-Instruct'", "quantization": "gguf", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
import random
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

DEFAULT_SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 8, '
    '"prompt_lookup_min": 2}'
)

# Every round gets prompts no earlier round (of any cell of the run) had: with a global
# tree over past responses ("method": "suffix") a repeated prompt would be answered from
# the tree word for word, which real traffic does not do. What stays common across
# requests is what real traffic shares: sentence parts, the tools' JSON shapes, the file
# being edited. Variants are numbered; each workload's counter runs on across its cells.

_SUBJECTS = [
    "The river", "An engineer", "The committee", "A gardener", "The night train",
    "Our scheduler", "The old library", "A student", "The harbour crane", "The city council",
    "A wind turbine", "The kitchen staff", "The survey team", "A cargo ship", "The museum",
]
_VERBS = [
    "measured", "repainted", "postponed", "rebuilt", "counted", "photographed", "moved",
    "inspected", "described", "replaced", "ordered", "archived", "tested", "shared",
]
_OBJECTS = [
    "the bridge by the mill", "every map in the east wing", "the budget for spring",
    "the fence along the south field", "three hundred wooden crates", "the signal tower",
    "the ledger of the last decade", "a queue of late orders", "the copper roof",
    "the tide tables for April", "the blue carriages", "a row of apple trees",
    "the pumps under the square", "the winter timetable", "the lamps on the pier",
]
_WHEN = [
    "before the first frost", "after the storm", "on a quiet Sunday", "in under an hour",
    "while the market was closed", "at the request of the mayor", "for the third time",
    "without any help", "during the long holiday", "as the sun went down",
]


def _sentence(rng: random.Random) -> str:
    return (f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
            f"{rng.choice(_WHEN)}.")  # fmt: skip


def _document(variant: int) -> str:
    rng = random.Random(f"doc-{variant}")
    if variant % 3 == 0:  # release notes: a version and settings that differ per variant
        version = f"{2 + variant // 7}.{variant % 7}"
        hours = rng.choice([1, 2, 6, 12, 24])
        return (f"Release notes, version {version}. The scheduler now admits requests in "
                f"arrival order and preempts the newest one when memory runs out. "
                f"{_sentence(rng)} The block store keeps evicted blocks for {hours} hours. "
                f"{_sentence(rng)}")  # fmt: skip
    return " ".join(_sentence(rng) for _ in range(4 + variant % 2))


def copy_prompts(variant: int) -> list[list[dict[str, str]]]:
    """Four requests that copy or edit one document of their own."""
    doc = _document(variant)
    return [
        [{"role": "user", "content": f"{doc}\n\nRepeat the text above exactly."}],
        [{"role": "user", "content": f"Fix the spelling in this text and return all of it:"
          f"\n\n{doc.replace('the', 'teh', 2)}"}],
        [{"role": "user", "content": f"Quote the text below word for word, as a numbered "
          f"list of its sentences.\n\n{doc}"}],
        [{"role": "user", "content": "Write a note for the team about the release."},
         {"role": "assistant", "content": doc},
         {"role": "user", "content": "Send me that note again, exactly as before."}],
    ]  # fmt: skip


_QUESTION_FORMS = [
    "Explain {} to a child.", "Write a short poem about {}.", "List three facts about {}.",
    "What are the pros and cons of {}?", "Give me a tip about {}.",
    "Describe the history of {} in a few sentences.", "Why do people care about {}?",
    "Tell me a short story that involves {}.",
]
_TOPICS = [
    "the ocean", "paperclips", "learning a language", "volcanoes", "bicycles", "tea",
    "the moon", "bread baking", "chess", "rainforests", "electric cars", "bees",
    "public libraries", "jazz", "glaciers", "the printing press",
]
# Every (form, topic) pair once, in one fixed order: variants take 8 at a time.
_QUESTIONS = [f.format(t) for f in _QUESTION_FORMS for t in _TOPICS]
random.Random(0).shuffle(_QUESTIONS)


def chat_prompts(variant: int) -> list[list[dict[str, str]]]:
    """Eight open questions whose answers the context does not hold."""
    n = len(_QUESTIONS)
    return [[{"role": "user", "content": _QUESTIONS[(variant * 8 + i) % n]}] for i in range(8)]


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
_CITIES = [
    "Paris", "Oslo", "Berlin", "Rome", "Madrid", "Lisbon", "Vienna", "Prague", "Dublin",
    "Warsaw", "Athens", "Helsinki", "Zurich", "Brussels", "Budapest", "Copenhagen", "Porto",
    "Krakow", "Seville", "Lyon", "Milan", "Munich", "Riga", "Tallinn",
]
_PEOPLE = ["bob", "alice", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
_NEWS = [
    "the meeting moved to Friday", "the report is ready", "the server is back up",
    "the invoice was paid", "lunch is at noon", "the release slipped a week",
    "the demo went well", "the office is closed on Monday",
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
_EDIT_FORMS = [
    "Add a docstring to {}.", "Add type hints to {}.", "Rename {0} to {0}_v2 everywhere.",
    "Add a logging call at the start of {}.", "Make {} raise ValueError on an empty path.",
    "Move {} to the top of the file.", "Add a comment above {} saying what it returns.",
    "Make {} keyword-only after its first argument.", "Add a default value to the last "
    "argument of {}.", "Write {} with a guard clause for None.",
    "Add an assert to {} that checks its first argument.", "Make {} print what it does.",
]
_EDITS = [f.format(fn) for f in _EDIT_FORMS for fn in ("load_config", "save_config", "merge")]
random.Random(1).shuffle(_EDITS)


def agentic_prompts(variant: int) -> list[list[dict[str, str]]]:
    """Eight agent requests: tool calls as JSON (one after an earlier call and its result)
    and edits of one Python file returned whole; tasks, cities and edits differ per
    variant, the tools and the file do not."""
    rng = random.Random(f"agent-{variant}")
    a, b, c, d = rng.sample(_CITIES, 4)
    day = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    who, other = rng.sample(_PEOPLE, 2)
    tasks = [
        f"What is the weather in {a} right now, in {rng.choice(['celsius', 'fahrenheit'])}?",
        f"Find me a flight from {b} to {c} on {day}.",
        f"Email {who}@example.com that {rng.choice(_NEWS)}.",
        f"Tell {other}@example.com that {rng.choice(_NEWS)}, subject Update.",
    ]
    chats = [[{"role": "system", "content": _TOOLS}, {"role": "user", "content": t}]
             for t in tasks]  # fmt: skip
    # The next call after an earlier one and its result: the same shapes again.
    chats.append([
        {"role": "system", "content": _TOOLS},
        {"role": "user", "content": f"Check the weather in {d}, then email it to "
                                    f"{who}@example.com."},
        {"role": "assistant", "content": f'{{"name": "get_weather", "arguments": {{"city": '
                                         f'"{d}", "unit": "celsius"}}}}'},
        {"role": "user", "content": f'Tool result: {{"temperature": {rng.randint(-5, 30)}, '
                                    f'"sky": "{rng.choice(["clear", "cloudy", "rain"])}"}}'},
    ])  # fmt: skip
    n = len(_EDITS)
    for i in range(3):
        edit = _EDITS[(variant * 3 + i) % n]
        chats.append([{"role": "user", "content": f"{_FILE}\n{edit} Return the whole file."}])
    return chats


WORKLOADS = {"copy": copy_prompts, "chat": chat_prompts, "agentic": agentic_prompts}


def plan(workload: str, concurrencies: list[int], rounds: int):
    """Yield (concurrency, round, chats) for each cell and round of ``workload``, in run
    order. Each round takes the next variants of the workload (none is used twice in a
    run): 12 copy requests, 8 chat or agentic ones at concurrency 1; at least 16 at 16.
    Documents are drawn afresh for every variant; the 128 chat questions and 36 file edits
    last 5 and 4 rounds at concurrencies 1 and 16 (the default is 3) before they recur."""
    builder = WORKLOADS[workload]
    variant = 0
    for concurrency in concurrencies:
        count = max(concurrency, 12 if workload == "copy" else 8)
        for r in range(rounds):
            chats: list[list[dict[str, str]]] = []
            while len(chats) < count:
                chats += builder(variant)
                variant += 1
            yield concurrency, r, chats[:count]


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
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    print(f"speculation: {args.speculative_config}; {args.threads} threads, "
          f"{args.max_tokens} tokens at most, greedy, {args.rounds} rounds, "
          f"fresh prompts every round", flush=True)  # fmt: skip
    warm = [none.tokenizer.encode_chat([{"role": "user", "content": "Say hello."}])] * 2
    cells: dict[tuple[str, int], Cell] = {}
    for name in args.workloads.split(","):
        for concurrency, r, chats in plan(name, concurrencies, args.rounds):
            if r == 0:
                run_round(none, warm, concurrency, 8)  # warm both arms
                run_round(spec, warm, concurrency, 8)
            cell = cells.setdefault((name, concurrency), Cell())
            prompts = [none.tokenizer.encode_chat(c) for c in chats]
            arms = [("none", none, cell.none), ("spec", spec, cell.spec)]
            for _, llm, rounds in arms if r % 2 == 0 else arms[::-1]:
                rounds.append(run_round(llm, prompts, concurrency, args.max_tokens))
            if cell.none[-1].outputs != cell.spec[-1].outputs:
                raise SystemExit(f"{name} c{concurrency}: outputs differ between the arms")
            if r == args.rounds - 1:
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
