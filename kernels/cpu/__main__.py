"""``python -m kernels.cpu``: builds the C++ CPU kernels into the cache (scripts/setup.sh).

``--targets x86-64-v3 avx512 ...`` builds those named targets as well (kernels.cpu
NAMED_TARGETS), whatever CPU this is: the container image ships one build per target and
each process loads the best its CPU runs. This CPU's kernels are then loaded as a check.
"""

from __future__ import annotations

import argparse
import sys
import time

from kernels.cpu import NAMED_TARGETS, KernelUnavailableError, build_target, load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.cpu")
    parser.add_argument("-v", "--verbose", action="store_true", help="the compiler's output")
    parser.add_argument("--targets", nargs="+", default=[], choices=list(NAMED_TARGETS),
                        metavar="TARGET",
                        help=f"named targets to build besides this CPU's: {', '.join(NAMED_TARGETS)}")  # fmt: skip
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        for name in args.targets:
            began = time.monotonic()
            directory = build_target(name, verbose=args.verbose)
            print(f"kernels.cpu: {name} built in {time.monotonic() - began:.1f}s ({directory})")
        module = load(verbose=args.verbose)
    except KernelUnavailableError as exc:
        print(f"kernels.cpu: {exc}", file=sys.stderr)
        return 1
    print(
        f"kernels.cpu: ready in {time.monotonic() - start:.1f}s ({module.__file__}, "
        f"AVX2 {'on' if module.has_avx2() else 'off'}, "
        f"x16 {'on' if module.has_x16() else 'off'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
