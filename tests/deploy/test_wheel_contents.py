"""What `pip install .` puts in site-packages (the image installs pdserve so): everything
the installed package reads at run time, not only its .py files."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from kernels.cpu import _SOURCES

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pdserve", "common", "services", "kernels", "loadtest")


def test_the_wheel_carries_the_cpu_kernels_sources(tmp_path: Path) -> None:
    # A copy of what the image's build stage copies, built as pip builds it there.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in PACKAGES:
        shutil.copytree(REPO / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
         "--wheel-dir", str(tmp_path / "dist"), str(source)],
        check=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("pdserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # kernels.cpu hashes these to find its build, and compiles them where there is none.
    missing = [s for s in _SOURCES if f"kernels/cpu/{s}" not in names]
    assert not missing, f"the wheel lacks kernels/cpu/{missing}"
    assert "pdserve/cli/main.py" in names
