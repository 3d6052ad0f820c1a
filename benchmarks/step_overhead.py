#!/usr/bin/env python
"""Batch-1 decode: the engine's time per token outside the model's forward, part by part.

    python benchmarks/step_overhead.py --quantization int4
    python benchmarks/step_overhead.py --quantization int4 --trees /tmp/base/src,src --rounds 3   # A/B of checkouts

Streams `--streams` random `--input-len`-token prompts (default 32) x `--output-len` greedy tokens through `LLM.stream`
(as `tokenmill bench latency / roofline` do) and times every decode step: the gap between two
streamed tokens (TPOT), the fused forward inside it (or the op-by-op forward where the fused step
is off), and the rest of the engine loop by part (scheduler, input preparation, sampling batch,
sampler, scheduler update, output processing with detokenization, the stream loop). Prints medians
per step in ms. The parts are timed by wrapping the engine's methods in place, a few us each.

With `--trees A,B,...` each round runs every tree (a `src` folder put first on PYTHONPATH) in a
fresh process, interleaved round by round, and prints each tree's medians over the rounds, for
A/B comparisons of engine changes on a shared machine (compare trees within one run only).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

PARTS = ("schedule", "prepare", "forward", "sampling batch", "sampler", "update", "output processing")


def _timed(times: dict[str, list[float]], key: str, f):
    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            times[key].append(time.perf_counter() - t0)

    return g


def measure(quantization: str | None, streams: int, output_len: int, input_len: int = 32) -> dict:
    """Medians (s) per decode step of one engine in this process."""
    from tokenmill import LLM
    from tokenmill.bench.offline import _params, _random_prompts
    from tokenmill.sample import sampler as sampler_mod

    llm = LLM(quantization=quantization)
    eng = llm.engine
    core, runner = eng.core, eng.core.runner
    times: dict[str, list[float]] = {p: [] for p in PARTS}
    core.scheduler.schedule = _timed(times, "schedule", core.scheduler.schedule)
    runner.prepare = _timed(times, "prepare", runner.prepare)
    runner.run = _timed(times, "forward", runner.run)
    runner.sampler = _timed(times, "sampler", runner.sampler)
    core.scheduler.update = _timed(times, "update", core.scheduler.update)
    eng.output_processor.process = _timed(times, "output processing", eng.output_processor.process)
    from_requests = sampler_mod.SamplingBatch.from_requests
    if hasattr(runner, "sampling_batches"):
        runner.sampling_batches = _timed(times, "sampling batch", runner.sampling_batches)
    else:  # a tree from before SamplingBatches (for --trees A/B runs)
        sampler_mod.SamplingBatch.from_requests = _timed(times, "sampling batch", from_requests)
    try:
        prompts = _random_prompts(llm, streams + 1, input_len, 0)
        params = _params(output_len)
        steps: dict[str, list[float]] = {p: [] for p in PARTS + ("TPOT",)}
        tpots = []
        for i, prompt in enumerate(prompts):  # the first one warms up
            for t in times.values():
                t.clear()
            gaps, last = [], None
            for _ in llm.stream(prompt, params):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
            if i == 0:
                continue
            tpots.append(sum(gaps) / len(gaps))
            steps["TPOT"] += gaps
            for p in PARTS:  # each part's calls of the decode steps (the first step is the prompt's)
                steps[p] += times[p][-len(gaps) :]
    finally:
        sampler_mod.SamplingBatch.from_requests = from_requests
    med = {p: statistics.median(v) for p, v in steps.items()}
    med["outside the forward"] = statistics.median(g - f for g, f in zip(steps["TPOT"], steps["forward"]))
    med["TPOT (mean per stream)"] = statistics.median(tpots)
    return med


def _report(rows: dict[str, dict[str, float]]) -> None:
    names = list(rows)
    keys = ["TPOT (mean per stream)", "TPOT", "forward", "outside the forward", *[p for p in PARTS if p != "forward"]]
    print(f"{'ms per decode step (median)':30s}" + "".join(f"{n[-24:]:>26s}" for n in names))
    for k in keys:
        print(f"{k:30s}" + "".join(f"{rows[n][k] * 1e3:26.3f}" for n in names))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantization", default=None)
    p.add_argument("--streams", type=int, default=5, help="timed streams per run (after one warm-up stream)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (the context decode steps attend)")
    p.add_argument("--trees", default=None, help="comma-separated src folders to compare, each in its own process")
    p.add_argument("--rounds", type=int, default=3, help="with --trees: interleaved rounds")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a child's result, as JSON
    args = p.parse_args(argv)
    if not args.trees:
        res = measure(args.quantization, args.streams, args.output_len, args.input_len)
        if args.json:
            print("RESULT " + json.dumps(res))
        else:
            _report({"this tree": res})
        return
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    child = [
        sys.executable,
        os.path.abspath(__file__),
        "--json",
        "--streams",
        str(args.streams),
        "--output-len",
        str(args.output_len),
        "--input-len",
        str(args.input_len),
    ] + (["--quantization", args.quantization] if args.quantization else [])
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for t in trees:
            env = {**os.environ, "PYTHONPATH": t}
            out = subprocess.run(child, env=env, capture_output=True, text=True, check=True).stdout
            res = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            runs[t].append(res)
            print(
                f"round {r + 1} {t}: TPOT {res['TPOT (mean per stream)'] * 1e3:.3f} ms, forward "
                f"{res['forward'] * 1e3:.3f}, outside {res['outside the forward'] * 1e3:.3f}",
                flush=True,
            )
    print(f"medians over {args.rounds} rounds (load {os.getloadavg()[0]:.2f}):")
    _report({t: {k: statistics.median(x[k] for x in runs[t]) for k in runs[t][0]} for t in trees})


if __name__ == "__main__":
    main()
