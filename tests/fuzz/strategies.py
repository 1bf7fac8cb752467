"""Hypothesis strategies for any protobuf message, built field by field from its DESCRIPTOR.

``messages(Cls)`` draws instances of ``Cls``: every field may be left unset or set; scalars
lean towards boundary values (0, 1, the type's extremes, NaN and infinities, empty and
non-ASCII text); enums include a value no enum names (proto3 enums are open); of each oneof
at most one member is set; nested messages recurse up to ``max_depth``. ``overrides`` maps a
field's full name (``pdserve.common.v1.KvHandle.producer_address``) to the strategy its
values come from (for a repeated field: each element's), to keep addresses on loopback or
token ids near the vocabulary; fields named in ``always`` are always set (a required
``request_id``), so that more draws get past validation to the deep paths.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

F = FieldDescriptor
U32, U64 = 2**32 - 1, 2**64 - 1
I32, I64 = 2**31, 2**63

Overrides = Mapping[str, st.SearchStrategy[Any]]
Always = frozenset[str]


def mostly(
    valid: st.SearchStrategy[Any], anything: st.SearchStrategy[Any], odds: int = 3
) -> st.SearchStrategy[Any]:
    """Valid values about ``odds`` times as often as anything else. (Not ``one_of``: its
    branch choice leans towards the last branch, as Hypothesis leans towards bounds.)"""
    return st.integers(0, 10 * (odds + 1) - 1).flatmap(
        lambda i: anything if i % (odds + 1) == 1 else valid
    )


def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (low, low + 1, -1, 0, 1, 2, 15, 16, 17, 20, 21, 255, 65535,
                                10**9, high - 1, high) if low <= v <= high})  # fmt: skip
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


def _floats(width: int) -> st.SearchStrategy[float]:
    edges = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, -2.0, 2.5, math.nan, math.inf, -math.inf, 1e-45]
    return st.one_of(st.sampled_from(edges), st.floats(width=width))


_TEXT = st.one_of(
    st.sampled_from(["", " ", "user", "assistant", "system", "\x00", "é", "🙂", "{{ x }}"]),
    st.text(max_size=40),
)

_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    F.TYPE_UINT32: _ints(0, U32),
    F.TYPE_FIXED32: _ints(0, U32),
    F.TYPE_UINT64: _ints(0, U64),
    F.TYPE_FIXED64: _ints(0, U64),
    F.TYPE_INT32: _ints(-I32, I32 - 1),
    F.TYPE_SINT32: _ints(-I32, I32 - 1),
    F.TYPE_SFIXED32: _ints(-I32, I32 - 1),
    F.TYPE_INT64: _ints(-I64, I64 - 1),
    F.TYPE_SINT64: _ints(-I64, I64 - 1),
    F.TYPE_SFIXED64: _ints(-I64, I64 - 1),
    F.TYPE_BOOL: st.booleans(),
    F.TYPE_FLOAT: _floats(32),
    F.TYPE_DOUBLE: _floats(64),
    F.TYPE_STRING: _TEXT,
    F.TYPE_BYTES: st.binary(max_size=64),
}


def _value(
    field: FieldDescriptor, overrides: Overrides, always: Always, depth: int, max_depth: int
) -> st.SearchStrategy[Any] | None:
    """The strategy of one value of ``field`` (None: a message too deep to draw)."""
    if field.full_name in overrides:
        return overrides[field.full_name]
    if field.type == F.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return st.sampled_from([*numbers, max(numbers) + 1, 99])
    if field.type in (F.TYPE_MESSAGE, F.TYPE_GROUP):
        if depth >= max_depth:
            return None
        return _message(field.message_type, overrides, always, depth + 1, max_depth)
    return _SCALARS[field.type]


@st.composite
def _draw_message(
    draw: st.DrawFn,
    descriptor: Descriptor,
    overrides: Overrides,
    always: Always,
    depth: int,
    max_depth: int,
) -> dict[str, Any]:
    """Field name -> value (a list for repeated fields) of the fields drawn as set."""
    chosen: dict[str, Any] = {}
    in_oneof: dict[str, list[FieldDescriptor]] = {}
    for oneof in descriptor.oneofs:
        in_oneof[oneof.name] = list(oneof.fields)
    oneof_members = {f.name for fields in in_oneof.values() for f in fields}
    for fields in in_oneof.values():
        # At most one member of each oneof (a proto3 `optional` is a oneof of one).
        pick = draw(st.sampled_from([None, *fields]))
        if pick is not None:
            strategy = _value(pick, overrides, always, depth, max_depth)
            if strategy is not None:
                chosen[pick.name] = draw(strategy)
    for field in descriptor.fields:
        if field.name in oneof_members:
            continue
        if field.full_name not in always and not draw(st.booleans()):
            continue
        strategy = _value(field, overrides, always, depth, max_depth)
        if strategy is None:
            continue
        if field.is_repeated:
            least = 1 if field.full_name in always else 0
            chosen[field.name] = draw(st.lists(strategy, min_size=least, max_size=8))
        else:
            chosen[field.name] = draw(strategy)
    return chosen


def _build(descriptor: Descriptor, values: dict[str, Any]) -> Message:
    from google.protobuf import message_factory

    cls = message_factory.GetMessageClass(descriptor)
    message = cls()
    for name, value in values.items():
        field = descriptor.fields_by_name[name]
        if field.type in (F.TYPE_MESSAGE, F.TYPE_GROUP):
            if field.is_repeated:
                getattr(message, name).extend(value)
            else:
                getattr(message, name).CopyFrom(value)
        elif field.is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    return message


def _message(
    descriptor: Descriptor, overrides: Overrides, always: Always, depth: int, max_depth: int
) -> st.SearchStrategy[Message]:
    return _draw_message(descriptor, overrides, always, depth, max_depth).map(
        lambda values: _build(descriptor, values)
    )


def messages(
    cls: type[Message],
    overrides: Overrides | None = None,
    always: Always = frozenset(),
    max_depth: int = 3,
) -> st.SearchStrategy[Message]:
    """Instances of ``cls``, drawn field by field from ``cls.DESCRIPTOR``."""
    return _message(cls.DESCRIPTOR, overrides or {}, always, 0, max_depth)
