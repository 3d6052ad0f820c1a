"""Does a long prompt stall the requests already streaming? Starts `tokenmill serve` (the default
model) once with each --itl-target-ms given (0: every step takes the whole token budget, as before
the time-sized budget), and for each hostile request: a bystander streams a completion, and once
its stream flows the hostile request is sent. Printed per server and hostile request (medians of
--repeat runs): the bystander's largest gap between two chunks, its usual gap, the largest /health
latency meanwhile (probed every 50 ms), and the hostile request's time; then the prefill
throughput of the long prompt with nothing else running.

    python benchmarks/bystander.py --repeat 3                      # --itl-target-ms 0 and 250
    python benchmarks/bystander.py --targets 0 100 250 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def token_ids(n: int, salt: int) -> list[int]:
    """n varied token ids (no prefix shared between runs: each run's prompt is computed)."""
    return [100 + (i * 7919 + salt * 104729) % 40000 for i in range(n)]


def hostile_requests(long_tokens: int) -> dict[str, dict]:
    return {
        f"{long_tokens}-token prompt": {"prompt": long_tokens, "max_tokens": 1},
        f"{long_tokens // 2}-token prompt, prompt_logprobs=20": {"prompt": long_tokens // 2, "max_tokens": 1,
                                                                 "prompt_logprobs": 20},
        "beam search, n=128": {"prompt": 64, "max_tokens": 8, "n": 128, "use_beam_search": True, "temperature": 0},
    }


class Server:
    def __init__(self, itl_target_ms: float, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--itl-target-ms", str(itl_target_ms), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"the server exited:\n{self.log.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def stream(server: Server, started: threading.Event, stop: threading.Event, times: list[float]) -> None:
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if len(times) == 10:
                    started.set()
                if stop.is_set():
                    break


def probe_health(server: Server, stop: threading.Event, worst: list[float]) -> None:
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get(server.url + "/health")
            worst[0] = max(worst[0], time.perf_counter() - t0)
            stop.wait(0.05)


def one(server: Server, body: dict, salt: int) -> dict[str, float]:
    started, stop, times = threading.Event(), threading.Event(), []
    bystander = threading.Thread(target=stream, args=(server, started, stop, times))
    bystander.start()
    assert started.wait(600), "the bystander's stream did not start"
    time.sleep(0.5)  # the stream's usual gaps first
    n_before = len(times)
    probe_stop, worst = threading.Event(), [0.0]
    prober = threading.Thread(target=probe_health, args=(server, probe_stop, worst))
    prober.start()
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": server.model, **body, "prompt": token_ids(body["prompt"], salt)}, timeout=600)
    took = time.perf_counter() - t0
    t_end = time.perf_counter()
    probe_stop.set()
    prober.join()
    time.sleep(0.3)
    stop.set()
    bystander.join(600)
    gaps = [b - a for a, b in zip(times, times[1:])]
    during = [b - a for a, b in zip(times, times[1:]) if a < t_end and b > t0]
    return {"status": r.status_code, "took": took, "max_gap": max(during or gaps),
            "usual_gap": statistics.median(gaps[: max(n_before - 1, 1)]), "health": worst[0]}


def prefill_alone(server: Server, n: int, salt: int) -> float:
    t0 = time.perf_counter()
    httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": token_ids(n, salt),
                                                     "max_tokens": 1}, timeout=600).raise_for_status()
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", type=float, nargs="+", default=[0, 250], help="--itl-target-ms values to serve with")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--long-tokens", type=int, default=8000)
    p.add_argument("--serve-args", default="", help="more `tokenmill serve` arguments")
    ns = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| --itl-target-ms | hostile request | status | its time (s) | bystander's largest gap (s) | "
          "its usual gap (s) | largest /health latency (s) |")
    print("|---|---|---|---|---|---|---|")
    alone = {}
    salt = 0
    for target in ns.targets:
        server = Server(target, ns.serve_args.split())
        try:
            for name, body in hostile_requests(ns.long_tokens).items():
                runs = []
                for _ in range(ns.repeat):
                    salt += 1
                    runs.append(one(server, body, salt))
                med = {k: statistics.median(r[k] for r in runs) for k in ("took", "max_gap", "usual_gap", "health")}
                status = "/".join(sorted({str(r["status"]) for r in runs}))
                print(f"| {target:g} | {name} | {status} | {med['took']:.2f} | {med['max_gap']:.3f} | "
                      f"{med['usual_gap']:.3f} | {med['health']:.3f} |", flush=True)
            rates = []
            for _ in range(ns.repeat):
                salt += 1
                rates.append(prefill_alone(server, ns.long_tokens, salt))
            alone[target] = statistics.median(rates)
        finally:
            server.close()
    print()
    print("| --itl-target-ms | prefill alone, {} tokens (tokens/s, median) |".format(ns.long_tokens))
    print("|---|---|")
    for target, rate in alone.items():
        print(f"| {target:g} | {rate:.0f} |")


if __name__ == "__main__":
    main()
