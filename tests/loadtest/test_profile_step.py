"""loadtest/profile_step.py: how perf's symbols are named and sorted into parts, and (where
perf may sample this process) a short run of each phase."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from loadtest.profile_step import OTHER, main, part_of, short_name

POOL_TASK = (
    "std::_Function_handler<void (long, long), (anonymous namespace)::packed_matmul<true>("
    "at::Tensor const&, at::Tensor const&, (anonymous namespace)::Dims const&)::{lambda(long, "
    "long)#1}>::_M_invoke"
)


def test_a_pool_task_is_named_after_its_function() -> None:
    assert short_name(POOL_TASK) == "packed_matmul<true> (its pool tasks)"
    assert short_name("(anonymous namespace)::softmax_numerators") == "softmax_numerators"
    assert short_name("at::native::cpu_flash_attention<float, float, 64l, 512l, false>") == (
        "at::native::cpu_flash_attention<float, float, 64l, 512l, false>"
    )


@pytest.mark.parametrize(
    ("dso", "symbol", "part"),
    [
        ("pdserve_cpu_kernels.so", POOL_TASK, "matmuls"),
        ("libtorch_cpu.so", "mkl_blas_def_sgemm_kernel_0_zen", "matmuls"),
        (
            "pdserve_cpu_kernels.so",
            "std::_Function_handler<void (long, long), "
            "(anonymous namespace)::attend_rows<float>(float const*)::{lambda(long, long)#1}>"
            "::_M_invoke",
            "attention",
        ),
        (
            "libtorch_cpu.so",
            "at::native::cpu_flash_attention<float, float, 64l, 512l, false>",
            "attention",
        ),
        ("pdserve_cpu_kernels.so", "(anonymous namespace)::rms_norm_row", "norms"),
        ("[kernel.kallsyms]", "clear_page_erms", "allocator"),
        ("libc.so.6", "_int_malloc", "allocator"),
        ("libpython3.11.so.1.0", "_PyEval_EvalFrameDefault", "Python"),
        ("libtorch_cpu.so", "at::_ops::empty_memory_format::redispatch", "torch ops"),
        ("[kernel.kallsyms]", "finish_task_switch.isra.0", "other"),
    ],
)
def test_symbols_land_in_their_part(dso: str, symbol: str, part: str) -> None:
    got = part_of(dso, symbol)
    assert got.startswith(part) or (part == "other" and got == OTHER), got


def _perf_samples_here() -> bool:
    if shutil.which("perf") is None:
        return False
    probe = subprocess.run(["perf", "stat", "-e", "task-clock", "true"], capture_output=True,
                           check=False)  # fmt: skip
    return probe.returncode == 0


@pytest.mark.skipif(not _perf_samples_here(), reason="perf cannot sample processes here")
@pytest.mark.parametrize(
    ("phase", "extra"), [("decode16", ["--steps", "4"]), ("prefill512", ["--prompts", "1"])]
)
def test_a_short_profile_of_each_phase(phase: str, extra: list[str], tmp_path: Path) -> None:
    out = tmp_path / "profile.txt"
    result = main(["--phase", phase, *extra, "--perf-out", str(out)])
    assert result is not None and result["samples"] > 0 and result["steps"] > 0
    assert abs(sum(result["parts"].values()) - 1.0) < 1e-9
    assert "matmuls (quantized / x16 kernels)" in result["parts"]
    assert out.read_text().startswith(phase) and (tmp_path / "profile.txt.json").is_file()
