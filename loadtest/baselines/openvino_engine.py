"""OpenVINO GenAI's continuous-batching pipeline behind loadtest/baselines/engine_cases.py: the
OpenVINO side of loadtest/bench_openvino.py, run by OpenVINO's own venv
(loadtest/baselines/build_openvino.sh makes it), never by the repo's.

    OV_PYTHON loadtest/baselines/openvino_engine.py WORKLOAD.json SETTINGS.json RESULT.json

SETTINGS: {"model": an optimum-intel export, "scheduler": {SchedulerConfig field: value},
"properties": {CPU plugin property: value}}; fields left out keep OpenVINO's defaults. Requests
go in as token ids (the exported tokenizer is not used), greedy, EOS ignored.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

# engine_cases.py from beside this file, without the repo's packages
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import openvino as ov
import openvino_genai as ov_genai
from engine_cases import run_cases


class SteppedOpenVino:
    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.handles: dict[int, Any] = {}

    def add(self, request_id: int, prompt: Any, max_tokens: int) -> None:
        config = ov_genai.GenerationConfig()
        config.max_new_tokens = max_tokens
        config.ignore_eos = True
        config.do_sample = False
        ids = ov.Tensor(np.asarray([list(prompt)], dtype=np.int64))
        self.handles[request_id] = self.pipe.add_request(request_id, ids, config)

    def step(self) -> list[tuple[int, int, bool]]:
        self.pipe.step()
        events = []
        for request_id, handle in list(self.handles.items()):
            produced = 0
            if handle.can_read():  # the tokens generated since the last read
                produced = sum(len(out.generated_ids) for out in handle.read().values())
            finished = handle.get_status() == ov_genai.GenerationStatus.FINISHED
            if finished and handle.can_read():
                produced += sum(len(out.generated_ids) for out in handle.read().values())
            if produced or finished:
                events.append((request_id, produced, finished))
            if finished:
                del self.handles[request_id]
        return events


def main() -> None:
    workload_path, settings_path, result_path = sys.argv[1:4]
    workload = json.loads(Path(workload_path).read_text())
    settings = json.loads(Path(settings_path).read_text())
    scheduler = ov_genai.SchedulerConfig()
    for name, value in settings.get("scheduler", {}).items():
        if not hasattr(scheduler, name):
            raise SystemExit(f"SchedulerConfig has no field {name!r}")
        setattr(scheduler, name, value)
    start = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(settings["model"], scheduler, "CPU",
                                               settings.get("properties", {}))  # fmt: skip
    load_s = time.perf_counter() - start
    core = ov.Core()
    effective: dict[str, str | None] = {}
    for name in ("INFERENCE_NUM_THREADS", "KV_CACHE_PRECISION", "INFERENCE_PRECISION_HINT"):
        try:
            effective[name] = str(core.get_property("CPU", name))
        except RuntimeError:
            effective[name] = None
    figures = run_cases(SteppedOpenVino(pipe), workload, log=lambda s: print(s, flush=True))
    result = {
        "engine": "openvino", "version": ov_genai.__version__, "load_s": load_s,
        "scheduler": scheduler.to_string(), "cpu_defaults": effective, "cases": figures,
    }  # fmt: skip
    Path(result_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
