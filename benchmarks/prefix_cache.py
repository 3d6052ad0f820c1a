"""Prefix caching: TTFT of a shared-system-prompt workload with automatic prefix caching on vs off.

    python benchmarks/prefix_cache.py            # SmolLM2 bf16, 64 requests, 1,000-token shared prefix

Starts `tokenmill serve` (a subprocess, like a user would) once with caching and once with
`--no-enable-prefix-caching`, alternating, `--repeats` times each, drives both with the same
`tokenmill bench serve` `prefix` workload, and prints mean / median TTFT with the ratio off / on
(medians over repeats). Not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

from tokenmill.bench.datasets import load_tokenizer, prefix_requests
from tokenmill.bench.serve import benchmark
from tokenmill.model.loader import resolve_model_path


def _compare_helpers():
    """Server start/stop helpers shared with benchmarks/compare/run.py."""
    spec = importlib.util.spec_from_file_location("compare_run", Path(__file__).parent / "compare" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_once(h, caching: bool, reqs, args, log_dir: Path) -> dict:
    port = h.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.cli",
        "serve",
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--kv-cache-memory",
        str(args.kv_cache_memory),
    ]
    if not caching:
        cmd.append("--no-enable-prefix-caching")
    log = log_dir / f"serve-{'on' if caching else 'off'}-{time.monotonic_ns()}.log"
    p = h.start_server("tokenmill", cmd, dict(__import__("os").environ), log)
    try:
        h.wait_ready(p, url, 300, log)
        res = asyncio.run(benchmark(url, reqs, max_concurrency=args.max_concurrency, disable_tqdm=True))
    finally:
        h._stop(p)
    m = res["metrics"]
    if m["failed"]:
        raise RuntimeError(f"{m['failed']} requests failed; see {log}")
    return {
        "mean_ttft_ms": m["ttft_ms"]["mean"],
        "median_ttft_ms": m["ttft_ms"]["median"],
        "output_throughput": m["output_throughput"],
        "hit_rate": m.get("prefix_cache", {}).get("hit_rate"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or GGUF (default: the built-in SmolLM2 folder)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=32, help="each request's own tokens after the prefix")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--kv-cache-memory", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    args = ap.parse_args(argv)
    args.model = args.model or resolve_model_path(None)
    h = _compare_helpers()
    tok = load_tokenizer(args.model)
    log_dir = Path(args.out).parent / "logs"
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for rep in range(args.repeats):
        reqs = prefix_requests(tok, args.num_prompts, args.prefix_len, args.input_len, args.output_len, seed=rep)
        for mode in ("on", "off"):
            r = run_once(h, mode == "on", reqs, args, log_dir)
            runs[mode].append(r)
            print(
                f"repeat {rep + 1} caching {mode:3}: mean TTFT {r['mean_ttft_ms']:9.1f} ms, median "
                f"{r['median_ttft_ms']:9.1f} ms, {r['output_throughput']:7.1f} tok/s, hit rate {r['hit_rate']}",
                flush=True,
            )
    med = {
        mode: {k: statistics.median(r[k] for r in rs) for k in ("mean_ttft_ms", "median_ttft_ms")}
        for mode, rs in runs.items()
    }
    ratio_mean = med["off"]["mean_ttft_ms"] / med["on"]["mean_ttft_ms"]
    ratio_median = med["off"]["median_ttft_ms"] / med["on"]["median_ttft_ms"]
    print(
        f"\n{args.num_prompts} requests, {args.prefix_len}-token shared prefix + {args.input_len} own tokens, "
        f"{args.output_len} out, max concurrency {args.max_concurrency}, {args.dtype}; medians of {args.repeats}:"
    )
    print(
        f"  mean TTFT   caching on {med['on']['mean_ttft_ms']:9.1f} ms   off {med['off']['mean_ttft_ms']:9.1f} ms"
        f"   off/on {ratio_mean:.2f}x"
    )
    print(
        f"  median TTFT caching on {med['on']['median_ttft_ms']:9.1f} ms   off {med['off']['median_ttft_ms']:9.1f} ms"
        f"   off/on {ratio_median:.2f}x"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "runs": runs,
                "medians": med,
                "ratio_mean_ttft": ratio_mean,
                "ratio_median_ttft": ratio_median,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
