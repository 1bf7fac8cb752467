"""What every scenario shares: its options, one benchmark arm, and the report it writes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.backends.base import Backend, SendOptions
from loadtest.datasets.base import SampleRequest
from loadtest.report import build_result, format_summary
from loadtest.runner import LoadConfig, run_load
from loadtest.scenarios.cluster import ClusterPool, ClusterSpec

PERCENTILES = (50.0, 90.0, 99.0)

# Every CI-size scenario runs on this one cluster (unpinned: CI's two cores are shared by
# everything), so a test session starts the workers once. No block store: a prefix cached
# on one prefill worker is then not a hit on the other, which routing needs to show.
SMALL_CLUSTER = ClusterSpec(prefill_cpus=(None, None), decode_cpus=(None,),
                            kv_cache_memory="128MiB", blockstore=False)  # fmt: skip


@dataclass(frozen=True)
class ScenarioOptions:
    small: bool  # CI size: seconds, not minutes; the numbers mean nothing, the fields do
    result_dir: Path
    seed: int = 0
    disable_tqdm: bool = True

    @property
    def num_warmups(self) -> int:
        """Full size: two warm-up requests per run, so first-call costs of fresh workers are
        not measured (they use their own cache salt, so they leave no reusable KV)."""
        return 0 if self.small else 2


@dataclass
class ScenarioReport:
    name: str
    question: str
    options: ScenarioOptions
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per arm: the headline numbers
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # arm label -> result JSON
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)

    @property
    def directory(self) -> Path:
        return self.options.result_dir / self.name

    def add(self, label: str, result: dict[str, Any], row: dict[str, Any]) -> None:
        self.results[label] = result
        self.rows.append({"arm": label, **row})
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"{label}.json").write_text(json.dumps(result, indent=2) + "\n")

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.name, "question": self.question,
            "size": "small" if self.options.small else "full", "seed": self.options.seed,
            "arms": self.rows, "notes": self.notes, "skipped": self.skipped,
            "figures": self.figures, "results": {k: f"{k}.json" for k in self.results},
        }  # fmt: skip

    def table(self) -> str:
        if not self.rows:
            return "(no arms ran)"
        keys = list(dict.fromkeys(k for row in self.rows for k in row))
        widths = {k: max(len(k), *(len(_cell(r.get(k))) for r in self.rows)) for k in keys}
        lines = ["  ".join(k.ljust(widths[k]) for k in keys)]
        lines += ["  ".join(_cell(r.get(k)).ljust(widths[k]) for k in keys) for r in self.rows]
        return "\n".join(lines)

    def write(self) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "report.json").write_text(json.dumps(self.to_json(), indent=2) + "\n")
        text = [f"# {self.name}: {self.question}", "", self.table(), ""]
        text += [f"note: {n}" for n in self.notes] + [f"skipped: {s}" for s in self.skipped]
        text += [f"figure: {f}" for f in self.figures]
        for label, result in self.results.items():
            text += ["", format_summary(result, PERCENTILES, title=f" {label} ")]
        path = self.directory / "report.txt"
        path.write_text("\n".join(text) + "\n")
        print(
            "\n".join(text[: 4 + len(self.notes) + len(self.skipped) + len(self.figures) + 1]),
            flush=True,
        )
        return path


def vocab_size(model_dir: str) -> int:
    from tokenizers import Tokenizer

    return int(Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).get_vocab_size())


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return "-" if value is None else str(value)


def grpc_backend(address: str) -> Backend:
    from loadtest.backends.grpc_gateway import GrpcGatewayBackend

    return GrpcGatewayBackend(address)


def http_backend(url: str) -> Backend:
    from loadtest.backends.openai_http import OpenAIHttpBackend

    return OpenAIHttpBackend(url, "default")


def run_arm(
    backend: Backend,
    requests: Sequence[SampleRequest],
    load: LoadConfig,
    setup: dict[str, Any],
    *,
    send: SendOptions | None = None,
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One benchmark run, with per-request detail in the result."""

    async def go() -> dict[str, Any]:
        try:
            await backend.ready(60)
            outcome = await run_load(backend, requests, send or SendOptions(), load)
        finally:
            await backend.close()
        return build_result(outcome, {"backend": backend.name, "num_prompts": len(requests), **setup,
                                      "request_rate": load.request_rate, "burstiness": load.burstiness,
                                      "max_concurrency": load.max_concurrency},
                            percentiles=PERCENTILES, goodput_slos_ms=goodput_slos_ms, detailed=True)  # fmt: skip

    return asyncio.run(go())


def category_metric(result: dict[str, Any], category: str, key: str) -> Any:
    """A metric of one request category, or of the whole run when it has one category."""
    return result.get("categories", {}).get(category, result).get(key)


def pool_for(
    options: ScenarioOptions, model_dir: str, pool: ClusterPool | None
) -> tuple[ClusterPool, bool]:
    """The given pool (not ours to close), or a new exclusive one (ours)."""
    if pool is not None:
        return pool, False
    return ClusterPool(model_dir, options.result_dir / "run", exclusive=True), True
