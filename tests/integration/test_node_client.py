"""A Node.js client (@grpc/grpc-js, protos loaded at run time) against the real stack: it
gets the model info and the same greedy completion as the Python client, and its stream
survives the death of its gateway."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from common.contract.sampling import SamplingParams
from pdserve.client import GatewayClient, RemoteCompletion
from pdserve.gateway.v1 import gateway_pb2
from tests.integration.conftest import Stack, extra_gateway
from tests.polling import settle

pytestmark = pytest.mark.slow

NODE_DIR = Path(__file__).resolve().parents[1] / "node"
PROMPT = "Name three colors of the rainbow."
MAX_TOKENS = 16  # as generate.js asks, with temperature 0


@pytest.fixture(scope="module")
def node() -> str:
    """The node binary, with tests/node's locked dependencies installed."""
    binary, npm = shutil.which("node"), shutil.which("npm")
    if binary is None or npm is None:
        pytest.fail("node and npm are not installed: run scripts/setup_system.sh")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        installed = subprocess.run(
            [npm, "ci", "--prefix", str(NODE_DIR), "--no-audit", "--no-fund"],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        if installed.returncode != 0:
            pytest.fail(f"npm ci in {NODE_DIR} failed:\n{installed.stdout}\n{installed.stderr}")
    return binary


def python_answers(target: str) -> tuple[gateway_pb2.GetModelInfoResponse, RemoteCompletion]:
    async def run() -> tuple[gateway_pb2.GetModelInfoResponse, RemoteCompletion]:
        client = GatewayClient(target)
        try:
            info = await client.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10)
            sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
            return info, await client.complete(prompt=PROMPT, sampling=sampling)
        finally:
            await client.close()

    return asyncio.run(run())


def test_node_client_streams_the_python_clients_greedy_completion(stack: Stack, node: str) -> None:
    ran = subprocess.run(
        [node, str(NODE_DIR / "generate.js"), stack.target, PROMPT],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    info, expected = python_answers(stack.target)

    assert result["model_info"]["model"] == info.model
    assert result["model_info"]["vocab_size"] == info.vocab_size
    assert result["model_info"]["max_context_tokens"] == info.max_context_tokens
    assert result["model_info"]["eos_token_ids"] == list(info.eos_token_ids)
    assert result["request_id"].startswith("req-")

    assert result["finish_reason"] in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH")
    assert 0 < len(result["tokens"]) <= MAX_TOKENS
    if result["finish_reason"] == "FINISH_REASON_LENGTH":
        assert len(result["tokens"]) == MAX_TOKENS
    usage = result["usage"]
    assert usage["completion_tokens"] == len(result["tokens"])
    assert usage["prompt_tokens"] == expected.prompt_tokens

    assert result["tokens"] == expected.token_ids
    assert result["text"] == expected.text and result["text"]
    assert result["finish_reason"].removeprefix("FINISH_REASON_").lower() == expected.finish_reason


def test_node_client_resumes_on_its_next_gateway_when_the_first_is_killed(
    stack: Stack, node: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    async def reference() -> RemoteCompletion:
        client = GatewayClient(stack.target)
        try:
            sampling = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
            return await client.complete(prompt=PROMPT, sampling=sampling)
        finally:
            await client.close()

    expected = asyncio.run(reference())
    with extra_gateway(stack, tmp_path_factory, "gateway-doomed-node") as doomed:
        process = subprocess.Popen(
            [node, str(NODE_DIR / "generate.js"), f"{doomed.child.address},{stack.target}",
             PROMPT, "--max-tokens", "160", "--ignore-eos"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        # Killed once its stream runs: its decode worker holds the request.
        settle(lambda: [w["running"] for w in stack.workers() if w["role"] == "decode"],
               lambda running: sum(running) > 0, 60.0)  # fmt: skip
        doomed.process.send_signal(signal.SIGKILL)
        out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    result = json.loads(out)
    assert result["resumes"] == 1
    assert result["finish_reason"] == "FINISH_REASON_LENGTH"
    assert result["tokens"] == expected.token_ids and len(expected.token_ids) == 160
    assert result["text"] == expected.text
    assert result["usage"]["completion_tokens"] == 160
    stack.wait_all_free()
