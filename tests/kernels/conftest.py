"""Kernel tests run on CPU through Triton's interpreter unless CUDA is present.

TRITON_INTERPRET must be set before triton is first imported (the @triton.jit decorators read
it at import time), so it is set here, before any test module imports kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
