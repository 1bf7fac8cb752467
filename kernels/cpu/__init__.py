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

_V3 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _V3 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
# The targets a prebuilt directory holds (the container image builds them all with
# `python -m kernels.cpu --targets ...`, on whatever CPU builds it): each is the CPU flags it
# needs, and its compiler flags are exactly what a CPU with only those flags builds natively,
# so on most CPUs the native build is one of them. Best first.
NAMED_TARGETS: dict[str, frozenset[str]] = {
    "avx512-amx": _AVX512 | {"avx512_bf16", "amx_tile", "amx_int8"},
    "avx512-bf16": _AVX512 | {"avx512_bf16"},
    "avx512": _AVX512,
    "x86-64-v3": _V3,
}


def _flags_for(flags: set[str] | frozenset[str]) -> list[str]:
    """The compiler's target for a CPU with these /proc/cpuinfo flags (x86-64)."""
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


def _x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def target_flags() -> list[str]:
    """The compiler's target for this CPU (module docstring), or PDSERVE_CPU_TARGET's."""
    target = os.environ.get("PDSERVE_CPU_TARGET", "native")
    if target not in TARGETS:
        raise ValueError(f"PDSERVE_CPU_TARGET must be one of {TARGETS}, got {target!r}")
    if not _x86():
        return []
    flags = _cpu_flags()
    if target == "avx2" and flags >= _V3:
        return _flags_for(_V3)
    return _flags_for(flags)


def named_target_flags(name: str) -> list[str]:
    """A named target's compiler flags, whatever CPU this is (a build for another CPU)."""
    if name not in NAMED_TARGETS:
        raise ValueError(f"unknown kernel target {name!r}: one of {', '.join(NAMED_TARGETS)}")
    if not _x86():
        raise ValueError("named kernel targets are x86-64 targets; this machine is not one")
    return _flags_for(NAMED_TARGETS[name])


def _source_dir() -> Path:
    return Path(__file__).parent


def _kernels_root() -> Path:
    override = os.environ.get("PDSERVE_KERNELS_DIR")
    cache = Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")
    return Path(override) if override else cache / "extensions"


def build_directory(flags: list[str] | None = None) -> Path:
    """Where this torch, target (this CPU's unless given) and source text's build lives."""
    import torch

    digest = hashlib.sha256()
    target = target_flags() if flags is None else flags
    digest.update(f"{torch.__version__}|{platform.machine()}|{target}".encode())
    for source in _SOURCES:
        digest.update((_source_dir() / source).read_bytes())
    return _kernels_root() / f"{_NAME}-{digest.hexdigest()[:12]}"


def prebuilt_fallback() -> Path | None:
    """In a prebuilt directory ($PDSERVE_KERNELS_DIR, as the image has) without this CPU's
    own build: the best named target's build that this CPU can run, else None. Never in the
    default cache, where this CPU's own build is compiled instead."""
    if not os.environ.get("PDSERVE_KERNELS_DIR") or not _x86():
        return None
    if os.environ.get("PDSERVE_CPU_TARGET", "native") != "native":
        return None
    flags = _cpu_flags()
    for needs in NAMED_TARGETS.values():
        built = build_directory(_flags_for(needs)) / f"{_NAME}.so"
        if needs <= flags and built.is_file():
            return built
    return None


def _import_built(path: Path) -> ModuleType:
    import torch  # noqa: F401  (the extension links against libtorch, loaded by this import)

    spec = importlib.util.spec_from_file_location(_NAME, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(directory: Path, flags: list[str] | None, verbose: bool) -> ModuleType | None:
    """Compiles into ``directory`` and imports the result, or (``flags`` given: another CPU's
    target, whose code this CPU may not run) compiles only. Under an flock of our own:
    torch's own build lock is a plain file that a killed build leaves behind, and every later
    build would wait on it for ever. The flock dies with its holder, so whoever holds it may
    clear a stale torch lock."""
    from unittest import mock

    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        built = directory / f"{_NAME}.so"
        if built.is_file():  # another process built it while this one waited
            return _import_built(built) if flags is None else None
        (directory / "lock").unlink(missing_ok=True)
        target = target_flags() if flags is None else flags

        def build() -> ModuleType:
            # torch numbers a name's builds within a process (a second build of the same
            # name with other flags or another directory is <name>_v1, whose init symbol
            # then is PyInit_<name>_v1): every build here is the first of its name.
            versioner = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
            if versioner is not None:
                versioner.entries.pop(_NAME, None)
            return cpp_extension.load(
                _NAME,
                [str(_source_dir() / s) for s in _SOURCES if s.endswith(".cpp")],
                extra_cflags=["-O3", *target, "-fopenmp", "-DNDEBUG"],
                extra_include_paths=[str(_source_dir())],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=verbose,
            )

        if flags is None:
            return build()
        # torch's load() imports what it built; a build for another CPU must not be
        # imported here (its static initializers may use instructions this CPU lacks).
        with mock.patch.object(cpp_extension, "_import_module_from_library", return_value=None):
            build()
        if not built.is_file():
            raise KernelUnavailableError(f"the build for {flags} left no {built.name}")
        return None


def _build(directory: Path, verbose: bool) -> ModuleType:
    module = _compile(directory, None, verbose)
    assert module is not None
    return module


def build_target(name: str, verbose: bool = False) -> Path:
    """Compiles a named target's build (NAMED_TARGETS) without loading it; its directory."""
    flags = named_target_flags(name)
    directory = build_directory(flags)
    _compile(directory, flags, verbose)
    return directory


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
        if not built.is_file():
            fallback = prebuilt_fallback()
            if fallback is not None:
                log.info("C++ CPU kernels: no build for this CPU's own target in %s; "
                         "loading %s, the best prebuilt one it runs", directory.parent,
                         fallback.parent.name)  # fmt: skip
                built, directory = fallback, fallback.parent
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
