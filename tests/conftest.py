from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))


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
