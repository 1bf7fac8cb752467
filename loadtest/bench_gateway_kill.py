"""A gateway SIGKILLed under load: what its streams lose, and what a resume costs.

One ``pdserve up --gateways 4`` stack (its defaults otherwise: the workers ``pdserve up``
starts on this machine, block store, redis; plus ``--up-arg``). Each client kind runs ``--streams`` concurrent
greedy chat streams of ``--max-tokens`` tokens (ignore_eos), half of them starting on
gateway 0 and half on the kind's doomed gateway, every stream able to go on at the other:

- ``grpc``: ``pdserve.client.GatewayClient.generate`` (what ``pdserve generate --target
  A,B`` runs), the resume token and the tokens received sent on;
- ``openai``: the OpenAI SDK (``AsyncOpenAI``, streamed chat completions) on
  ``pdserve.sse_resume.AsyncResumingTransport``, reconnecting with ``Last-Event-ID``;
- ``cli``: two ``pdserve generate --target A,B --json`` processes, half the prompts each
  (plain prompts, not chat messages), one starting on each gateway.

First undisturbed (the reference), then again with the doomed gateway (1 for grpc, 2 for
openai, 3 for cli) SIGKILLed once every stream has ``--kill-at`` tokens (cli: once every
stream runs on a decode worker and ``--cli-kill-delay-s`` more went by). Per kind: streams
that resumed, whether every stream's tokens (grpc, cli) or text (openai) equal the
reference's, the
gap a resume put into its stream (the time from the last message before the break to the
first after it, p50 and p99; not for cli, which prints each result whole) beside the
streams' usual gap between messages, the context
tokens the continuations computed again (gateway 0's
``pdserve:resume_recomputed_tokens_total``; a context's last, partial block is always
computed: at most a block per resume when the rest was held), and every KV block free
afterwards.

    .venv/bin/python -m loadtest.bench_gateway_kill --result-dir docs/benchmarks/DIR
    .venv/bin/python -m loadtest.bench_gateway_kill --streams 4 --max-tokens 40 --kill-at 10

Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.soak import blocks_free_after

CLI = [sys.executable, "-m", "pdserve", "--log-level", "WARNING"]
TOPICS = (
    "a lighthouse keeper", "a clockmaker's apprentice", "a lost balloon", "two rival bakers",
    "a robot learning to paint", "a fox in the city", "a storm at sea", "an old library",
    "a mountain rescue dog", "the last train home", "a garden on the moon", "a shy dragon",
    "a detective cat", "a river that ran backwards", "a forgotten violin", "a snowed-in inn",
)  # fmt: skip


def prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]} (story {i})." for i in range(n)]


@dataclass
class Stream:
    """One stream's messages: arrival time and tokens (grpc) or text (openai) of each, and
    the index of the first message after each resume."""

    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    count: int = 0  # tokens (grpc) or chunks with content (openai) so far
    resumed_at: list[int] = field(default_factory=list)
    finish: str = ""

    def gaps_ms(self) -> tuple[list[float], list[float]]:
        """(the gaps at resumes, the other gaps between messages), in ms."""
        diffs = np.diff(np.asarray(self.times)) * 1000
        at = {i - 1 for i in self.resumed_at if i > 0}
        seams = [float(d) for i, d in enumerate(diffs) if i in at]
        usual = [float(d) for i, d in enumerate(diffs) if i not in at]
        return seams, usual


class Gate:
    """Waits until every stream counted ``at`` tokens (or chunks), then calls ``kill``."""

    def __init__(self, n: int, at: int, kill: Callable[[], None] | None) -> None:
        self.n, self.at, self.kill = n, at, kill
        self.reached: set[int] = set()
        self.killed_at: float | None = None

    def saw(self, i: int, count: int) -> None:
        if self.kill is None or self.killed_at is not None or count < self.at:
            return
        self.reached.add(i)
        if len(self.reached) == self.n:
            self.killed_at = time.monotonic()
            self.kill()


async def grpc_streams(
    targets: Sequence[str], texts: Sequence[str], max_tokens: int, gate: Gate
) -> list[Stream]:
    from common.contract.sampling import SamplingParams
    from pdserve.client import GatewayClient
    from pdserve.common.v1 import common_pb2

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> Stream:
        order = targets if i % 2 == 0 else list(reversed(targets))
        client = GatewayClient(",".join(order))
        stream = Stream()
        try:
            async for message in client.generate(
                messages=[{"role": "user", "content": texts[i]}], sampling=sampling,
                timeout_s=600,
            ):  # fmt: skip
                if client.num_resumes > len(stream.resumed_at):
                    stream.resumed_at.append(len(stream.times))
                stream.times.append(time.monotonic())
                stream.tokens += message.token_ids
                stream.text += message.text
                stream.count = len(stream.tokens)
                if message.finish_reason:
                    name = common_pb2.FinishReason.Name(message.finish_reason)
                    stream.finish = name.removeprefix("FINISH_REASON_").lower()
                gate.saw(i, stream.count)
        finally:
            await client.close()
        return stream

    return list(await asyncio.gather(*(one(i) for i in range(len(texts)))))


async def openai_streams(
    model: str, urls: Sequence[str], texts: Sequence[str], max_tokens: int, gate: Gate
) -> list[Stream]:
    import openai

    from pdserve.sse_resume import AsyncResumingTransport, httpx

    async def one(i: int) -> Stream:
        order = list(urls) if i % 2 == 0 else list(reversed(urls))
        transport = AsyncResumingTransport(order)
        client = openai.AsyncOpenAI(base_url=f"{order[0]}/v1", api_key="-", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=transport,
                                                                  timeout=600))  # fmt: skip
        stream = Stream()
        try:
            chunks = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": texts[i]}],
                max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in chunks:
                if chunk.usage is not None:
                    stream.count = chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                if transport.num_resumes > len(stream.resumed_at):
                    stream.resumed_at.append(len(stream.times))
                stream.times.append(time.monotonic())
                stream.text += choice.delta.content or ""
                stream.finish = choice.finish_reason or stream.finish
                # Chunks with content stand for tokens here (one token per chunk, or a few
                # when the detokenizer holds some back).
                gate.saw(i, len(stream.times))
        finally:
            await client.close()
        return stream

    return list(await asyncio.gather(*(one(i) for i in range(len(texts)))))


def metric(http_url: str, name: str, labels: str = "") -> float:
    """A gateway's metric (``labels``: as the exposition writes them, ``{a="b"}``)."""
    base = http_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(f"{name}{labels} "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def cli_streams(
    targets: Sequence[str], texts: Sequence[str], max_tokens: int, env: dict[str, str],
    kill: Callable[[], None] | None, kill_delay_s: float,
) -> list[Stream]:  # fmt: skip
    """Two ``pdserve generate --target A,B --json`` processes, half the prompts each, one
    starting on each gateway; ``kill`` once every stream runs on a decode worker and
    ``kill_delay_s`` more went by. No per-message times: the CLI prints each result whole."""
    from pdserve.cli.commands.status import fetch

    orders = [list(targets), list(reversed(targets))]
    halves = [list(texts[0::2]), list(texts[1::2])]
    processes = []
    for order, half in zip(orders, halves, strict=True):
        argv = [*CLI, "generate", "--target", ",".join(order), "--json", "--max-tokens",
                str(max_tokens), "--ignore-eos", *half]  # fmt: skip
        processes.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=env))  # fmt: skip
    if kill is not None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            workers = asyncio.run(fetch(targets[0]))
            running = [w["running"] for w in workers if w["role"] == "decode"]
            if sum(int(str(r)) for r in running) >= len(texts):
                break
            time.sleep(0.2)
        time.sleep(kill_delay_s)
        kill()
    by_prompt: dict[str, Stream] = {}
    for process in processes:
        out, err = process.communicate(timeout=1800)
        if process.returncode != 0:
            raise RuntimeError(f"pdserve generate failed: {err}")
        for line in out.splitlines():
            record = json.loads(line)
            by_prompt[record["prompt"]] = Stream(tokens=record["token_ids"], text=record["text"],
                                                 finish=record["finish_reason"])  # fmt: skip
    return [by_prompt[t] for t in texts]


