"""The C++ kernels' CPU targets: the builds a prebuilt directory (the image's) holds, and which
one a process loads on a CPU whose own target has no build there."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import pytest

import kernels.cpu as kcpu

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the named targets are x86-64 ones"
)

_V3 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
_AVX512 = _V3 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512dq", "avx512cd"}
# /proc/cpuinfo flags (the ones that matter) of CPUs this project has run on.
CPUS = {
    "zen3": _V3,
    "icelake": _AVX512,
    "zen4": _AVX512 | {"avx512_bf16"},
    "sapphire-rapids": _AVX512 | {"avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
}
OWN_TARGET = {
    "zen3": "x86-64-v3", "icelake": "avx512", "zen4": "avx512-bf16",
    "sapphire-rapids": "avx512-amx",
}  # fmt: skip


def on_cpu(monkeypatch: pytest.MonkeyPatch, flags: set[str]) -> None:
    monkeypatch.setattr(kcpu, "_cpu_flags", lambda: set(flags))
    monkeypatch.delenv("PDSERVE_CPU_TARGET", raising=False)


def fake_build(flags: list[str]) -> Path:
    """A build's .so where the loader looks for it (an empty file: nothing imports it)."""
    directory = kcpu.build_directory(flags)
    directory.mkdir(parents=True)
    built = directory / "pdserve_cpu_kernels.so"
    built.write_bytes(b"")
    return built


@pytest.mark.parametrize("cpu", list(CPUS))
def test_each_cpu_seen_builds_natively_one_of_the_named_targets(
    cpu: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # So the image's builds are the very ones these CPUs would compile for themselves.
    on_cpu(monkeypatch, CPUS[cpu])
    assert kcpu.target_flags() == kcpu.named_target_flags(OWN_TARGET[cpu])
    assert len({tuple(kcpu.named_target_flags(n)) for n in kcpu.NAMED_TARGETS}) == len(
        kcpu.NAMED_TARGETS
    )


def test_an_unknown_target_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="avx512-amx, avx512-bf16, avx512, x86-64-v3"):
        kcpu.named_target_flags("avx1024")


def test_a_prebuilt_directory_lends_the_best_build_this_cpu_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PDSERVE_KERNELS_DIR", str(tmp_path))
    on_cpu(monkeypatch, CPUS["zen4"])
    assert kcpu.prebuilt_fallback() is None  # nothing built yet
    v3 = fake_build(kcpu.named_target_flags("x86-64-v3"))
    assert kcpu.prebuilt_fallback() == v3
    amx = fake_build(kcpu.named_target_flags("avx512-amx"))
    assert kcpu.prebuilt_fallback() == v3  # AMX code is not for a Zen 4
    avx512 = fake_build(kcpu.named_target_flags("avx512"))
    assert kcpu.prebuilt_fallback() == avx512
    on_cpu(monkeypatch, CPUS["sapphire-rapids"])
    assert kcpu.prebuilt_fallback() == amx
    on_cpu(monkeypatch, CPUS["zen3"])
    assert kcpu.prebuilt_fallback() == v3
    on_cpu(monkeypatch, {"sse4_2"})
    assert kcpu.prebuilt_fallback() is None


def test_the_default_cache_compiles_this_cpus_own_build_instead(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A developer's cache holds the AVX2 build the tests made; the native one must still be
    # compiled there, not replaced by it.
    monkeypatch.delenv("PDSERVE_KERNELS_DIR", raising=False)
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    on_cpu(monkeypatch, CPUS["zen4"])
    fake_build(kcpu.named_target_flags("x86-64-v3"))
    assert kcpu.prebuilt_fallback() is None
    monkeypatch.setenv("PDSERVE_KERNELS_DIR", str(tmp_path / "extensions"))
    assert kcpu.prebuilt_fallback() is not None
    monkeypatch.setenv("PDSERVE_CPU_TARGET", "avx2")  # a target asked for by name: that one
    assert kcpu.prebuilt_fallback() is None


def test_a_build_for_another_cpu_is_compiled_and_never_imported(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setenv("PDSERVE_KERNELS_DIR", str(tmp_path))
    calls: list[dict[str, Any]] = []

    def compile_then_import(name: str, sources: list[str], **kwargs: Any) -> Any:
        # What torch's load() does: number the build (its versioner: a name built before
        # in this process with other arguments becomes <name>_v1), build the library under
        # that name, then import it.
        calls.append(kwargs)
        version = cpp_extension.JIT_EXTENSION_VERSIONER.bump_version_if_changed(
            name, sources, build_arguments=[kwargs["extra_cflags"]],
            build_directory=kwargs["build_directory"], with_cuda=False, with_sycl=False,
            is_python_module=True, is_standalone=False,
        )  # fmt: skip
        built = name if version == 0 else f"{name}_v{version}"
        Path(kwargs["build_directory"], f"{built}.so").write_bytes(b"not for this CPU")
        return cpp_extension._import_module_from_library(built, kwargs["build_directory"], True)

    monkeypatch.setattr(cpp_extension, "load", compile_then_import)
    directory = kcpu.build_target("avx512-amx")
    assert directory == kcpu.build_directory(kcpu.named_target_flags("avx512-amx"))
    assert (directory / "pdserve_cpu_kernels.so").read_bytes() == b"not for this CPU"
    (flags,) = [c["extra_cflags"] for c in calls]
    assert "-mamx-int8" in flags and "-mavx512bf16" in flags and "-march=x86-64-v3" in flags
    # A second run finds the build and compiles nothing.
    kcpu.build_target("avx512-amx")
    assert len(calls) == 1
    # Another target in the same process is a build of its own name, not <name>_v1.
    avx512 = kcpu.build_target("avx512")
    assert (avx512 / "pdserve_cpu_kernels.so").is_file() and len(calls) == 2
