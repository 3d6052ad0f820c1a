#!/usr/bin/env python
"""The fused decode step before, during and after a busy process beside it: does it recover?

    python benchmarks/barrier_recovery.py --quantization int4 --trials 4

Loads the model once (default SmolLM2), captures one batch-1 decode step, and per trial times it
`--steps` times (with a 0.4 ms pause between calls, as the engine's Python between steps), then
the same with a busy-loop process pinned to the last CPU, then three more times after the busy
process is gone. Prints the median ms per step and the barrier waits that slept, per step, in
each phase. A barrier whose threads keep sleeping once the machine is quiet again shows up as
"after" figures far above "before" (the fused step's StepBarrier, csrc/decode_step.cpp).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from decode_step import capture_step  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", default="int4")
    p.add_argument("--context", type=int, default=32, help="prompt tokens")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--steps", type=int, default=40, help="timed calls per phase")
    args = p.parse_args(argv)
    from tokenmill import LLM

    llm = LLM(args.model, quantization=args.quantization, enable_prefix_caching=False)
    fused = llm.engine.core.runner.fast_decode
    if fused is None:
        raise SystemExit("the fused decode step is off here (see the log)")
    dec = fused.decoder
    ids, pos, meta, rows = capture_step(llm, 1, args.context)
    dec.count_waits = True

    def phase(n: int) -> tuple[float, float]:
        times = []
        dec.take_wait_stats()
        for _ in range(n):
            t0 = time.perf_counter()
            fused(ids, pos, meta, rows)
            times.append(time.perf_counter() - t0)
            time.sleep(0.0004)
        slept = dec.take_wait_stats()[1]
        return statistics.median(times) * 1e3, slept / n

    cpu = str((os.cpu_count() or 1) - 1)
    print(f"{torch.get_num_threads()} threads; ms per step (median) and barrier waits that slept per step")
    with torch.inference_mode():
        for trial in range(args.trials):
            before = phase(args.steps)
            hog = subprocess.Popen(["taskset", "-c", cpu, sys.executable, "-c", "while True: pass"])
            try:
                during = phase(args.steps)
            finally:
                hog.kill()
                hog.wait()
            after = [phase(args.steps) for _ in range(3)]
            print(
                f"trial {trial}: before {before[0]:.2f} ms ({before[1]:.0f})  busy process {during[0]:.2f} ms "
                f"({during[1]:.0f})  after " + "  ".join(f"{a[0]:.2f} ms ({a[1]:.0f})" for a in after),
                flush=True,
            )


if __name__ == "__main__":
    main()