def summarize(kind: str, reference: list[Stream], killed: list[Stream], gate: Gate,
              recomputed: float, continued: float,
              blocks: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    same = [
        (k.tokens == r.tokens) if kind != "openai" else (k.text == r.text)
        for k, r in zip(killed, reference, strict=True)
    ]
    seams: list[float] = []
    usual: list[float] = []
    for s in killed:
        a, b = s.gaps_ms()
        seams += a
        usual += b
    after_kill = [
        (s.times[s.resumed_at[0]] - gate.killed_at) * 1000
        for s in killed if s.resumed_at and gate.killed_at is not None
    ]  # fmt: skip

    def pct(values: list[float], q: float) -> float | None:
        return round(float(np.percentile(values, q)), 1) if values else None

    return {
        "kind": kind,
        "streams": len(killed),
        # The CLI's streams: the surviving gateway's count of resumes it continued.
        "resumed": sum(1 for s in killed if s.resumed_at) if kind != "cli" else int(continued),
        "identical": sum(same),
        "finished_length": sum(1 for s in killed if s.finish == "length"),
        "seam_gap_ms_p50": pct(seams, 50), "seam_gap_ms_p99": pct(seams, 99),
        "kill_to_resumed_ms_p50": pct(after_kill, 50), "kill_to_resumed_ms_p99": pct(after_kill, 99),
        "usual_gap_ms_p50": pct(usual, 50), "usual_gap_ms_p99": pct(usual, 99),
        "recomputed_tokens": int(recomputed),
        "kv_blocks_free_after": blocks,
        "all_free_after": all(b["free"] == b["total"] for b in blocks),
    }  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.cli.launcher import StackState, free_port

    run_dir = Path(tempfile.mkdtemp(prefix="pdserve-gwkill-"))
    env = {**os.environ, "PDSERVE_RUN_DIR": str(run_dir)}
    port = free_port()
    started = subprocess.run(
        [*CLI, "up", "--detach", "--gateways", "4", "--port", str(port), "--http-port", "0",
         "--kserve-port", "-1", *args.up_arg],
        env=env, capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    if started.returncode != 0:
        raise RuntimeError(f"pdserve up failed:\n{started.stdout}\n{started.stderr}")
    results: list[dict[str, Any]] = []
    try:
        state = StackState.load(run_dir / "stack.json")
        assert state is not None and len(state.gateway_endpoints) == 4
        pids = {c.address: c.pid for c in state.children}
        ends = state.gateway_endpoints
        with urllib.request.urlopen(ends[0]["http"] + "/models", timeout=10) as reply:
            model = json.loads(reply.read())["data"][0]["id"]
        texts = prompts(args.streams)
        for kind, doomed in (("grpc", 1), ("openai", 2), ("cli", 3)):
            if kind not in args.kinds:
                continue
            pair = [ends[0], ends[doomed]]
            victim = pids[ends[doomed]["grpc"]]

            def kill(victim: int = victim) -> None:
                os.kill(victim, signal.SIGKILL)

            def streams(gate: Gate, pair: list[dict[str, str]] = pair,
                        kind: str = kind) -> list[Stream]:  # fmt: skip
                if kind == "grpc":
                    return asyncio.run(grpc_streams([e["grpc"] for e in pair], texts,
                                                    args.max_tokens, gate))  # fmt: skip
                if kind == "cli":
                    return cli_streams([e["grpc"] for e in pair], texts, args.max_tokens, env,
                                       gate.kill, args.cli_kill_delay_s)  # fmt: skip
                urls = [e["http"].removesuffix("/v1") for e in pair]
                return asyncio.run(openai_streams(model, urls, texts, args.max_tokens, gate))

            reference = streams(Gate(len(texts), args.kill_at, None))
            gauges = ("pdserve:resume_recomputed_tokens_total", ""), \
                ("pdserve:resumes_total", '{outcome="continued"}')
            before = [metric(ends[0]["http"], *g) for g in gauges]
            gate = Gate(len(texts), args.kill_at, kill)
            killed = streams(gate)
            recomputed, continued = (metric(ends[0]["http"], *g) - b
                                     for g, b in zip(gauges, before, strict=True))  # fmt: skip
            blocks = asyncio.run(blocks_free_after(ends[0]["grpc"]))
            results.append(summarize(kind, reference, killed, gate, recomputed, continued,
                                     blocks))  # fmt: skip
            print(format_row(results[-1]), flush=True)
    finally:
        subprocess.run([*CLI, "down"], env=env, capture_output=True, timeout=300, check=False)
    return {"setup": vars(args) | {"cpu": cpu_name(), "date": datetime.now().isoformat()},
            "results": results}  # fmt: skip


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['kind']:<7} {r['streams']:>3} streams, {r['resumed']:>3} resumed, "
        f"{r['identical']:>3} identical to undisturbed, {r['finished_length']:>3} finished; "
        f"resume gap p50 {r['seam_gap_ms_p50']} ms p99 {r['seam_gap_ms_p99']} ms "
        f"(kill to resumed p50 {r['kill_to_resumed_ms_p50']} p99 {r['kill_to_resumed_ms_p99']}; "
        f"usual gap p50 {r['usual_gap_ms_p50']} p99 {r['usual_gap_ms_p99']}); "
        f"recomputed {r['recomputed_tokens']} tokens "
        f"({r['recomputed_tokens'] / max(1, r['resumed']):.1f} per resume); "
        f"KV blocks all free after: {r['all_free_after']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--kill-at", type=int, default=100,
                        help="SIGKILL the doomed gateway once every stream has this many tokens")
    parser.add_argument("--kinds", nargs="+", default=["grpc", "openai", "cli"],
                        choices=["grpc", "openai", "cli"])
    parser.add_argument("--cli-kill-delay-s", type=float, default=5.0,
                        help="cli: SIGKILL this long after every stream runs on a decode worker")
    parser.add_argument("--up-arg", action="append", default=[],
                        help="passed to pdserve up (repeatable), e.g. --up-arg=--decode=2")
    parser.add_argument("--result-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    result = run(args)
    if args.result_dir is not None:
        args.result_dir.mkdir(parents=True, exist_ok=True)
        result["setup"]["result_dir"] = str(args.result_dir)
        (args.result_dir / "gateway_kill.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.result_dir / "gateway_kill.txt").write_text(
            "\n".join(format_row(r) for r in result["results"]) + "\n"
        )
    failed = [r for r in result["results"]
              if r["identical"] != r["streams"] or not r["all_free_after"] or not r["resumed"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
