"""Structured output on the OpenAI API: ``response_format`` (``json_object``, ``json_schema``),
forced tool calls (``tool_choice`` ``"required"`` or a named function) and vLLM's extras
(``guided_json``, ``guided_regex``, ``guided_grammar``, ``guided_choice``, and the newer
``structured_outputs`` object) -> the request's ``StructuredOutput``.

Tool calls: with ``tool_choice`` naming a function the output is that function's arguments
(a JSON value of its ``parameters`` schema); with ``"required"`` it is
``{"name": ..., "arguments": ...}`` for one of ``tools``. ``"auto"`` and ``"none"``
constrain nothing: the model answers in text (pdserve parses no model-specific tool-call
syntax)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError
from pdserve.common.v1 import common_pb2
from services.gateway.constraints import choice_regex, schema_text, vllm_constraints


@dataclass(frozen=True)
class ToolMode:
    """How a forced tool call's output text becomes the message's ``tool_calls``."""

    name: str | None  # the named function; None: the output names it ("required")

    def tool_calls(self, text: str) -> list[dict[str, Any]] | None:
        """The message's tool calls, or None when the output did not complete (the
        request stopped at max_tokens mid-object)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.name is not None:
            name, arguments = self.name, value
        elif isinstance(value, dict) and "name" in value and "arguments" in value:
            name, arguments = value["name"], value["arguments"]
        else:
            return None
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        function = {"name": name, "arguments": json.dumps(arguments)}
        return [{"id": call_id, "type": "function", "function": function}]


def _tool_schema(tools: list[Any], tool_choice: Any) -> tuple[str, ToolMode]:
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f"tools[{i}]", 'must be {"type": "function", "function"}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}].function.name", "is required")
        functions[name] = function.get("parameters") or {"type": "object"}
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise InvalidRequestError(
                "tool_choice.function.name", f"{name!r} is not among tools {sorted(functions)}"
            )
        return json.dumps(functions[name]), ToolMode(name)
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in functions.items()
    ]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return json.dumps(schema), ToolMode(None)


def constraint(body: Any) -> tuple[common_pb2.StructuredOutput | None, ToolMode | None]:
    """The request's constraint (at most one source may set it) and, for a forced tool
    call, how to read the output back."""
    found: list[tuple[str, common_pb2.StructuredOutput]] = []
    tool_mode = None

    def add(source: str, **field: Any) -> None:
        found.append((source, common_pb2.StructuredOutput(**field)))

    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        add("response_format", json_object=True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequestError("response_format.json_schema.schema", "is required")
        add("response_format", json_schema=schema_text(
            fmt.json_schema.schema_, "response_format.json_schema.schema"))  # fmt: skip
    if body.guided_json is not None:
        add("guided_json", json_schema=schema_text(body.guided_json, "guided_json"))
    if body.guided_regex is not None:
        add("guided_regex", regex=body.guided_regex)
    if body.guided_grammar is not None:
        add("guided_grammar", grammar=body.guided_grammar)
    if body.guided_choice is not None:
        add("guided_choice", regex=choice_regex(body.guided_choice, "guided_choice"))
    if body.structured_outputs is not None:
        found.extend(vllm_constraints(body.structured_outputs, "structured_outputs"))
    tools = getattr(body, "tools", None)
    tool_choice = getattr(body, "tool_choice", None)
    if tool_choice is not None and tool_choice not in ("none", "auto"):
        if not tools:
            raise InvalidRequestError("tool_choice", "needs tools")
        if tool_choice != "required" and not isinstance(tool_choice, dict):
            raise InvalidRequestError(
                "tool_choice", 'must be "none", "auto", "required" or a named function'
            )
        schema, tool_mode = _tool_schema(tools, tool_choice)
        add("tool_choice", json_schema=schema)
    if len(found) > 1:
        raise InvalidRequestError(
            found[1][0], f"at most one constraint per request; {found[0][0]} sets one already"
        )
    return (found[0][1] if found else None), tool_mode
