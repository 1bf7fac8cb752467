"""Structured-output constraints at the gateway: the check (llguidance validates each one
before routing or any prefill, on a thread, as validation can take milliseconds for a
large schema; a constraint once valid is remembered by its content hash), and vLLM's
spellings of a constraint, which the OpenAI and KServe front doors both take."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import OrderedDict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from common.contract.structured import ConstraintKind, StructuredOutput
from common.errors import InvalidRequestError
from common.telemetry.metrics import metric_name
from pdserve.common.v1 import common_pb2


class ConstraintChecker:
    def __init__(self, registry: CollectorRegistry, cache_size: int = 256) -> None:
        self.cache_size = cache_size
        self._valid: OrderedDict[str, None] = OrderedDict()
        self.requests = Counter(
            metric_name("structured_output_requests"),
            "Requests with a structured-output constraint, by its kind.",
            ["kind"], registry=registry,
        )  # fmt: skip
        for kind in ConstraintKind:
            self.requests.labels(kind.value)
        self.check_seconds = Histogram(
            metric_name("structured_output_check_seconds"),
            "Seconds the gateway took to validate a constraint not seen before.",
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
        )

    async def check(self, constraint: StructuredOutput) -> None:
        """Raises InvalidRequestError with llguidance's message for a constraint it rejects."""
        self.requests.labels(constraint.kind.value).inc()
        key = await asyncio.to_thread(lambda: constraint.key)  # builds the grammar text
        if key in self._valid:
            self._valid.move_to_end(key)
            return
        started = time.perf_counter()
        await asyncio.to_thread(constraint.check)
        self.check_seconds.observe(time.perf_counter() - started)
        self._valid[key] = None
        while len(self._valid) > self.cache_size:
            self._valid.popitem(last=False)


# -- vLLM's spellings, shared by the front doors ----------------------------------------------


def schema_text(value: Any, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, bool)):
        return json.dumps(value)
    raise InvalidRequestError(field, "must be a JSON schema (an object, or its JSON text)")


def choice_regex(choices: Any, field: str) -> str:
    if not isinstance(choices, list) or not choices or not all(
        isinstance(c, str) for c in choices
    ):
        raise InvalidRequestError(field, "must be a non-empty list of strings")
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def vllm_constraints(value: Any, field: str) -> list[tuple[str, common_pb2.StructuredOutput]]:
    """vLLM's ``structured_outputs`` (once ``guided_decoding``) object, ``{"json": schema}``,
    ``{"regex": ...}``, ``{"grammar": ...}``, ``{"choice": [...]}`` or
    ``{"json_object": true}``: (where it was set, the constraint) for each key set."""
    if not isinstance(value, dict):
        raise InvalidRequestError(field, "must be an object")
    found = []
    for key in ("json", "regex", "grammar", "choice", "json_object"):
        item = value.get(key)
        if item is None:
            continue
        source = f"{field}.{key}"
        if key == "json":
            pb = common_pb2.StructuredOutput(json_schema=schema_text(item, source))
        elif key == "choice":
            pb = common_pb2.StructuredOutput(regex=choice_regex(item, source))
        elif key == "json_object":
            pb = common_pb2.StructuredOutput(json_object=bool(item))
        elif key == "regex":
            pb = common_pb2.StructuredOutput(regex=str(item))
        else:
            pb = common_pb2.StructuredOutput(grammar=str(item))
        found.append((source, pb))
    return found
