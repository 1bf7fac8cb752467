"""The gRPC contract: stubs match protos/, buf lint is clean, messages keep the conventions."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor

from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import gateway_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "protos"
PROTO_FILES = sorted(PROTO_ROOT.glob("pdserve/*/v1/*.proto"))


def _stub_module(proto: Path) -> ModuleType:
    relative = proto.relative_to(PROTO_ROOT).with_suffix("")
    return importlib.import_module(".".join(relative.parts) + "_pb2")


def _all_messages(messages: Iterator[Descriptor]) -> Iterator[Descriptor]:
    for message in messages:
        yield message
        yield from _all_messages(iter(message.nested_types))


def _all_enums() -> Iterator[EnumDescriptor]:
    for proto in PROTO_FILES:
        file = _stub_module(proto).DESCRIPTOR
        yield from file.enum_types_by_name.values()
        for message in _all_messages(iter(file.message_types_by_name.values())):
            yield from message.enum_types


def _all_fields() -> Iterator[FieldDescriptor]:
    for proto in PROTO_FILES:
        file = _stub_module(proto).DESCRIPTOR
        for message in _all_messages(iter(file.message_types_by_name.values())):
            yield from message.fields


def _find_buf() -> str | None:
    candidates = [os.environ.get("BUF"), str(Path(sys.executable).parent / "buf")]
    candidates += [str(ROOT / ".venv" / "bin" / "buf"), shutil.which("buf")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def test_proto_files_cover_every_area() -> None:
    areas = {proto.relative_to(PROTO_ROOT).parts[1] for proto in PROTO_FILES}
    assert areas == {"common", "kv", "prefill", "decode", "gateway", "worker"}


def test_stubs_are_up_to_date() -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_protos.sh"), "--check"],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_lint_is_clean() -> None:
    buf = _find_buf()
    if buf is None:
        pytest.skip("buf binary not installed (.venv/bin/pip install buf-bin)")
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "buf_lint.sh")],
        env={**os.environ, "BUF": buf},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_enum_zero_value_is_unspecified() -> None:
    enums = list(_all_enums())
    assert {e.full_name for e in enums} >= {
        "pdserve.common.v1.FinishReason",
        "pdserve.common.v1.KvDtype",
        "pdserve.common.v1.WorkerRole",
    }
    for enum in enums:
        prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper()
        assert enum.values_by_number[0].name == f"{prefix}_UNSPECIFIED", enum.full_name


def test_token_ids_are_repeated_uint32() -> None:
    token_fields = [f for f in _all_fields() if f.name.endswith("token_ids") or f.name == "ids"]
    assert len(token_fields) >= 8
    for field in token_fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE:  # a oneof member wraps the list
            assert field.message_type is not None, field.full_name
            assert field.message_type.full_name == "pdserve.gateway.v1.TokenIds", field.full_name
            continue
        assert field.type == FieldDescriptor.TYPE_UINT32, field.full_name
        assert field.is_repeated, field.full_name
    for field in (f for f in _all_fields() if f.name.endswith("token_id")):
        assert field.type == FieldDescriptor.TYPE_UINT32, field.full_name


def test_one_service_per_file() -> None:
    for proto in PROTO_FILES:
        services = _stub_module(proto).DESCRIPTOR.services_by_name
        assert len(services) <= 1, (proto.name, list(services))


def test_every_rpc_comment_lists_real_status_codes() -> None:
    code_line = re.compile(r"^//\s+([A-Z_]+(?:, [A-Z_]+)*):")
    num_rpcs = 0
    for proto in PROTO_FILES:
        lines = [line.strip() for line in proto.read_text().splitlines()]
        for i, line in enumerate(lines):
            match = re.match(r"rpc (\w+)\(", line)
            if match is None:
                continue
            num_rpcs += 1
            start = i
            while start > 0 and lines[start - 1].startswith("//"):
                start -= 1
            comment = lines[start:i]
            assert "// Status codes:" in comment, f"{proto.name}: {match[1]}"
            codes = [c for m in map(code_line.match, comment) if m for c in m[1].split(", ")]
            assert "OK" in codes, f"{proto.name}: {match[1]}"
            unknown = set(codes) - set(grpc.StatusCode.__members__)
            assert not unknown, f"{proto.name}: {match[1]}: {unknown}"
    assert num_rpcs == 20


def test_generate_request_input_is_a_oneof_of_four() -> None:
    oneof = gateway_pb2.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"]
    assert [f.name for f in oneof.fields] == ["prompt", "messages", "raw_prompt", "token_ids"]

    request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1, 2, 3]))
    assert request.WhichOneof("input") == "token_ids"
    request.prompt = "hello"
    assert request.WhichOneof("input") == "prompt"
    assert not request.HasField("token_ids")


def test_sampling_defaults_that_are_not_zero_have_presence() -> None:
    fields = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    for name in ("temperature", "top_p", "seed", "repetition_penalty"):
        assert fields[name].has_presence, name
    params = common_pb2.SamplingParams(temperature=0.0)
    assert params.HasField("temperature")
    assert not params.HasField("top_p")


def test_kv_handle_round_trips() -> None:
    handle = common_pb2.KvHandle(
        request_id="req-1",
        hash_scheme_version=1,
        block_hashes=[0x0123456789ABCDEF, 2**64 - 1],
        num_tokens=37,
        layout=common_pb2.KvLayout(
            num_layers=30,
            num_kv_heads=3,
            head_dim=64,
            block_size=16,
            dtype=common_pb2.KV_DTYPE_BFLOAT16,
            bytes_per_block=30 * 2 * 16 * 3 * 64 * 2,
        ),
        producer_address="10.0.0.7:50061",
        lease_id="lease-9",
        lease_expiry_unix_ms=1_767_225_600_123,
        model="SmolLM2-135M-Instruct",
    )

    decoded = common_pb2.KvHandle.FromString(handle.SerializeToString())

    assert decoded == handle
    assert list(decoded.block_hashes) == [0x0123456789ABCDEF, 2**64 - 1]
    assert decoded.layout.dtype == common_pb2.KV_DTYPE_BFLOAT16
    assert decoded.layout.bytes_per_block == 368_640
    assert decoded.lease_expiry_unix_ms == 1_767_225_600_123
