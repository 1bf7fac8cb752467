from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import common.openmp  # noqa: F401  (before torch: OpenMP's wait policy)

# isort: split
import pytest
import torch

torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``stack`` on every test under tests/integration (each starts real processes, most a
    whole ``pdserve up`` with its redis-server), so ``pytest -m "not stack"`` is the quick
    loop; ``redis`` and ``gpu`` are marked where the tests are. ``container`` tests (the
    image built with podman and the chart's pods run from it, about 25 minutes on 2 cores)
    run only when a ``-m`` expression names them: ``pytest -m container``."""
    containers_chosen = "container" in (config.getoption("markexpr") or "")
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.stack)
            item.add_marker(pytest.mark.redis)
        if "container" in item.keywords and not containers_chosen:
            item.add_marker(pytest.mark.skip(
                reason="builds the image and runs the chart with podman (about 25 minutes): "
                "run it with -m container"))  # fmt: skip


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The default model's safetensors checkpoint (converted once into $PDSERVE_CACHE)."""
    from common.models.default_model import convert_default_model

    return convert_default_model()


def _run_tool(tool: str, script: str, *args: str) -> None:
    """Runs a quantization tool's script with the tool's own venv (scripts/quant_tools.sh)."""
    import os
    import subprocess
    import sys

    cache = Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")
    python = cache / "venvs" / tool / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} is missing: run bash scripts/quant_tools.sh (scripts/test.sh does)")
    path = Path(__file__).resolve().parents[1] / "loadtest" / "baselines" / script
    done = subprocess.run([str(python), str(path), *args], capture_output=True, text=True, timeout=900)
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        pytest.fail(f"{tool} failed ({done.returncode}); its output is above")


@pytest.fixture(scope="session")
def ct_checkpoints(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """Tiny compressed-tensors checkpoints made by llm-compressor itself, run from its own
    venv (scripts/quant_tools.sh): ``<dir>/<arch>-<scheme>/`` and ``<arch>-float/``
    (loadtest/baselines/make_ct_checkpoints.py; about 30 s for all of them)."""
    out = tmp_path_factory.mktemp("ct")
    _run_tool("llmcompressor", "make_ct_checkpoints.py", "--out", str(out), "--tokenizer", str(smollm_dir))
    return out


@pytest.fixture(scope="session")
def awq_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny AWQ checkpoints made by AutoAWQ itself on the CPU, each with the tool's own
    dequantization's digests (loadtest/baselines/make_gptq_awq_files.py; about 25 s)."""
    out = tmp_path_factory.mktemp("awq")
    _run_tool("autoawq", "make_gptq_awq_files.py", "--tool", "autoawq", "--out", str(out))
    return out


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models: one torch thread for a module (``pytest.mark.usefixtures("one_thread")``).
    Two threads on a busy 2-core machine made every parallel region of these
    microsecond-sized ops wait on a descheduled thread (measured: a tiny MoE's forced-greedy
    pass 7.3 s with 2 threads, 0.06 s with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
