"""Load tests and benchmarks (README.md)."""

import common.openmp  # noqa: F401  (before torch: OpenMP's wait policy, for in-process engines)
