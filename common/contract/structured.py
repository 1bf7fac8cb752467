"""StructuredOutput: a constraint on a request's output text (JSON Schema, any JSON object, a
regex or a context-free grammar), read by llguidance.

Both sides need it: the gateway refuses a constraint llguidance rejects before any prefill
(``check``), and every worker compiles it against its tokenizer (common/engine/grammar.py).
``grammar`` is the one llguidance grammar text both sides derive from the request, so its
hash is the compiled-grammar cache key. llguidance itself imports no torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import TYPE_CHECKING, Any

from common.errors import InvalidRequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from pdserve.common.v1.common_pb2 import StructuredOutput as StructuredOutputPb

FIELD = "sampling.structured_output"
# Bounds on what a request may ask the grammar compiler to do. The text bound keeps the
# request small; the parser limits bound compile and per-token mask work, so a constraint
# that would take too long fails to compile instead of holding a worker (llguidance's own
# defaults allow grammars that take seconds to build).
MAX_CONSTRAINT_CHARS = 128 * 1024
MAX_GRAMMAR_SYMBOLS = 100_000
INITIAL_LEXER_FUEL = 1_000_000
STEP_LEXER_FUEL = 200_000


# JSON as models write it, with no whitespace between tokens to wander in: a small model
# left free to add spaces and newlines can spend its whole budget on them. A schema's own
# "x-guidance" options override these.
JSON_DEFAULTS: JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "
}  # fmt: skip


class ConstraintKind(Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"


def parser_limits() -> Any:
    """The llguidance parser limits every compile and every matcher runs under."""
    import llguidance

    return llguidance.LLParserLimits(
        max_grammar_size=MAX_GRAMMAR_SYMBOLS,
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
        step_lexer_fuel=STEP_LEXER_FUEL,
        verbose_errors=False,
    )


@dataclass(frozen=True)
class StructuredOutput:
    kind: ConstraintKind
    text: str = ""  # the schema, the regex or the grammar; empty for JSON_OBJECT

    def __post_init__(self) -> None:
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(
                FIELD, f"{self.kind.value} is {len(self.text)} characters; at most "
                f"{MAX_CONSTRAINT_CHARS}",
            )  # fmt: skip
        if self.kind is not ConstraintKind.JSON_OBJECT and not self.text:
            raise InvalidRequestError(f"{FIELD}.{self.kind.value}", "must not be empty")

    @cached_property
    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) this constraint compiles to."""
        from llguidance import LLMatcher

        if self.kind is ConstraintKind.JSON_OBJECT:
            return str(LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_DEFAULTS))
        if self.kind is ConstraintKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(
                    f"{FIELD}.json_schema", f"is not JSON: {exc}"
                ) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(
                    f"{FIELD}.json_schema", "must be a JSON object (or true/false)"
                )
            try:
                return str(LLMatcher.grammar_from_json_schema(
                    schema if isinstance(schema, dict) else self.text, JSON_DEFAULTS))  # fmt: skip
            except ValueError as exc:
                raise InvalidRequestError(f"{FIELD}.json_schema", str(exc)) from None
        if self.kind is ConstraintKind.REGEX:
            return str(LLMatcher.grammar_from_regex(self.text))
        text = self.text
        if _is_gbnf(text):
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                text = gbnf_to_lark(text)
            except Exception as exc:  # the converter raises plain exceptions on bad input
                raise InvalidRequestError(f"{FIELD}.grammar", f"GBNF: {exc}") from None
        return str(LLMatcher.grammar_from_lark(text))

    @cached_property
    def key(self) -> str:
        """The compiled-grammar cache key: a hash of the grammar text."""
        return hashlib.sha256(self.grammar.encode()).hexdigest()[:32]

    def check(self) -> None:
        """Raises InvalidRequestError with llguidance's message if it rejects the
        constraint (syntax, unsupported schema keywords, past the limits)."""
        from llguidance import LLMatcher

        is_error, messages = LLMatcher.validate_grammar_with_warnings(
            self.grammar, None, limits=parser_limits()
        )
        if is_error:
            raise InvalidRequestError(f"{FIELD}.{self.kind.value}", messages[0])

    @classmethod
    def from_pb(cls, pb: StructuredOutputPb) -> StructuredOutput | None:
        which = pb.WhichOneof("constraint")
        if which is None:
            return None
        kind = ConstraintKind(which)
        if kind is ConstraintKind.JSON_OBJECT:
            if not pb.json_object:
                raise InvalidRequestError(f"{FIELD}.json_object", "must be true when set")
            return cls(kind)
        return cls(kind, getattr(pb, which))

    def to_pb(self, pb: StructuredOutputPb) -> StructuredOutputPb:
        if self.kind is ConstraintKind.JSON_OBJECT:
            pb.json_object = True
        else:
            setattr(pb, self.kind.value, self.text)
        return pb


def _is_gbnf(text: str) -> bool:
    """GBNF (llama.cpp's grammars) defines rules with ``::=`` and has a ``root`` rule;
    llguidance's Lark-like syntax uses ``:``."""
    return any(line.split("::=")[0].strip() == "root" for line in text.splitlines() if "::=" in line)
