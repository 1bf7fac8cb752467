"""A tritonclient.grpc session against a gateway's KServe v2 port, run as its own process
(tritonclient's stubs and the gateway's register the same protobuf names, so they never
share one): ``python tests/integration/triton_client.py URL MODEL SCENARIO [ARGS as JSON]``
prints one JSON object with what it saw.

Scenarios: ``metadata`` (liveness, readiness, server and model metadata and config),
``infer`` (unary requests), ``stream`` (requests on one decoupled stream), ``errors``,
``resume`` (a stream whose gateway is killed, resumed on another).
"""

from __future__ import annotations

import json
import queue
import sys
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def inputs(prompt: str, sampling: dict[str, Any], stream: bool, exclude: bool) -> list[Any]:
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    flag = grpcclient.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([stream], dtype=bool))
    params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
    excluded = grpcclient.InferInput("exclude_input_in_output", [1], "BOOL")
    excluded.set_data_from_numpy(np.array([exclude], dtype=bool))
    return [text, flag, params, excluded]


def outputs_of(result: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens"):
        value = result.as_numpy(name)
        if value is None:
            continue
        item = value.reshape(-1)[0]
        out[name] = item.decode() if isinstance(item, bytes) else int(item)
    return out


def metadata(client: Any, model: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "live": client.is_server_live(headers=args.get("headers")),
        "ready": client.is_server_ready(headers=args.get("headers")),
        "model_ready": client.is_model_ready(model, headers=args.get("headers")),
        "server": client.get_server_metadata(as_json=True, headers=args.get("headers")),
        "model": client.get_model_metadata(model, as_json=True, headers=args.get("headers")),
        "config": client.get_model_config(model, as_json=True, headers=args.get("headers")),
        "index": client.get_model_repository_index(as_json=True, headers=args.get("headers")),
    }


def infer(client: Any, model: str, args: dict[str, Any]) -> dict[str, Any]:
    results = []
    for prompt in args["prompts"]:
        result = client.infer(
            model, inputs(prompt, args["sampling"], False, args.get("exclude", True)),
            request_id=args.get("request_id", ""), headers=args.get("headers"),
        )  # fmt: skip
        results.append({"id": result.get_response().id, **outputs_of(result)})
    return {"results": results}


def stream(client: Any, model: str, args: dict[str, Any]) -> dict[str, Any]:
    """Every prompt on one stream at once; the responses as they came, per request id."""
    seen: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: seen.put((result, error)),
                        headers=args.get("headers"))  # fmt: skip
    prompts = args["prompts"]
    for i, prompt in enumerate(prompts):
        client.async_stream_infer(
            model, inputs(prompt, args["sampling"], args.get("stream", True), True),
            request_id=f"s{i}", enable_empty_final_response=True,
        )  # fmt: skip
    per_request: dict[str, list[dict[str, Any]]] = {f"s{i}": [] for i in range(len(prompts))}
    errors: list[str] = []
    finals = 0
    while finals + len(errors) < len(prompts):
        result, error = seen.get(timeout=120)
        if error is not None:
            errors.append(str(error))
            continue
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        per_request[response.id].append({**outputs_of(result), "final": final})
        finals += final
    client.stop_stream()
    return {"responses": per_request, "errors": errors}


def errors(client: Any, model: str, args: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = {
        "unknown_model": ("no-such-model", {"max_tokens": 2}),
        "unknown_parameter": (model, {"max_tokens": 2, "beam_width": 4}),
        "bad_number": (model, {"max_tokens": "many"}),
    }
    for name, (which, sampling) in cases.items():
        try:
            client.infer(which, inputs("Hello", sampling, False, True),
                         headers=args.get("headers"))  # fmt: skip
            out[name] = None
        except InferenceServerException as exc:
            out[name] = {"status": exc.status(), "message": exc.message()}
    return out


def resume(client: Any, model: str, args: dict[str, Any]) -> dict[str, Any]:
    """One request streamed; after ``after`` responses the process ``kill_pid`` (its
    gateway) is SIGKILLed, and the request goes again to ``other_url`` with the last
    response's ``resume_token`` parameter. The texts before and after."""
    import os
    import signal

    def run(target: Any, parameters: dict[str, Any], stop_after: int | None) -> list[Any]:
        seen: queue.Queue[tuple[Any, Any]] = queue.Queue()
        target.start_stream(callback=lambda result, error: seen.put((result, error)))
        target.async_stream_infer(
            model, inputs(args["prompt"], args["sampling"], True, True), request_id="r",
            parameters=parameters, enable_empty_final_response=True,
        )  # fmt: skip
        responses = []
        while True:
            result, error = seen.get(timeout=120)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            responses.append({**outputs_of(result),
                              "token": response.parameters["resume_token"].string_param})  # fmt: skip
            if response.parameters["triton_final_response"].bool_param:
                break
            if stop_after is not None and len(responses) >= stop_after:
                os.kill(args["kill_pid"], signal.SIGKILL)
                break
        if stop_after is None:
            target.stop_stream()
        return responses

    before = run(client, {}, args["after"])
    other = grpcclient.InferenceServerClient(url=args["other_url"])
    after = run(other, {"resume_token": before[-1]["token"]}, None)
    return {"before": before, "after": after}


SCENARIOS = {
    "metadata": metadata, "infer": infer, "stream": stream, "errors": errors, "resume": resume,
}  # fmt: skip


def main() -> None:
    url, model, scenario = sys.argv[1:4]
    args = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    client = grpcclient.InferenceServerClient(url=url)
    try:
        print(json.dumps(SCENARIOS[scenario](client, model, args)))
    finally:
        client.close()


if __name__ == "__main__":
    main()
