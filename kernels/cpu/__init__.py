"""C++ kernels for the CPU path (AVX2 / FMA / F16C, torch's thread pool), each beside a torch
reference with the same signature. See kernels/README.md.

The extension is compiled once per machine and torch version with torch's ``cpp_extension``
(``python -m kernels.cpu`` does it ahead of time; scripts/setup.sh runs that) into
``$PDSERVE_CACHE/extensions/``; later loads take well under a second. ``-march=native``: the
build is for the CPU it runs on, so the cache key includes that CPU's feature flags.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_SOURCES = ("module.cpp", "quant_matmul.cpp", "ops.cpp")
_NAME = "pdserve_cpu_kernels"
_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None


class KernelUnavailableError(RuntimeError):
    """The C++ extension could not be built or loaded here (no compiler, not x86, ...)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build_directory() -> Path:
    import torch

    root = Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")
    key = hashlib.sha256(
        f"{torch.__version__}|{platform.machine()}|{_cpu_flags()}".encode()
    ).hexdigest()[:12]
    return root / "extensions" / f"{_NAME}-{key}"


def load(verbose: bool = False) -> ModuleType:
    """The compiled extension (built on first use); raises KernelUnavailableError."""
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise KernelUnavailableError(_error)
        from torch.utils.cpp_extension import load as load_extension

        here = Path(__file__).parent
        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        try:
            _module = load_extension(
                _NAME,
                [str(here / source) for source in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-DNDEBUG"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=verbose,
            )
        except Exception as exc:  # a compiler, ninja or headers missing: say so once
            _error = f"the C++ CPU kernels could not be built in {directory}: {exc}"
            raise KernelUnavailableError(_error) from exc
        if not _module.has_avx2():
            log.warning("C++ CPU kernels built without AVX2/FMA/F16C: the portable path is slow")
        return _module


def available() -> bool:
    try:
        load()
    except KernelUnavailableError:
        return False
    return True
