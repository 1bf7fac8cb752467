"""OpenTelemetry tracing, configured only by the standard ``OTEL_*`` environment variables.

What gets installed:
- ``OTEL_SDK_DISABLED=true``, or ``OTEL_TRACES_EXPORTER=none``, or no exporter to send to
  (the default ``otlp`` exporter without ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``): nothing.
  The API's no-op tracer still carries an incoming ``traceparent`` through to downstream
  calls, so a client's trace is not cut by a pdserve process that does not export.
- Otherwise an SDK ``TracerProvider`` with one ``BatchSpanProcessor`` per exporter
  (``OTEL_BSP_*`` tune them): ``otlp`` is OTLP over gRPC (the exporter reads the
  ``OTEL_EXPORTER_OTLP_*`` endpoint, headers, insecure, certificate, timeout and
  compression itself), ``console`` prints spans. The SDK reads the sampler from
  ``OTEL_TRACES_SAMPLER[_ARG]`` and the propagators from ``OTEL_PROPAGATORS``.

The resource takes ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``; without them
``service.name`` is ``pdserve-<role>`` and ``service.instance.id`` the worker id.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

log = logging.getLogger(__name__)

TRACER_NAME = "pdserve"
_KNOWN_EXPORTERS = ("otlp", "console", "none")


def tracer() -> trace.Tracer:
    """The tracer every pdserve module uses (a proxy until a provider is installed)."""
    return trace.get_tracer(TRACER_NAME)


@dataclass(frozen=True)
class TracingConfig:
    """What the ``OTEL_*`` variables ask for, read once."""

    exporters: tuple[str, ...]  # of "otlp", "console"; empty: tracing is off
    service_name: str | None  # OTEL_SERVICE_NAME
    resource_attributes: str  # OTEL_RESOURCE_ATTRIBUTES, as given

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TracingConfig:
        env = os.environ if environ is None else environ
        service_name = env.get("OTEL_SERVICE_NAME") or None
        resource_attributes = env.get("OTEL_RESOURCE_ATTRIBUTES", "")
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls((), service_name, resource_attributes)
        names = [
            n.strip().lower()
            for n in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")
            if n.strip()
        ]
        for name in names:
            if name not in _KNOWN_EXPORTERS:
                raise ValueError(
                    f"OTEL_TRACES_EXPORTER: unknown exporter {name!r}; pdserve has "
                    f"{', '.join(_KNOWN_EXPORTERS)}"
                )
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        exporters = tuple(
            n for n in dict.fromkeys(names) if n == "console" or (n == "otlp" and endpoint)
        )
        if "none" in names:
            exporters = ()
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
        )
        if "otlp" in exporters and protocol != "grpc":
            raise ValueError(
                f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: pdserve exports OTLP over gRPC only"
            )
        return cls(exporters, service_name, resource_attributes)

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)


def build_resource(config: TracingConfig, role: str, instance_id: str | None = None) -> Resource:
    """Our defaults, overridden by whatever ``OTEL_RESOURCE_ATTRIBUTES`` and
    ``OTEL_SERVICE_NAME`` say."""
    attributes: dict[str, str] = {SERVICE_NAME: f"pdserve-{role}", "pdserve.role": role}
    if instance_id:
        attributes[SERVICE_INSTANCE_ID] = instance_id
    attributes.update(_parse_resource_attributes(config.resource_attributes))
    if config.service_name:
        attributes[SERVICE_NAME] = config.service_name
    return Resource.create(attributes)


def _parse_resource_attributes(text: str) -> dict[str, str]:
    """``key1=value1,key2=value2`` (values percent-encoded, as the spec says)."""
    from urllib.parse import unquote

    attributes: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            attributes[key.strip()] = unquote(value.strip())
    return attributes


def build_tracer_provider(
    config: TracingConfig, role: str, instance_id: str | None = None
) -> TracerProvider | None:
    """A provider exporting as configured; None when tracing is off."""
    if not config.enabled:
        return None
    provider = TracerProvider(resource=build_resource(config, role, instance_id))
    for name in config.exporters:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    return provider


def _exporter(name: str) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


class Tracing:
    """The process's tracing, installed once at start-up and flushed on the way out."""

    def __init__(self, provider: TracerProvider | None) -> None:
        self.provider = provider

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def shutdown(self) -> None:
        """Exports what is still buffered (bounded by the exporter's own timeout)."""
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = None


def setup_tracing(role: str, instance_id: str | None = None) -> Tracing:
    """Installs the global tracer provider from the environment, if tracing is on.

    Called once per process, by its entry point (never by libraries or tests).
    """
    config = TracingConfig.from_env()
    provider = build_tracer_provider(config, role, instance_id)
    if provider is not None:
        trace.set_tracer_provider(provider)
        log.info("tracing: exporting spans (%s) as %s", ", ".join(config.exporters),
                 provider.resource.attributes.get(SERVICE_NAME))  # fmt: skip
    return Tracing(provider)
