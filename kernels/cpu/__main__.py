"""``python -m kernels.cpu``: builds the C++ CPU kernels into the cache (scripts/setup.sh)."""

from __future__ import annotations

import sys
import time

from kernels.cpu import KernelUnavailableError, build_directory, load


def main() -> int:
    start = time.monotonic()
    try:
        module = load(verbose="-v" in sys.argv)
    except KernelUnavailableError as exc:
        print(f"kernels.cpu: {exc}", file=sys.stderr)
        return 1
    print(
        f"kernels.cpu: ready in {time.monotonic() - start:.1f}s ({build_directory()}, "
        f"AVX2 {'on' if module.has_avx2() else 'off'}, "
        f"x16 {'on' if module.has_x16() else 'off'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
