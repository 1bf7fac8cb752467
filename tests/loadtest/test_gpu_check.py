"""scripts/gpu_check.sh and loadtest/gpu_check.py: no GPU here, so the same code runs on the CPU
on small shapes (what keeps the GPU script from rotting between GPU sessions), and the script's
list of kernel tests is checked against the Triton kernels the repo holds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from loadtest import gpu_check

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_its_parity_and_speed_cases_on_the_cpu(tmp_path: Path) -> None:
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(result["parity"]) == {"tiny llama", "smollm2 shape"}
    for check in result["parity"].values():
        assert check["equal"] and len(check["prompts"]) == 4
        assert all(row["first_difference"] is None for row in check["prompts"])
    cases = result["speed"]["cases"]
    assert set(cases) == {"c1", "c4", "prefill64"}
    assert cases["c4"]["requests"] == 4 and cases["c4"]["output_tokens"] == 4 * 16
    assert cases["c1"]["output_tok_s"] > 0 and cases["prefill64"]["prefill_tok_s"] > 0
    text = (tmp_path / "gpu_check.txt").read_text()
    assert "parity tiny llama" in text and "equal" in text and "prefill64" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.txt"]


def test_the_gpu_check_reports_a_parity_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = gpu_check.parity

    def off_by_one(*args: object, **kwargs: object) -> dict:
        result = real(*args, **kwargs)  # type: ignore[arg-type]
        result["prompts"][0] = {**result["prompts"][0], "equal": False, "first_difference": 3}
        result["equal"] = False
        return result

    monkeypatch.setattr(gpu_check, "parity", off_by_one)
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 1
    assert "DIFFERENT (first differences at [3])" in (tmp_path / "gpu_check.txt").read_text()


def test_the_gpu_script_runs_the_test_of_every_triton_kernel() -> None:
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    listed = set(re.findall(r"tests/kernels/test_\w+\.py", script))
    assert listed and all((REPO / path).is_file() for path in listed)
    triton_modules = {
        p.stem for p in (REPO / "kernels").glob("*.py") if "@triton.jit" in p.read_text()
    }
    assert {"paged_decode_attention", "paged_prefill_attention", "rms_norm"} <= triton_modules
    wanted = set()
    for test in (REPO / "tests" / "kernels").glob("test_*.py"):
        text = test.read_text()
        imported = set(re.findall(r"^from kernels\.(\w+) import", text, re.M))
        if imported & triton_modules or "triton" in text.lower():
            wanted.add(f"tests/kernels/{test.name}")
    assert wanted == listed
