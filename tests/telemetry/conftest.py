"""Spans of this test process go to memory: one SDK provider for the whole session
(OpenTelemetry allows the global provider to be set once per process), recording only
while a test that asked for ``spans`` runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


class _Recorder(SimpleSpanProcessor):
    """Keeps spans only while ``active`` (other tests of the session trace into nothing)."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        super().__init__(exporter)
        self.active = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.active:
            super().on_end(span)


_EXPORTER = InMemorySpanExporter()
_RECORDER = _Recorder(_EXPORTER)


def _install() -> None:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(_RECORDER)


_install()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The spans finished during the test."""
    _EXPORTER.clear()
    _RECORDER.active = True
    try:
        yield _EXPORTER
    finally:
        _RECORDER.active = False
        _EXPORTER.clear()
