"""The KQx16 kernel (kernels/cpu/kquant_x16.cpp) alone, per GGUF type: a step's matmuls of
Llama-shaped layers (fused q/k/v 960 x K, o K x K, gate/up 3072 x K, down K x 1536, K = 512),
distinct random weights per layer so they stream from memory, at M activation rows.

Prints each type's best step time over ``--repeats`` runs, in ms. A/B of two kernel builds:
run it once from each checkout (``--repo`` points the import at another one, e.g. a
``git worktree`` of the commit before, whose kernels build on their own):

    .venv/bin/python loadtest/bench_kquant.py --rows 1,16 --types Q5_0,Q4_K,Q6_K
    .venv/bin/python loadtest/bench_kquant.py --repo /tmp/before --rows 1,16 --types Q5_0

Run on a quiet machine, and alternate the builds: this VM's figures drift 10-20 % over
minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

# common/openmp.py's policy, set here: importing it would load common from this checkout,
# not --repo's.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# isort: split
import numpy as np
import torch

if TYPE_CHECKING:  # imported at run time from --repo's checkout
    from kernels.cpu.kquant import KQx16

SHAPES = [(960, 512), (512, 512), (3072, 512), (512, 1536)]
# Where each type's float16 fields (d, and dmin or m) lie in its block, in bytes.
FLOAT16_AT = {
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "Q5_0": (0,), "Q5_1": (0, 2),
}  # fmt: skip


def random_weight(type_name: str, rows: int, k: int, seed: int) -> KQx16:
    """A weight of ``type_name`` from random blocks (finite float16 fields) in its file
    form, read as the loader reads a file's tensor."""
    from common.models.quant.kquants import KQUANT_TYPES, read_kq_x16

    per_block, block_bytes, _ = KQUANT_TYPES[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * k // per_block, block_bytes), dtype=np.uint8)
    for at in FLOAT16_AT[type_name]:  # small finite values keep the sums in range
        halves = np.asarray(rng.standard_normal(blocks.shape[0]) * 1e-2, dtype=np.float16)
        blocks[:, at : at + 2] = halves.reshape(-1, 1).view(np.uint8)
    return read_kq_x16(type_name, blocks.reshape(rows, -1), rows, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16", help="activation rows M, comma-separated")
    parser.add_argument("--types", default="Q5_0,Q4_K,Q6_K")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--act-bits", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo))
    from kernels.cpu.kquant import kq_x16_matmul

    torch.set_num_threads(args.threads)
    print(f"kernels from {args.repo}; {args.layers} layers, {args.threads} threads, "
          f"{args.act_bits}-bit activations; best step, ms")  # fmt: skip
    for type_name in args.types.split(","):
        layers = [
            [random_weight(type_name, n, k, seed=10 * i + s) for s, (n, k) in enumerate(SHAPES)]
            for i in range(args.layers)
        ]
        figures = []
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k) for k in {k for _, k in SHAPES}}
            best = float("inf")
            for _ in range(args.repeats + 1):
                start = time.perf_counter()
                for weights in layers:
                    for w in weights:
                        kq_x16_matmul(xs[w.shape[1]], w, args.act_bits)
                best = min(best, time.perf_counter() - start)
            figures.append(f"M={m} {best * 1e3:.2f}")
        print(f"{type_name}: " + ", ".join(figures), flush=True)


if __name__ == "__main__":
    main()
