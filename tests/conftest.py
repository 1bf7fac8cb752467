from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The default model's safetensors checkpoint (converted once into $PDSERVE_CACHE)."""
    from common.models.default_model import convert_default_model

    return convert_default_model()
