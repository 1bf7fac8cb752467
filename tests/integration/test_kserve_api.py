"""The gateway's KServe v2 / Triton gRPC port, driven by the real ``tritonclient.grpc``
(in a process of its own: tests/integration/triton_client.py) and by the vendored stubs,
against the shared stack (2 prefill, 2 decode) and a keyed gateway on the same workers.

- metadata, readiness and a decoupled model configuration, as Triton's vLLM backend shows;
- unary and streamed greedy output equal to the gRPC API's and the HTTP API's;
- several requests on one stream, each ending with ``triton_final_response``;
- bad requests: NOT_FOUND / INVALID_ARGUMENT naming the field, on a stream as an
  ``error_message`` that leaves the stream's other requests alone;
- API keys as on the gRPC port (liveness stays open); a cancelled stream frees every block.
"""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from pdserve.cli.launcher import Child, StackState
from pdserve.kserve.v2 import grpc_service_pb2 as pb
from pdserve.kserve.v2 import grpc_service_pb2_grpc
from tests.integration.conftest import Stack, extra_gateway
from tests.integration.test_cancellation import assert_everything_free
from tests.integration.test_openai_api import grpc_greedy

CLIENT = Path(__file__).with_name("triton_client.py")
PROMPTS = ["The three primary colors are", "Water boils at a temperature of"]
GREEDY = {"temperature": 0, "max_tokens": 12}
KEY = "kserve-test-key"


def kserve_url(stack: Stack) -> str:
    state = StackState.load(stack.run_dir / "stack.json")
    assert state is not None and state.kserve, "pdserve up recorded no KServe port"
    return state.kserve


def triton(url: str, model: str, scenario: str, **args: Any) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(CLIENT), url, model, scenario, json.dumps(args)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_metadata_readiness_and_a_decoupled_config(stack: Stack) -> None:
    model = stack.model_dir.name
    seen = triton(kserve_url(stack), model, "metadata")
    assert seen["live"] and seen["ready"] and seen["model_ready"]
    assert seen["server"]["name"] == "pdserve"
    assert seen["model"]["name"] == model and seen["model"]["versions"] == ["1"]
    assert {t["name"] for t in seen["model"]["inputs"]} == {
        "text_input", "stream", "sampling_parameters", "exclude_input_in_output",
    }  # fmt: skip
    assert {t["name"] for t in seen["model"]["outputs"]} >= {"text_output", "finish_reason"}
    config = seen["config"]["config"]
    assert config["name"] == model and config["model_transaction_policy"]["decoupled"] is True
    # tritonclient's get_model_repository_index (perf_analyzer and model listers call it).
    assert seen["index"]["models"] == [{"name": model, "version": "1", "state": "READY"}]


def test_greedy_output_is_the_same_through_kserve_grpc_and_http(stack: Stack) -> None:
    model = stack.model_dir.name
    grpc_texts = [grpc_greedy(stack, raw_prompt=p)[1] for p in PROMPTS]
    http = openai.OpenAI(base_url=stack.http_url(), api_key="x", max_retries=0)
    http_texts = [
        http.completions.create(model=model, prompt=p, max_tokens=12, temperature=0.0)
        .choices[0].text
        for p in PROMPTS
    ]  # fmt: skip
    unary = triton(kserve_url(stack), model, "infer", prompts=PROMPTS, sampling=GREEDY)
    kserve_texts = [r["text_output"] for r in unary["results"]]
    assert kserve_texts == grpc_texts == http_texts
    for result in unary["results"]:
        assert result["num_output_tokens"] == 12 and result["finish_reason"] == "length"
    # Without exclude_input_in_output the text starts with the prompt, as vLLM's backend.
    whole = triton(kserve_url(stack), model, "infer", prompts=PROMPTS[:1], sampling=GREEDY,
                   exclude=False)  # fmt: skip
    assert whole["results"][0]["text_output"] == PROMPTS[0] + grpc_texts[0]

    streamed = triton(kserve_url(stack), model, "stream", prompts=PROMPTS, sampling=GREEDY)
    assert not streamed["errors"]
    for i, text in enumerate(grpc_texts):
        responses = streamed["responses"][f"s{i}"]
        assert len(responses) > 1  # token by token, not one answer at the end
        assert [r["final"] for r in responses] == [False] * (len(responses) - 1) + [True]
        assert "".join(r["text_output"] for r in responses) == text
        assert responses[-1]["num_output_tokens"] == 12
        assert responses[-1]["finish_reason"] == "length"


def test_a_stream_request_without_stream_gets_one_final_response(stack: Stack) -> None:
    seen = triton(kserve_url(stack), stack.model_dir.name, "stream", prompts=PROMPTS[:1],
                  sampling=GREEDY, stream=False)  # fmt: skip
    (response,) = seen["responses"]["s0"]
    assert response["final"] and response["text_output"] == grpc_greedy(
        stack, raw_prompt=PROMPTS[0]
    )[1]


def test_bad_requests_name_what_is_wrong(stack: Stack) -> None:
    seen = triton(kserve_url(stack), stack.model_dir.name, "errors")
    assert seen["unknown_model"]["status"] == "StatusCode.NOT_FOUND"
    assert "no-such-model" in seen["unknown_model"]["message"]
    for case in ("unknown_parameter", "bad_number"):
        assert seen[case]["status"] == "StatusCode.INVALID_ARGUMENT", seen[case]
    assert "beam_width" in seen["unknown_parameter"]["message"]
    assert "max_tokens" in seen["bad_number"]["message"]


