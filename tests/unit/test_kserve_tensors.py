"""KServe v2 tensors of a text model: both encodings in, vLLM's sampling names, the outputs."""

from __future__ import annotations

import json
import struct

import pytest

from common.errors import InvalidRequestError
from pdserve.kserve.v2 import grpc_service_pb2 as pb
from services.gateway.kserve import tensors


def raw_request(**extra: object) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", id="r1")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    request.inputs.add(name="stream", datatype="BOOL", shape=[1])
    sampling = json.dumps({"max_tokens": "7", "temperature": 0.5, "top_k": -1, **extra})
    request.raw_input_contents.extend(
        [tensors.encode_bytes([b"Hello"]), tensors.encode_bytes([sampling.encode()]), b"\x01"]
    )
    return request


def test_the_raw_encoding_and_vllms_names() -> None:
    text = tensors.parse_request(raw_request(stop=["\n"]))
    assert (text.text, text.stream, text.exclude_input) == ("Hello", True, False)
    pb_sampling = tensors.sampling_pb(text.sampling)
    assert pb_sampling.max_tokens == 7 and pb_sampling.temperature == pytest.approx(0.5)
    assert pb_sampling.top_k == 0 and list(pb_sampling.stop) == ["\n"]  # -1: off
    assert tensors.sampling_pb({}).max_tokens == tensors.DEFAULT_MAX_TOKENS


def test_typed_contents_and_request_parameters() -> None:
    request = pb.ModelInferRequest(model_name="m")
    text = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append("Grüße".encode())
    flag = request.inputs.add(name="exclude_input_in_output", datatype="BOOL", shape=[1])
    flag.contents.bool_contents.append(True)
    request.parameters["max_tokens"].int64_param = 3
    request.parameters["cache_salt"].string_param = "tenant-a"
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    parsed = tensors.parse_request(request)
    assert parsed.text == "Grüße" and parsed.exclude_input and parsed.cache_salt == "tenant-a"
    assert parsed.sampling == {"max_tokens": 3}


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: r.inputs.add(name="images", datatype="BYTES", shape=[1]), "inputs"),
        (lambda r: setattr(r.inputs[2], "datatype", "INT32"), "inputs.stream"),
        (lambda r: r.raw_input_contents.__setitem__(0, b"\x09\x00\x00\x00abc"),
         "raw_input_contents"),
        (lambda r: r.raw_input_contents.__setitem__(1, tensors.encode_bytes([b"[1]"])),
         "inputs.sampling_parameters"),
        (lambda r: r.outputs.add(name="logits"), "outputs"),
    ],
)  # fmt: skip
def test_malformed_requests_name_the_field(mutate: object, field: str) -> None:
    request = raw_request()
    mutate(request)  # type: ignore[operator]
    with pytest.raises(InvalidRequestError) as refused:
        tensors.parse_request(request)
    assert refused.value.field == field


def test_unknown_or_malformed_sampling_parameters() -> None:
    for params, field in (({"beam_width": 2}, "sampling_parameters.beam_width"),
                          ({"seed": "x"}, "sampling_parameters.seed"),
                          ({"max_tokens": 0}, "sampling_parameters.max_tokens"),
                          ({"ignore_eos": "maybe"}, "sampling_parameters.ignore_eos")):  # fmt: skip
        with pytest.raises(InvalidRequestError) as refused:
            tensors.sampling_pb(params)
        assert refused.value.field == field
    assert tensors.sampling_pb({"ignore_eos": "true", "stop_token_ids": [2, "3"]}).ignore_eos


def test_responses_carry_the_requested_outputs_and_the_final_flag() -> None:
    request = raw_request()
    response = tensors.response(request, "m", "Hi", [], "length", 4, 2, final=True)
    names = [o.name for o in response.outputs]
    assert names == ["text_output", "finish_reason", "num_input_tokens", "num_output_tokens"]
    assert response.raw_output_contents[0] == struct.pack("<I", 2) + b"Hi"
    assert struct.unpack("<I", response.raw_output_contents[3])[0] == 2
    assert response.parameters["triton_final_response"].bool_param
    assert response.id == "r1" and response.model_version == "1"
    only = tensors.response(request, "m", "Hi", ["text_output"], "stop", 1, 1)
    assert [o.name for o in only.outputs] == ["text_output"]
    assert "triton_final_response" not in only.parameters


def test_vllm_structured_outputs_in_sampling_parameters() -> None:
    pb = tensors.sampling_pb({"structured_outputs": {"regex": "[0-9]+"}})
    assert pb.structured_output.regex == "[0-9]+"
    pb = tensors.sampling_pb({"guided_decoding": {"choice": ["yes", "no"]}})
    assert pb.structured_output.regex == "(yes|no)"
    pb = tensors.sampling_pb({"structured_outputs": {"json": {"type": "object"}}})
    assert json.loads(pb.structured_output.json_schema) == {"type": "object"}
    for params, field in (
        ({"structured_outputs": {"regex": "a", "grammar": "start: a"}},
         "sampling_parameters.structured_outputs"),
        ({"structured_outputs": "regex"}, "sampling_parameters.structured_outputs"),
        ({"guided_decoding": {"choice": []}}, "sampling_parameters.guided_decoding.choice"),
    ):  # fmt: skip
        with pytest.raises(InvalidRequestError) as refused:
            tensors.sampling_pb(params)
        assert refused.value.field == field
