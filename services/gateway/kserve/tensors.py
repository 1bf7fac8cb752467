"""The KServe v2 tensors a text model reads and writes, in both encodings the protocol has:
``raw_input_contents`` / ``raw_output_contents`` (what tritonclient sends) and the typed
``contents`` fields. A BYTES element on the raw path is a 4-byte little-endian length and
then its bytes; BOOL is one byte, UINT32 four, little-endian.

The tensor names are those of Triton's vLLM backend, so clients written for it (and
perf_analyzer / genai-perf) work unchanged:

- inputs: ``text_input`` (BYTES, [1]), optional ``stream`` (BOOL), ``sampling_parameters``
  (BYTES: a JSON object), ``exclude_input_in_output`` (BOOL);
- outputs: ``text_output`` (BYTES), ``finish_reason`` (BYTES), ``num_input_tokens`` and
  ``num_output_tokens`` (UINT32).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

from common.errors import InvalidRequestError
from pdserve.common.v1 import common_pb2
from pdserve.kserve.v2.grpc_service_pb2 import ModelInferRequest as InferRequest
from pdserve.kserve.v2.grpc_service_pb2 import ModelInferResponse as InferResponse
from services.gateway.constraints import vllm_constraints

INPUTS = {  # name -> (datatype, required)
    "text_input": ("BYTES", True),
    "stream": ("BOOL", False),
    "sampling_parameters": ("BYTES", False),
    "exclude_input_in_output": ("BOOL", False),
}
OUTPUTS = {
    "text_output": "BYTES",
    "finish_reason": "BYTES",
    "num_input_tokens": "UINT32",
    "num_output_tokens": "UINT32",
}
# vLLM's SamplingParams defaults where they differ from ours: 16 tokens, temperature 1.
DEFAULT_MAX_TOKENS = 16


def decode_bytes(raw: bytes) -> list[bytes]:
    """A raw BYTES tensor: (uint32 LE length, bytes) per element."""
    out, at = [], 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise InvalidRequestError("raw_input_contents", "a BYTES element is cut short")
        (size,) = struct.unpack_from("<I", raw, at)
        at += 4
        if at + size > len(raw):
            raise InvalidRequestError("raw_input_contents", "a BYTES element is cut short")
        out.append(raw[at : at + size])
        at += size
    return out


def encode_bytes(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


@dataclass
class TextRequest:
    """What a ModelInferRequest asks of a text model."""

    text: str
    stream: bool = False
    exclude_input: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)  # requested; empty = all
    cache_salt: str = ""  # pdserve's request parameter: prefix caching as GenerateRequest's
    # pdserve's request parameter: continue the request whose stream broke after the
    # response that carried this resume_token parameter (GenerateRequest.resume).
    resume_token: str = ""


def _element(request: InferRequest, index: int, name: str, datatype: str) -> bytes | bool:
    tensor = request.inputs[index]
    if tensor.datatype != datatype:
        raise InvalidRequestError(
            f"inputs.{name}", f"datatype {tensor.datatype or '(none)'}; this model takes {datatype}"
        )
    if request.raw_input_contents:
        if index >= len(request.raw_input_contents):
            raise InvalidRequestError(
                "raw_input_contents", f"{len(request.raw_input_contents)} entries for "
                f"{len(request.inputs)} inputs"
            )  # fmt: skip
        raw = request.raw_input_contents[index]
        if datatype == "BYTES":
            items: list[Any] = decode_bytes(raw)
        else:
            items = [bool(b) for b in raw]
    elif datatype == "BYTES":
        items = list(tensor.contents.bytes_contents)
    else:
        items = list(tensor.contents.bool_contents)
    if len(items) != 1:
        raise InvalidRequestError(f"inputs.{name}", f"{len(items)} elements; send one")
    return items[0]


def parse_request(request: InferRequest) -> TextRequest:
    """The text request in a ModelInferRequest; INVALID_ARGUMENT naming what is wrong."""
    values: dict[str, Any] = {}
    for index, tensor in enumerate(request.inputs):
        if tensor.name not in INPUTS:
            raise InvalidRequestError(
                "inputs", f"unknown input {tensor.name!r}; this model takes {sorted(INPUTS)}"
            )
        values[tensor.name] = _element(request, index, tensor.name, INPUTS[tensor.name][0])
    if "text_input" not in values:
        raise InvalidRequestError("inputs", "text_input (BYTES, shape [1]) is required")
    try:
        text = values["text_input"].decode()
    except UnicodeDecodeError as exc:
        raise InvalidRequestError("inputs.text_input", f"is not UTF-8: {exc}") from exc
    sampling: dict[str, Any] = {}
    if "sampling_parameters" in values:
        try:
            sampling = json.loads(values["sampling_parameters"])
        except ValueError as exc:
            raise InvalidRequestError(
                "inputs.sampling_parameters", f"is not a JSON object: {exc}"
            ) from exc
        if not isinstance(sampling, dict):
            raise InvalidRequestError("inputs.sampling_parameters", "is not a JSON object")
    cache_salt = resume_token = ""
    for key, parameter in request.parameters.items():  # request parameters: the same names
        value = getattr(parameter, parameter.WhichOneof("parameter_choice") or "string_param")
        if key == "cache_salt":
            cache_salt = str(value)
        elif key == "resume_token":
            resume_token = str(value)
        elif not key.startswith("triton_"):
            sampling.setdefault(key, value)
    outputs = [o.name for o in request.outputs]
    for name in outputs:
        if name not in OUTPUTS:
            raise InvalidRequestError(
                "outputs", f"unknown output {name!r}; this model has {sorted(OUTPUTS)}"
            )
    return TextRequest(
        text=text,
        stream=bool(values.get("stream", False)),
        exclude_input=bool(values.get("exclude_input_in_output", False)),
        sampling=sampling,
        outputs=outputs,
        cache_salt=cache_salt,
        resume_token=resume_token,
    )


def _number(key: str, value: Any, kind: type) -> Any:
    """vLLM's backend takes numbers as JSON numbers or as strings ("0.7")."""
    try:
        if kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                return value.lower() in ("true", "1")
            return bool(value)
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(
            f"sampling_parameters.{key}", f"{value!r} is not a {kind.__name__}"
        ) from exc


