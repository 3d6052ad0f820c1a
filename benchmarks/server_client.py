"""What the serving benchmarks share: a `tokenmill serve` started on a free loopback port and
waited for, and a bystander client streaming a long completion, with the gaps between its chunks.
Imported by the benchmark scripts beside it (run as `python benchmarks/<script>.py`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(src: str | None, serve_args: list[str], log, timeout_s: float = 600.0):
    """(process, url, seconds from its start to /health 200); src: the PYTHONPATH of the tokenmill to
    serve (None: the installed one); log: a file for its output."""
    port = free_port()
    env = dict(os.environ, **({"PYTHONPATH": src} if src else {}))
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"no /health 200 in {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def stream_times(
    url: str, model: str, started: threading.Event, stop: threading.Event, out: list[float], max_tokens: int = 4000
) -> None:
    """Arrival time of each chunk of a long streamed completion (into `out`), until `stop`; `started`
    is set at the 10th chunk."""
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(time.perf_counter())
                if len(out) == 10:
                    started.set()
                if stop.is_set():
                    break


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest gap between chunks that overlaps [start, end]."""
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    return max(gaps, default=float("nan"))
