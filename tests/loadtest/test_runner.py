"""The load generator's scheduling: arrival times, concurrency cap, turn order, warm-ups."""

from __future__ import annotations

import asyncio
import time

import pytest

from loadtest.backends.base import Backend, RequestOutput, SendOptions
from loadtest.datasets.base import SampleRequest
from loadtest.runner import LoadConfig, LoadOutcome, run_load, schedule


class RecordingBackend(Backend):
    """Answers each request after ``service_s`` with one token; records sends."""

    name = "recording"

    def __init__(self, service_s: float = 0.05, crash_on: str = "") -> None:
        self.service_s = service_s
        self.crash_on = crash_on
        self.sent: list[tuple[str, float, str]] = []  # request id, perf_counter, cache salt
        self.finished: dict[str, float] = {}
        self.in_flight = 0
        self.most_in_flight = 0

    async def send(
        self, request: SampleRequest, request_id: str, options: SendOptions
    ) -> RequestOutput:
        if self.crash_on and request.request_id == self.crash_on:
            raise KeyError("backend bug")
        out = RequestOutput(
            request_id, request.prompt_len, request.category, start_time=time.perf_counter()
        )
        self.sent.append((request_id, out.start_time, options.cache_salt))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(self.service_s)
        self.in_flight -= 1
        out.add_chunk(time.perf_counter(), 1)
        out.end_time = out.chunk_times[-1]
        out.output_tokens, out.success = 1, True
        self.finished[request_id] = out.end_time
        return out


def reqs(n: int, **kwargs: object) -> list[SampleRequest]:
    return [SampleRequest(f"q{i}", (1, 2, 3), 1, **kwargs) for i in range(n)]  # type: ignore[arg-type]


def go(
    backend: Backend,
    requests: list[SampleRequest],
    config: LoadConfig,
    options: SendOptions | None = None,
) -> LoadOutcome:
    return asyncio.run(run_load(backend, requests, options or SendOptions(), config))


def test_requests_go_out_at_their_scheduled_offsets_open_loop() -> None:
    backend = RecordingBackend(service_s=0.3)  # slower than the gaps: the load is open-loop
    config = LoadConfig(request_rate=10.0, burstiness=float("inf"), disable_tqdm=True)
    outcome = go(backend, reqs(4), config)
    assert outcome.offsets_s == pytest.approx([0.1, 0.2, 0.3, 0.4])
    for (_, sent, _), offset in zip(backend.sent, outcome.offsets_s, strict=True):
        assert offset - 0.002 <= sent - outcome.start_time <= offset + 0.15
    assert backend.most_in_flight >= 3
    assert [o.request_id.rsplit("-", 1)[-1] for o in outcome.outputs] == ["q0", "q1", "q2", "q3"]


def test_trace_times_are_used_unless_fixed_schedule_is_off() -> None:
    traced = [SampleRequest(f"t{i}", (1,), 1, arrival_s=t) for i, t in enumerate((0.0, 0.0, 0.2))]
    assert schedule(traced, LoadConfig()) == [0.0, 0.0, 0.2]
    assert (
        schedule(traced, LoadConfig(fixed_schedule=False, request_rate=float("inf"))) == [0.0] * 3
    )
    backend = RecordingBackend(service_s=0.01)
    outcome = go(backend, traced, LoadConfig(disable_tqdm=True))
    assert backend.sent[2][1] - outcome.start_time >= 0.198


def test_max_concurrency_caps_requests_in_flight() -> None:
    backend = RecordingBackend(service_s=0.05)
    go(backend, reqs(8), LoadConfig(max_concurrency=2, disable_tqdm=True))
    assert backend.most_in_flight == 2
    assert len(backend.sent) == 8


def test_a_turn_waits_for_the_previous_turn_of_its_session() -> None:
    requests = [
        SampleRequest("a0", (1,), 1, session_id="a"), SampleRequest("b0", (1,), 1, session_id="b"),
        SampleRequest("a1", (1,), 1, session_id="a"), SampleRequest("b1", (1,), 1, session_id="b"),
    ]  # fmt: skip
    backend = RecordingBackend(service_s=0.1)
    go(backend, requests, LoadConfig(disable_tqdm=True))  # all due at once
    sent = {rid.rsplit("-", 1)[-1]: when for rid, when, _ in backend.sent}
    done = {rid.rsplit("-", 1)[-1]: when for rid, when in backend.finished.items()}
    assert sent["a1"] >= done["a0"] and sent["b1"] >= done["b0"]
    assert sent["b0"] < done["a0"] and sent["a0"] < done["b0"]  # sessions run side by side


def test_warmups_are_sent_first_and_not_measured() -> None:
    backend = RecordingBackend(service_s=0.01)
    outcome = go(
        backend,
        reqs(2),
        LoadConfig(num_warmups=3, disable_tqdm=True),
        SendOptions(cache_salt="run"),
    )
    ids = [rid for rid, _, _ in backend.sent]
    salts = [salt for _, _, salt in backend.sent]
    assert salts[3:] == ["run", "run"] and len(set(salts[:3])) == 1 and salts[0] != "run"
    assert [i.rsplit("-", 2)[-2:] for i in ids[:3]] == [
        ["warmup", "0"],
        ["warmup", "1"],
        ["warmup", "2"],
    ]
    assert len(outcome.outputs) == 2


def test_cache_salts_shared_or_unique_per_request() -> None:
    backend = RecordingBackend(service_s=0.0)
    go(backend, reqs(3), LoadConfig(disable_tqdm=True), SendOptions(cache_salt="run-1"))
    assert {salt for _, _, salt in backend.sent} == {"run-1"}
    backend = RecordingBackend(service_s=0.0)
    go(backend, reqs(3), LoadConfig(unique_cache_salt=True, disable_tqdm=True))
    assert len({salt for _, _, salt in backend.sent}) == 3


def test_a_backend_exception_is_one_failed_request() -> None:
    backend = RecordingBackend(service_s=0.0, crash_on="q1")
    outcome = go(backend, reqs(3), LoadConfig(disable_tqdm=True))
    assert [o.success for o in outcome.outputs] == [True, False, True]
    assert outcome.outputs[1].status_code == "KeyError"
