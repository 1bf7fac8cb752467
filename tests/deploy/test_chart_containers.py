"""The image built with podman, and every pod of the Helm chart run from it under its own
pod spec: `bash deploy/build_image.sh`, then `bash deploy/run_chart_local.sh`, as a user
would run them. Under the `container` marker, outside CI's run (`pytest -m container`): the
build compiles the C++ kernels for four CPU targets (about 20 minutes on 2 cores, cached
between runs on one machine) and the chart's run takes two more."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.container


def run(script: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", script], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def test_every_chart_pod_runs_from_the_image_and_a_stream_survives_its_decode_pod() -> None:
    build = run("deploy/build_image.sh", timeout=3600)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    assert "built in" in build.stdout
    chart = run("deploy/run_chart_local.sh", timeout=1800)
    report = chart.stderr
    assert chart.returncode == 0, report[-6000:]
    # What deploy/chart_local.py checked, each named in its report.
    assert report.count("startup, readiness and liveness probes pass") == 6  # 6 serving pods
    assert "demo-pdserve-test-generate answered: " in report
    assert "nothing written outside its volumes" in report
    assert "decode kill: the stream went on after demo-pdserve-decode-" in report
    assert "the engine pods load the image's C++ kernels (/opt/pdserve/kernels/" in report
    # It ends with the test pod's answer, on stdout.
    assert "every check passed" in report and chart.stdout.strip()