def _request(model: str, request_id: str, prompt: str, sampling: dict[str, Any],
             stream: bool = True) -> pb.ModelInferRequest:  # fmt: skip
    """A ModelInferRequest on the raw path, as tritonclient encodes one."""
    def text(value: str) -> bytes:
        return struct.pack("<I", len(value.encode())) + value.encode()

    request = pb.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.inputs.add(name="stream", datatype="BOOL", shape=[1])
    request.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    request.raw_input_contents.extend([text(prompt), bytes([stream]), text(json.dumps(sampling))])
    return request


def test_a_bad_request_on_a_stream_leaves_the_others_alone(stack: Stack) -> None:
    model = stack.model_dir.name

    async def run() -> list[pb.ModelStreamInferResponse]:
        channel = grpc.aio.insecure_channel(kserve_url(stack))
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        requests = [
            _request(model, "good-0", PROMPTS[0], GREEDY),
            _request(model, "bad", PROMPTS[0], {"max_tokens": 4, "temperature": "hot"}),
            _request(model, "good-1", PROMPTS[1], GREEDY),
        ]
        try:
            return [r async for r in stub.ModelStreamInfer(iter(requests), timeout=120)]
        finally:
            await channel.close()

    responses = asyncio.run(run())
    errors = [r for r in responses if r.error_message]
    assert [r.infer_response.id for r in errors] == ["bad"]
    assert "INVALID_ARGUMENT" in errors[0].error_message
    assert "temperature" in errors[0].error_message
    for good in ("good-0", "good-1"):
        mine = [r.infer_response for r in responses if r.infer_response.id == good]
        assert mine[-1].parameters["triton_final_response"].bool_param
        assert sum(m.parameters["triton_final_response"].bool_param for m in mine) == 1


def test_a_cancelled_stream_frees_every_block(stack: Stack) -> None:
    model = stack.model_dir.name

    async def run() -> int:
        channel = grpc.aio.insecure_channel(kserve_url(stack))
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        long = {"max_tokens": 400, "ignore_eos": True}
        requests = [_request(model, f"long-{i}", PROMPTS[i % 2], long) for i in range(3)]
        call = stub.ModelStreamInfer(iter(requests))
        seen = 0
        async for _ in call:
            seen += 1
            if seen == 9:
                break
        call.cancel()
        await channel.close()
        return seen

    assert asyncio.run(run()) == 9
    assert_everything_free(stack)


@dataclass
class KeyedGateway:
    child: Child
    url: str


@pytest.fixture(scope="module")
def keyed(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedGateway]:
    with extra_gateway(stack, tmp_path_factory, "gateway-kserve", "--api-key", KEY) as gateway:
        yield KeyedGateway(gateway.child, f"127.0.0.1:{gateway.kserve_port}")


def test_api_keys_guard_inference_but_not_liveness(keyed: KeyedGateway, stack: Stack) -> None:
    model = stack.model_dir.name

    async def run(metadata: tuple[tuple[str, str], ...]) -> tuple[bool, grpc.StatusCode | None]:
        channel = grpc.aio.insecure_channel(keyed.url)
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            live = (await stub.ServerLive(pb.ServerLiveRequest())).live
            try:
                await stub.ModelInfer(_request(model, "k", PROMPTS[0], {"max_tokens": 2}),
                                      metadata=metadata, timeout=60)  # fmt: skip
                return live, None
            except grpc.aio.AioRpcError as exc:
                return live, exc.code()
        finally:
            await channel.close()

    assert asyncio.run(run(())) == (True, grpc.StatusCode.UNAUTHENTICATED)
    assert asyncio.run(run((("authorization", "Bearer wrong"),))) == (
        True, grpc.StatusCode.UNAUTHENTICATED,
    )  # fmt: skip
    assert asyncio.run(run((("authorization", f"Bearer {KEY}"),))) == (True, None)
    seen = triton(keyed.url, model, "infer", prompts=PROMPTS[:1], sampling=GREEDY,
                  headers={"authorization": f"Bearer {KEY}"})  # fmt: skip
    assert seen["results"][0]["num_output_tokens"] == 12


def test_status_lists_the_kserve_port(stack: Stack) -> None:
    shown = stack.cli("status", "--target", stack.target)
    assert f"KServe v2 gRPC at grpc://{kserve_url(stack)}" in shown.stdout, shown.stdout


def test_bench_serve_drives_the_kserve_port(stack: Stack, tmp_path: Path) -> None:
    """The load tester's kserve backend: one decoupled stream per request, as perf_analyzer."""
    done = stack.cli(
        "bench", "serve", "--backend", "kserve", "--base-url", kserve_url(stack),
        "--model", str(stack.model_dir), "--served-model-name", stack.model_dir.name,
        "--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "6",
        "--num-prompts", "4", "--max-concurrency", "2", "--unique-cache-salt",
        "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "kserve.json", timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "kserve.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 4 * 6


def test_a_kserve_stream_resumes_on_another_gateway(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = stack.model_dir.name
    sampling = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
    whole = triton(kserve_url(stack), model, "stream", prompts=[PROMPTS[0]], sampling=sampling)
    reference = "".join(r["text_output"] for r in whole["responses"]["s0"])
    with extra_gateway(stack, tmp_path_factory, "gateway-kserve-doomed") as doomed:
        seen = triton(f"127.0.0.1:{doomed.kserve_port}", model, "resume", prompt=PROMPTS[0],
                      sampling=sampling, after=6, kill_pid=doomed.process.pid,
                      other_url=kserve_url(stack))  # fmt: skip
    before, after = seen["before"], seen["after"]
    assert len(before) == 6 and all(r["token"] for r in before)
    assert after[-1]["finish_reason"] == "length" and after[-1]["num_output_tokens"] == 40
    joined = "".join(r["text_output"] for r in before + after)
    assert joined == reference
