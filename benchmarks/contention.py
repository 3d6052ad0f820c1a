#!/usr/bin/env python
"""Decode speed when other processes compete for the CPU (a shared host, a container's quota).

    python benchmarks/contention.py                                  # 5 rounds: quiet, 1 hog pinned, 1 hog free
    python benchmarks/contention.py --configs "now=;passive=OMP_WAIT_POLICY=passive"   # A/B of environments
    python benchmarks/contention.py --conditions quiet,pinned1,free1,free2 --rounds 3

Each round starts, for each config (a name and environment variables), a fresh worker process
(libgomp reads its wait policy once, when it loads) that loads the model (default SmolLM2 bf16),
warms up, and then for each condition measures, in this order:

- batch-1 TPOT: one 32-token prompt, 64 greedy tokens through `LLM.stream`; (last token time -
  first token time) / 63, in ms;
- 8-seq decode: eight 32-token prompts x 64 tokens through `LLM.generate`; output tokens/s.

Conditions: `quiet` (no hog), `pinnedK` (K busy-loop processes pinned to the last K CPUs),
`freeK` (K busy-loop processes the scheduler places). A hog is a Python `while` loop that ends by
itself after `--hog-seconds` and is killed as soon as the condition is measured. Configs run
interleaved round by round; the script prints per config and condition the median over rounds
(with min and max), each condition's ratio to the config's quiet figure, and each config's ratio
to the first config. A JSON result goes to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HOG = "import time\ne = time.monotonic() + {secs}\nx = 0\nwhile time.monotonic() < e:\n    x += 1\n"


def start_hogs(condition: str, secs: float) -> list[subprocess.Popen]:
    """The busy-loop processes a condition asks for (none for `quiet`)."""
    if condition == "quiet":
        return []
    kind, k = condition.rstrip("0123456789"), int(condition[len(condition.rstrip("0123456789")):] or 1)
    cpus = sorted(os.sched_getaffinity(0))
    hogs = []
    for i in range(k):
        pin = None
        if kind == "pinned":
            pin = {cpus[-1 - (i % len(cpus))]}
        elif kind != "free":
            raise SystemExit(f"unknown condition {condition!r}")
        hogs.append(subprocess.Popen([sys.executable, "-c", HOG.format(secs=secs)],
                                     preexec_fn=(lambda p=pin: os.sched_setaffinity(0, p)) if pin else None))
    time.sleep(0.3)  # let them start spinning
    return hogs


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for h in hogs:
        h.kill()
    for h in hogs:
        h.wait()


def worker(conditions: list[str], hog_seconds: float) -> dict:
    import torch

    from tokenmill import LLM, SamplingParams

    llm = LLM()
    vocab = 40000
    one = [[1000 + (7 * j) % vocab for j in range(32)]]
    eight = [[1000 + (i * 131 + 7 * j) % vocab for j in range(32)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    def tpot_ms() -> float:
        stamps = [time.perf_counter() for _ in llm.stream(one[0], params)]
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3

    def eight_tok_s() -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=eight, sampling_params=params)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

    tpot_ms(), eight_tok_s()  # warm-up
    res = {"threads": torch.get_num_threads(), "by_condition": {}}
    for cond in conditions:
        hogs = start_hogs(cond, hog_seconds)
        try:
            res["by_condition"][cond] = {"tpot_ms": tpot_ms(), "eight_tok_s": eight_tok_s(),
                                         "loadavg": os.getloadavg()[0]}
        finally:
            stop_hogs(hogs)
    return res


def parse_configs(spec: str) -> list[tuple[str, dict[str, str]]]:
    """"name=VAR=v,VAR2=w;name2=" -> [(name, {VAR: v, VAR2: w}), (name2, {})]."""
    out = []
    for part in filter(None, (s.strip() for s in spec.split(";"))):
        name, _, rest = part.partition("=")
        env = dict(kv.split("=", 1) for kv in filter(None, rest.split(",")))
        out.append((name, env))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="default=", help='"name=VAR=v,VAR2=w;name2=..." (default: the environment as is)')
    p.add_argument("--conditions", default="quiet,pinned1,free1")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hog-seconds", type=float, default=120.0, help="a hog's own time limit (it is killed sooner)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    conditions = args.conditions.split(",")
    if args.worker:
        print("RESULT " + json.dumps(worker(conditions, args.hog_seconds)), flush=True)
        return

    configs = parse_configs(args.configs)
    runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
    for r in range(args.rounds):
        for name, env in configs:
            cmd = [sys.executable, __file__, "--worker", "--conditions", args.conditions,
                   "--hog-seconds", str(args.hog_seconds)]
            proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"worker {name} failed:\n{proc.stderr[-3000:]}")
            res = json.loads(line[7:])
            runs[name].append(res)
            figs = "  ".join(f"{c}: {v['tpot_ms']:.1f} ms {v['eight_tok_s']:.0f} tok/s"
                             for c, v in res["by_condition"].items())
            print(f"round {r + 1} {name} ({res['threads']} threads): {figs}", flush=True)

    def med(name, cond, key):
        vals = [run["by_condition"][cond][key] for run in runs[name]]
        return statistics.median(vals), min(vals), max(vals)

    print(f"\nmedians of {args.rounds} rounds (min-max); machine: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    summary = {}
    first = configs[0][0]
    for name, env in configs:
        summary[name] = {"env": env, "threads": runs[name][0]["threads"]}
        for cond in conditions:
            t, tlo, thi = med(name, cond, "tpot_ms")
            s, slo, shi = med(name, cond, "eight_tok_s")
            tq, sq = med(name, "quiet", "tpot_ms")[0] if "quiet" in conditions else None, \
                med(name, "quiet", "eight_tok_s")[0] if "quiet" in conditions else None
            extra = f"  x{t / tq:.2f} quiet TPOT, x{s / sq:.2f} quiet tok/s" if tq and cond != "quiet" else ""
            if name != first:
                extra += (f"  | vs {first}: TPOT x{t / med(first, cond, 'tpot_ms')[0]:.2f},"
                          f" tok/s x{s / med(first, cond, 'eight_tok_s')[0]:.2f}")
            print(f"{name:>12} {cond:>8}: TPOT {t:7.1f} ms ({tlo:.1f}-{thi:.1f})  8-seq {s:6.0f} tok/s "
                  f"({slo:.0f}-{shi:.0f}){extra}")
            summary[name][cond] = {"tpot_ms": t, "eight_tok_s": s}
    out = Path(args.out or Path(__file__).parent / "results" / f"contention-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"configs": configs, "conditions": conditions, "rounds": args.rounds,
                               "cpus": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)),
                               "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
