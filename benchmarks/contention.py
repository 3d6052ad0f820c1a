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


def _busy_s() -> float:
    """System-wide busy CPU seconds so far (all CPUs; steal counted as busy)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int | str = "self") -> float:
    """CPU seconds a process has used (all its threads)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Others:
    """CPU cores other processes (neither this one nor its hogs, nor with `children` its children
    waited for meanwhile) used while the block ran."""

    def __init__(self, hogs: list[subprocess.Popen], children: bool = False):
        self.hogs, self.children = hogs, children

    def _mine(self) -> float:
        import resource

        waited = resource.getrusage(resource.RUSAGE_CHILDREN) if self.children else None
        return _cpu_s() + sum(_cpu_s(h.pid) for h in self.hogs) + (waited.ru_utime + waited.ru_stime if waited else 0)

    def __enter__(self):
        self.t0, self.b0, self.m0 = time.perf_counter(), _busy_s(), self._mine()
        return self

    def __exit__(self, *exc):
        dt = time.perf_counter() - self.t0
        self.cores = max(0.0, (_busy_s() - self.b0) - (self._mine() - self.m0)) / dt


def wait_idle(max_wait_s: float, threshold: float = 0.2) -> None:
    """Waits (up to max_wait_s) until other processes use less than `threshold` cores over 1 s."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        with Others([]) as o:
            time.sleep(1.0)
        if o.cores < threshold:
            return


def start_hogs(condition: str, secs: float) -> list[subprocess.Popen]:
    """The busy-loop processes a condition asks for (none for `quiet`)."""
    if condition == "quiet":
        return []
    kind, k = condition.rstrip("0123456789"), int(condition[len(condition.rstrip("0123456789")) :] or 1)
    cpus = sorted(os.sched_getaffinity(0))
    hogs = []
    for i in range(k):
        pin = None
        if kind == "pinned":
            pin = {cpus[-1 - (i % len(cpus))]}
        elif kind != "free":
            raise SystemExit(f"unknown condition {condition!r}")
        hogs.append(
            subprocess.Popen(
                [sys.executable, "-c", HOG.format(secs=secs)],
                preexec_fn=(lambda p=pin: os.sched_setaffinity(0, p)) if pin else None,
            )
        )
    time.sleep(0.3)  # let them start spinning
    return hogs


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for h in hogs:
        h.kill()
    for h in hogs:
        h.wait()


def worker(conditions: list[str], hog_seconds: float, idle_wait_s: float, max_others: float, retries: int) -> dict:
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

    many = [[1000 + (i * 577 + 7 * j) % vocab for j in range(32)] for i in range(96)]
    short = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def many_tok_s() -> float:  # 96 rows: over SMALL_BATCH, so op by op (oneDNN, torch ops)
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=many, sampling_params=short)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

    tpot_ms(), eight_tok_s(), many_tok_s()  # warm-up
    res = {"threads": torch.get_num_threads(), "by_condition": {}}

    def measure(f, hogs):
        """f() while other processes stay under max_others cores (up to `retries` more tries)."""
        for attempt in range(retries + 1):
            with Others(hogs) as o:
                v = f()
            if o.cores <= max_others or attempt == retries:
                return v, o.cores
            wait_idle(idle_wait_s)

    for cond in conditions:
        wait_idle(idle_wait_s)
        hogs = start_hogs(cond, hog_seconds)
        try:
            (tpot, o1), (tok_s, o8), (many_s, o96) = (measure(f, hogs) for f in (tpot_ms, eight_tok_s, many_tok_s))
            res["by_condition"][cond] = {
                "tpot_ms": tpot,
                "eight_tok_s": tok_s,
                "many_tok_s": many_s,
                "others_cores": [round(o, 2) for o in (o1, o8, o96)],
            }
        finally:
            stop_hogs(hogs)
    return res


def spin_sweep(
    conditions: list[str],
    spins_us: list[str],
    rows_list: list[int],
    repeats: int,
    hog_seconds: float,
    idle_wait_s: float,
) -> dict:
    """In one process: the fused step alone (one captured all-decode step of `rows` rows), with
    the barrier spin budget switched call by call over `spins_us`; median ms per condition."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from decode_step import capture_step

    from tokenmill import LLM

    llm = LLM(enable_prefix_caching=False)
    runner = llm.engine.core.runner
    fused = runner.fast_decode
    if fused is None:
        raise SystemExit("the fused decode step is off here (see the log)")
    res = {"threads": torch.get_num_threads(), "by_condition": {}}
    steps = {rows: capture_step(llm, rows, 32) for rows in rows_list}
    with torch.inference_mode():
        for cond in conditions:
            wait_idle(idle_wait_s)
            hogs = start_hogs(cond, hog_seconds)
            try:
                out = {}
                for rows, (ids, pos, meta, logits_rows) in steps.items():
                    times = {us: [] for us in spins_us}
                    with Others(hogs) as o:
                        for _ in range(repeats):
                            for us in spins_us:  # "100": spin up to 100 us; "a100": adaptive, at most 100
                                fused.decoder.adaptive_spin = us.startswith("a")
                                fused.decoder.spin_ns = int(float(us.lstrip("a")) * 1000)
                                t0 = time.perf_counter()
                                fused(ids, pos, meta, logits_rows)
                                times[us].append(time.perf_counter() - t0)
                    out[rows] = {us: statistics.median(v) * 1e3 for us, v in times.items()}
                    out[rows]["others"] = o.cores
                res["by_condition"][cond] = out
            finally:
                stop_hogs(hogs)
    return res


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def parse_configs(spec: str) -> list[tuple[str, dict[str, str]]]:
    """ "name=VAR=v,VAR2=w;name2=" -> [(name, {VAR: v, VAR2: w}), (name2, {})]."""
    out = []
    for part in filter(None, (s.strip() for s in spec.split(";"))):
        name, _, rest = part.partition("=")
        env = dict(kv.split("=", 1) for kv in filter(None, rest.split(",")))
        out.append((name, env))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs", default="default=", help='"name=VAR=v,VAR2=w;name2=..." (default: the environment as is)'
    )
    p.add_argument("--conditions", default="quiet,pinned1,free1")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hog-seconds", type=float, default=120.0, help="a hog's own time limit (it is killed sooner)")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each condition, wait up to this long for other processes to use < 0.2 cores",
    )
    p.add_argument(
        "--max-others",
        type=float,
        default=0.25,
        metavar="CORES",
        help="a measurement during which other processes used more than this is taken again",
    )
    p.add_argument("--retries", type=int, default=3, help="how many times (then it is kept, with its figure)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--spin-sweep",
        default=None,
        metavar="US,US,..",
        help="instead: time the fused step alone in one process, switching the barrier spin "
        "budget call by call, interleaved (microseconds; 1e6 = spin; a100 = adaptive, at most 100)",
    )
    p.add_argument("--rows", default="1,8", help="--spin-sweep: decode rows of the captured steps")
    p.add_argument("--repeats", type=int, default=100, help="--spin-sweep: calls per spin value and condition")
    args = p.parse_args(argv)
    conditions = args.conditions.split(",")
    if args.spin_sweep:
        spins = args.spin_sweep.split(",")
        res = spin_sweep(
            conditions, spins, [int(r) for r in args.rows.split(",")], args.repeats, args.hog_seconds, args.wait_idle
        )
        print(f"fused step alone, {res['threads']} threads, median ms of {args.repeats} interleaved calls")
        for cond, by_rows in res["by_condition"].items():
            for rows, by_spin in by_rows.items():
                others = by_spin.pop("others")
                print(
                    f"{cond:>8} rows {rows:2d}: "
                    + "  ".join(f"{us}: {ms:6.2f}" for us, ms in by_spin.items())
                    + f"   (others {others:.2f} cores)"
                )
        return
    if args.worker:
        print(
            "RESULT " + json.dumps(worker(conditions, args.hog_seconds, args.wait_idle, args.max_others, args.retries)),
            flush=True,
        )
        return

    configs = parse_configs(args.configs)
    runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
    for r in range(args.rounds):
        for name, env in configs:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                "--conditions",
                args.conditions,
                "--hog-seconds",
                str(args.hog_seconds),
                "--wait-idle",
                str(args.wait_idle),
                "--max-others",
                str(args.max_others),
                "--retries",
                str(args.retries),
            ]
            proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"worker {name} failed:\n{proc.stderr[-3000:]}")
            res = json.loads(line[7:])
            for v in res["by_condition"].values():
                v["others_cores_max"] = max(v["others_cores"])
            runs[name].append(res)
            figs = "  ".join(
                f"{c}: {v['tpot_ms']:.1f} ms {v['eight_tok_s']:.0f} / {v['many_tok_s']:.0f} tok/s "
                f"(others {max(v['others_cores']):.2f})"
                for c, v in res["by_condition"].items()
            )
            print(f"round {r + 1} {name} ({res['threads']} threads): {figs}", flush=True)

    def med(name, cond, key):
        return statistics.median(run["by_condition"][cond][key] for run in runs[name])

    metrics = (
        ("tpot_ms", "batch-1 TPOT ms", "{:.1f}"),
        ("eight_tok_s", "8-seq tok/s", "{:.0f}"),
        ("many_tok_s", "96-seq tok/s", "{:.0f}"),
    )
    print(
        f"\nmedians of {args.rounds} rounds; {os.cpu_count()} CPUs ({cpu_name()}); in brackets: x the same "
        f"config's quiet figure, then x the first config's ({configs[0][0]}) in the same condition"
    )
    summary = {}
    first = configs[0][0]
    for name, env in configs:
        summary[name] = {"env": env, "threads": runs[name][0]["threads"]}
        for cond in conditions:
            summary[name][cond] = {key: med(name, cond, key) for key, _, _ in metrics}
            summary[name][cond]["others_cores"] = med(name, cond, "others_cores_max")
            parts = []
            for key, label, fmt in metrics:
                v = summary[name][cond][key]
                notes = []
                if cond != "quiet" and "quiet" in conditions:
                    notes.append(f"x{v / med(name, 'quiet', key):.2f} quiet")
                if name != first:
                    notes.append(f"x{v / med(first, cond, key):.2f} {first}")
                parts.append(f"{label} {fmt.format(v)}" + (f" ({', '.join(notes)})" if notes else ""))
            print(
                f"{name:>14} {cond:>8}: "
                + "  ".join(parts)
                + f"  [others {summary[name][cond]['others_cores']:.2f} cores]"
            )
    out = Path(args.out or Path(__file__).parent / "results" / f"contention-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "configs": configs,
                "conditions": conditions,
                "rounds": args.rounds,
                "cpus": os.cpu_count(),
                "affinity": sorted(os.sched_getaffinity(0)),
                "summary": summary,
                "runs": runs,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