_FIELDS: dict[str, type] = {
    "max_tokens": int, "min_tokens": int, "temperature": float, "top_p": float, "top_k": int,
    "min_p": float, "seed": int, "presence_penalty": float, "frequency_penalty": float,
    "repetition_penalty": float, "ignore_eos": bool,
}  # fmt: skip


_OTHER_KEYS = (  # the keys beside the numeric and boolean _FIELDS
    "stop", "stop_token_ids", "structured_outputs", "guided_decoding")


def sampling_pb(params: dict[str, Any]) -> common_pb2.SamplingParams:
    """vLLM's sampling parameter names onto the gateway's SamplingParams."""
    pb = common_pb2.SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
    for key, value in params.items():
        if key in _FIELDS:
            number = _number(key, value, _FIELDS[key])
            if key == "top_k":
                number = max(number, 0)  # vLLM's -1: off
            setattr(pb, key, number)
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise InvalidRequestError("sampling_parameters.stop", "a string or strings")
            pb.stop.extend(stops)
        elif key in ("structured_outputs", "guided_decoding"):  # vLLM's, either name
            found = vllm_constraints(value, f"sampling_parameters.{key}")
            if len(found) > 1 or (found and pb.HasField("structured_output")):
                raise InvalidRequestError(
                    f"sampling_parameters.{key}", "at most one constraint per request"
                )
            if found:
                pb.structured_output.CopyFrom(found[0][1])
        elif key == "stop_token_ids":
            if not isinstance(value, list):
                raise InvalidRequestError("sampling_parameters.stop_token_ids", "a list")
            pb.stop_token_ids.extend(_number(key, v, int) for v in value)
        else:
            raise InvalidRequestError(
                f"sampling_parameters.{key}",
                f"unknown; this model takes {sorted([*_FIELDS, *_OTHER_KEYS])}",
            )
    if pb.max_tokens < 1:
        raise InvalidRequestError("sampling_parameters.max_tokens", "must be >= 1")
    return pb


def response(
    request: InferRequest, model: str, text: str, wanted: list[str],
    finish_reason: str | None = None, num_input_tokens: int | None = None,
    num_output_tokens: int | None = None, final: bool | None = None, resume_token: str = "",
) -> InferResponse:  # fmt: skip
    """One response: ``text_output`` always (when wanted), the counts and the finish reason
    once known; ``final`` (streaming) sets Triton's ``triton_final_response`` parameter, and
    ``resume_token`` (streaming) pdserve's, what resumes the request after it."""
    out = InferResponse(model_name=model, model_version="1", id=request.id)
    values: dict[str, bytes] = {"text_output": encode_bytes([text.encode()])}
    if finish_reason is not None:
        values["finish_reason"] = encode_bytes([finish_reason.encode()])
    if num_input_tokens is not None:
        values["num_input_tokens"] = struct.pack("<I", num_input_tokens)
    if num_output_tokens is not None:
        values["num_output_tokens"] = struct.pack("<I", num_output_tokens)
    for name, raw in values.items():
        if wanted and name not in wanted:
            continue
        out.outputs.add(name=name, datatype=OUTPUTS[name], shape=[1])
        out.raw_output_contents.append(raw)
    if final is not None:
        out.parameters["triton_final_response"].bool_param = final
    if resume_token:
        out.parameters["resume_token"].string_param = resume_token
    return out
