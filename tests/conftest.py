from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import common.openmp  # noqa: F401  (before torch: OpenMP's wait policy)

# isort: split
import pytest
import torch

torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``stack`` on every test under tests/integration (each starts real processes, most a
    whole ``pdserve up`` with its redis-server), so ``pytest -m "not stack"`` is the quick
    loop; ``redis`` and ``gpu`` are marked where the tests are."""
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.stack)
            item.add_marker(pytest.mark.redis)


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The default model's safetensors checkpoint (converted once into $PDSERVE_CACHE)."""
    from common.models.default_model import convert_default_model

    return convert_default_model()


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
