"""The model engine: scheduler, KV manager, model runner, sampler (engine.py ties them)."""

import common.openmp  # noqa: F401  (before torch: OpenMP's wait policy)
