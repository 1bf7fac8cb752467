"""C++ kernels for the CPU path (AVX2 / FMA / F16C, torch's thread pool), each beside a torch
reference with the same signature. See kernels/README.md.

The extension is compiled once per torch version, CPU target and source text with torch's
``cpp_extension`` (``python -m kernels.cpu`` does it ahead of time; scripts/setup.sh and the
container image run that) into ``$PDSERVE_KERNELS_DIR`` (default
``$PDSERVE_CACHE/extensions``). A build already there is imported directly, so serving needs
no compiler and may run from a read-only directory.

Target: x86-64-v3 (AVX2, FMA, F16C, the level every x86 server of the last decade has) when
the CPU has it, plus AVX512-VL/VNNI where those are there too (Ice Lake, Zen 4 and later:
the int16 codes' multiply-adds then accumulate in one instruction, vpdpwssd on 256-bit
registers; the sums are the same integers), and with AVX512-BW as well the x16 kernels
(quant_x16.cpp: 16 weight rows in the lanes of a 512-bit register), else baseline x86-64 or
the host's default; the portable C++ loops run there, slowly. The build directory is keyed on the target. The kernels split their work over a pool of their own (pool.cpp: the caller never
waits for a helper that has not started, where OpenMP's barrier waits for a descheduled one),
sized by ``torch.set_num_threads``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_SOURCES = (
    "module.cpp", "pool.cpp", "quant_matmul.cpp", "quant_x16.cpp", "kquant_x16.cpp", "ops.cpp",
    "decode_attention_x16.cpp", "decode_model.cpp", "fp8_matmul.cpp", "kernels.h",
)
_NAME = "pdserve_cpu_kernels"
_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None


class KernelUnavailableError(RuntimeError):
    """The C++ extension could not be built or loaded here (no compiler, ...)."""


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# PDSERVE_CPU_TARGET=avx2 builds for x86-64-v3 even on an AVX-512 CPU (a build of its own:
# the directory is keyed on the target), so that the AVX2 paths run and are tested there.
TARGETS = ("native", "avx2")


def target_flags() -> list[str]:
    """The compiler's target for this CPU (module docstring), or PDSERVE_CPU_TARGET's."""
    target = os.environ.get("PDSERVE_CPU_TARGET", "native")
    if target not in TARGETS:
        raise ValueError(f"PDSERVE_CPU_TARGET must be one of {TARGETS}, got {target!r}")
    if platform.machine() in ("x86_64", "AMD64"):
        flags = _cpu_flags()
        if target == "avx2" and {"avx2", "fma", "f16c"} <= flags:
            return ["-march=x86-64-v3"]
        if {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
            avx512 = ["-march=x86-64-v3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
            # vdpbf16ps for a bfloat16 head (fp8_matmul.cpp)
            bf16 = ["-mavx512bf16"] if "avx512_bf16" in flags else []
            # AMX's int8 tiles for 16-row tiles (quant_x16.cpp); taken at run time only when
            # the kernel grants the tile state (kernels.h amx_on)
            amx = ["-mamx-tile", "-mamx-int8"] if {"amx_tile", "amx_int8"} <= flags else []
            return avx512 + bf16 + amx
        if {"avx2", "fma", "f16c", "avx512vl", "avx512_vnni"} <= flags:
            return ["-march=x86-64-v3", "-mavx512vl", "-mavx512vnni"]
        if {"avx2", "fma", "f16c"} <= flags:
            return ["-march=x86-64-v3"]
        return ["-march=x86-64"]
    return []


def _source_dir() -> Path:
    return Path(__file__).parent


def build_directory() -> Path:
    """Where this torch, target and source text's build lives."""
    import torch

    override = os.environ.get("PDSERVE_KERNELS_DIR")
    cache = Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")
    root = Path(override) if override else cache / "extensions"
    digest = hashlib.sha256()
    digest.update(f"{torch.__version__}|{platform.machine()}|{target_flags()}".encode())
    for source in _SOURCES:
        digest.update((_source_dir() / source).read_bytes())
    return root / f"{_NAME}-{digest.hexdigest()[:12]}"


def _import_built(path: Path) -> ModuleType:
    import torch  # noqa: F401  (the extension links against libtorch, loaded by this import)

    spec = importlib.util.spec_from_file_location(_NAME, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(directory: Path, verbose: bool) -> ModuleType:
    """Builds under an flock of our own: torch's own build lock is a plain file that a
    killed build leaves behind, and every later build would wait on it for ever. The flock
    dies with its holder, so whoever holds it may clear a stale torch lock."""
    from torch.utils.cpp_extension import load as load_extension

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        built = directory / f"{_NAME}.so"
        if built.is_file():  # another process built it while this one waited
            return _import_built(built)
        (directory / "lock").unlink(missing_ok=True)
        return load_extension(
            _NAME,
            [str(_source_dir() / s) for s in _SOURCES if s.endswith(".cpp")],
            extra_cflags=["-O3", *target_flags(), "-fopenmp", "-DNDEBUG"],
            extra_include_paths=[str(_source_dir())],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=verbose,
        )


def load(verbose: bool = False) -> ModuleType:
    """The compiled extension (built on first use); raises KernelUnavailableError."""
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise KernelUnavailableError(_error)
        directory = build_directory()
        built = directory / f"{_NAME}.so"
        try:
            _module = _import_built(built) if built.is_file() else _build(directory, verbose)
        except Exception as exc:  # a compiler, ninja or headers missing: say so once
            _error = f"the C++ CPU kernels could not be built or loaded in {directory}: {exc}"
            raise KernelUnavailableError(_error) from exc
        assert _module is not None
        if not _module.has_avx2():
            log.warning("C++ CPU kernels built without AVX2/FMA/F16C: the portable path is slow")
        return _module


def loaded() -> ModuleType | None:
    """The extension if this process has loaded it already, else None (never builds): for
    callers that take a kernel only where the engine's path brought them in."""
    return _module


def available() -> bool:
    try:
        load()
    except KernelUnavailableError:
        return False
    return True
