"""Coverage-guided fuzzing of the gateway's request handling with atheris (libFuzzer).

    .venv/bin/python tests/fuzz/atheris_gateway.py [libFuzzer flags] [CORPUS_DIR]
    e.g. -runs=20000 -max_total_time=600 -timeout=20 -artifact_prefix=/tmp/fuzz-

Each input is raw request bytes, parsed and handled as tests/fuzz/gateway_harness.py
describes. A status of INTERNAL or UNKNOWN, or an exception escaping, is a crash, and
libFuzzer writes the input to ``<artifact_prefix>crash-<sha1>``. Coverage is collected from
pdserve's own modules (services, common).
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports(include=["services", "common"]):
    from tests.fuzz.gateway_harness import FORBIDDEN, Harness


def main() -> None:
    from common.models.default_model import convert_default_model

    harness = Harness(str(convert_default_model()))

    def one_input(data: bytes) -> None:
        for method, code in harness.run(data).items():
            if code in FORBIDDEN:
                raise RuntimeError(f"{method} ended {code.name} for {data!r}")

    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
