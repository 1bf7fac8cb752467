"""Tracing is configured by the standard OTEL_* variables and nothing else."""

from __future__ import annotations

import pytest

from common.telemetry.tracing import TracingConfig, build_resource, build_tracer_provider
from tests.telemetry.otlp_receiver import OtlpReceiver


@pytest.mark.parametrize(
    ("env", "exporters"),
    [
        ({}, ()),  # nothing to send to: off
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "console"}, ("console",)),
        (
            {
                "OTEL_TRACES_EXPORTER": "otlp,console",
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
            },
            ("otlp", "console"),
        ),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ()),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ()),
    ],
)
def test_exporters_follow_the_environment(env: dict[str, str], exporters: tuple[str, ...]) -> None:
    config = TracingConfig.from_env(env)
    assert config.exporters == exporters
    assert config.enabled == bool(exporters)
    provider = build_tracer_provider(config, "gateway")
    assert (provider is None) == (not exporters)
    if provider is not None:
        provider.shutdown()


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_TRACES_EXPORTER": "zipkin"},
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        },
    ],
)
def test_what_pdserve_cannot_export_is_refused(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="OTEL_"):
        TracingConfig.from_env(env)


def test_service_name_defaults_per_role_and_yields_to_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    plain = build_resource(TracingConfig.from_env({}), "prefill", "prefill-0").attributes
    assert plain["service.name"] == "pdserve-prefill"
    assert plain["service.instance.id"] == "prefill-0"
    assert plain["pdserve.role"] == "prefill"

    env = {"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs,deployment.environment=prod%20eu"}
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", env["OTEL_RESOURCE_ATTRIBUTES"])
    attrs = build_resource(TracingConfig.from_env(env), "decode").attributes
    assert attrs["service.name"] == "from-attrs"
    assert attrs["deployment.environment"] == "prod eu"

    env["OTEL_SERVICE_NAME"] = "llm-decode"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-decode")
    assert build_resource(TracingConfig.from_env(env), "decode").attributes["service.name"] == (
        "llm-decode"
    )


def test_spans_reach_an_otlp_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = OtlpReceiver()
    endpoint = receiver.start()
    try:
        # The exporter reads its own variables (endpoint, insecure, headers, ...).
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
        monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
        import os

        provider = build_tracer_provider(TracingConfig.from_env(os.environ), "gateway", "gw-1")
        assert provider is not None
        with provider.get_tracer("t").start_as_current_span("outer"):
            provider.get_tracer("t").start_span("inner").end()
        provider.shutdown()  # flushes
        spans = {s.name: s for s in receiver.wait_for(lambda s: len(s) == 2)}
    finally:
        receiver.stop()
    assert spans["inner"].parent_span_id == spans["outer"].span_id
    assert spans["outer"].service == "pdserve-gateway"
    assert spans["outer"].resource["service.instance.id"] == "gw-1"
