"""OpenMP's wait policy for processes that run the engine, set before torch loads.

torch's CPU ops run parallel regions on OpenMP (libgomp), whose threads by default spin
for milliseconds after each region before they sleep. The engine's hot path runs on the C++
kernels' own pool (kernels/cpu/pool.cpp), so the spinning threads left by the few torch ops
of a step (the sampler's over the vocabulary, say) take the cores that pool needs: an
in-process single stream on 2 cores, alternating runs in one minute, took 9.2-9.8 ms a
decode step spinning and 6.5-6.9 ms with the threads asleep. libgomp reads its policy once,
when torch loads, so importing this module first (the CLI, common.engine, the load tests
and the test suite do) sets it; a value the user set stays. The engine warns when torch
came first and the policy is unset.
"""

import os
import sys

# True when this default came too late to apply (torch was imported before this module).
OMP_POLICY_UNSET = "OMP_WAIT_POLICY" not in os.environ and "torch" in sys.modules
_SET_HERE = "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def environment_without_default() -> dict[str, str]:
    """This process's environment less the default set here, for programs of others run
    beside pdserve (llama.cpp's OpenMP threads barrier at every op of a step: asleep between
    them, its server decoded at a third of its speed)."""
    env = dict(os.environ)
    if _SET_HERE:
        env.pop("OMP_WAIT_POLICY", None)
    return env
