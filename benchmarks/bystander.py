"""Does a long prompt stall the requests already streaming? Starts `tokenmill serve` (the default
model) once with each --itl-target-ms given (0: every step takes the whole token budget, as before
the time-sized budget), all at once, and runs them interleaved. For each hostile request: a
bystander streams a completion, and once its stream flows the hostile request is sent. Printed per
server and hostile request (medians of --repeat runs): the bystander's largest gap between two
chunks, its usual gap, the largest /health latency meanwhile (probed every 50 ms), and the hostile
request's time; then the prefill throughput of the long prompt with nothing else running.

    python benchmarks/bystander.py --repeat 3                      # --itl-target-ms 0 and 250
    python benchmarks/bystander.py --targets 0 100 250 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import threading
import time

import httpx
from server_client import longest_gap, start_server, stop_server, stream_times


def token_ids(n: int, salt: int) -> list[int]:
    """n varied token ids (no prefix shared between runs: each run's prompt is computed)."""
    return [100 + (i * 7919 + salt * 104729) % 40000 for i in range(n)]


def hostile_requests(long_tokens: int) -> dict[str, dict]:
    return {
        f"{long_tokens}-token prompt": {"prompt": long_tokens, "max_tokens": 1},
        f"{long_tokens // 2}-token prompt, prompt_logprobs=20": {
            "prompt": long_tokens // 2,
            "max_tokens": 1,
            "prompt_logprobs": 20,
        },
        "beam search, n=128": {"prompt": 64, "max_tokens": 8, "n": 128, "use_beam_search": True, "temperature": 0},
    }


class Server:
    def __init__(self, itl_target_ms: float, extra: list[str]):
        self.log = tempfile.TemporaryFile("w+")
        self.proc, self.url, _ = start_server(None, ["--itl-target-ms", str(itl_target_ms), *extra], self.log)
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]
        # the KV cache's pages are faulted in by a background thread after start-up (a core's worth
        # of work for seconds): measure after it, as benchmarks/compare/run.py does
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            self.log.seek(0)
            text = self.log.read()
            if "faulted in by a background thread" in text or "pages fault in on first write" in text:
                break
            time.sleep(0.5)

    def close(self) -> None:
        stop_server(self.proc)
        self.log.close()


def probe_health(server: Server, stop: threading.Event, worst: list[float]) -> None:
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get(server.url + "/health")
            worst[0] = max(worst[0], time.perf_counter() - t0)
            stop.wait(0.05)


def one(server: Server, body: dict, salt: int) -> dict[str, float]:
    started, stop, times = threading.Event(), threading.Event(), []
    bystander = threading.Thread(target=stream_times, args=(server.url, server.model, started, stop, times, 3000))
    bystander.start()
    assert started.wait(600), "the bystander's stream did not start"
    time.sleep(0.5)  # the stream's usual gaps first
    n_before = len(times)
    probe_stop, worst = threading.Event(), [0.0]
    prober = threading.Thread(target=probe_health, args=(server, probe_stop, worst))
    prober.start()
    t0 = time.perf_counter()
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": server.model, **body, "prompt": token_ids(body["prompt"], salt)},
        timeout=600,
    )
    took = time.perf_counter() - t0
    t_end = time.perf_counter()
    probe_stop.set()
    prober.join()
    time.sleep(0.3)
    stop.set()
    bystander.join(600)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {
        "status": r.status_code,
        "took": took,
        "max_gap": longest_gap(times, t0, t_end),
        "usual_gap": statistics.median(gaps[: max(n_before - 1, 1)]),
        "health": worst[0],
    }


def prefill_alone(server: Server, n: int, salt: int) -> float:
    t0 = time.perf_counter()
    httpx.post(
        server.url + "/v1/completions",
        json={"model": server.model, "prompt": token_ids(n, salt), "max_tokens": 1},
        timeout=600,
    ).raise_for_status()
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", type=float, nargs="+", default=[0, 250], help="--itl-target-ms values to serve with")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--long-tokens", type=int, default=8000)
    p.add_argument("--serve-args", default="", help="more `tokenmill serve` arguments")
    ns = p.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "| --itl-target-ms | hostile request | status | its time (s) | bystander's largest gap (s) | "
        "its usual gap (s) | largest /health latency (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    servers = {}
    try:
        for target in ns.targets:  # all up at once, runs interleaved: the machine's drift hits each alike
            servers[target] = Server(target, ns.serve_args.split())
        salt = 0
        rows = {}
        for name, body in hostile_requests(ns.long_tokens).items():
            runs = {t: [] for t in servers}
            for _ in range(ns.repeat):
                for target, server in servers.items():
                    salt += 1
                    runs[target].append(one(server, body, salt))
            rows[name] = runs
        alone = {t: [] for t in servers}
        for _ in range(ns.repeat):
            for target, server in servers.items():
                salt += 1
                alone[target].append(prefill_alone(server, ns.long_tokens, salt))
    finally:
        for server in servers.values():
            server.close()
    for target in servers:
        for name, runs in rows.items():
            med = {k: statistics.median(r[k] for r in runs[target]) for k in ("took", "max_gap", "usual_gap", "health")}
            status = "/".join(sorted({str(r["status"]) for r in runs[target]}))
            print(
                f"| {target:g} | {name} | {status} | {med['took']:.2f} | {med['max_gap']:.3f} | "
                f"{med['usual_gap']:.3f} | {med['health']:.3f} |"
            )
    print()
    print(f"| --itl-target-ms | prefill alone, {ns.long_tokens} tokens: tokens/s, median (each run) |")
    print("|---|---|")
    for target, rates in alone.items():
        print(f"| {target:g} | {statistics.median(rates):.0f} ({', '.join(f'{r:.0f}' for r in rates)}) |")


if __name__ == "__main__":
    main()
