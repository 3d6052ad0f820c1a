"""Does one heavy request stall everybody else? For each kind of heavy request, a client
streams a completion from a running server; once its stream is flowing, a second client sends
the heavy request. Printed per kind: the heavy request's status and time, and the longest gap
between the first client's chunks (against the same stream's median gap with nothing else).

`--large-responses`: instead, requests whose answers are large (n=128 with 20 logprobs, 1,024
sequences, 50,000 Anthropic content blocks, 2,048 embeddings with `--embed-url`), each sent
while another client probes GET /health back to back: printed per kind, the request's status
and time, and the slowest /health answer while it ran (against the probes' usual latency).
A probe waits exactly as long as the event loop is busy with something else.

    tokenmill serve --port 8000 &            # or any older tokenmill, to compare
    python benchmarks/heavy_requests.py --url http://127.0.0.1:8000 --repeat 3
    tokenmill serve --model EMBEDDING_MODEL --port 8001 &
    python benchmarks/heavy_requests.py --url http://127.0.0.1:8000 --large-responses \\
        --embed-url http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import httpx
from server_client import stream_times

TEMPLATE_BOMB = "{{ 'ab ' * 10000000 }}"


def heavy_requests(n_bad_words: int) -> dict[str, tuple[str, dict]]:
    return {
        f"{n_bad_words} bad_words": (
            "/v1/completions",
            {"prompt": "Hi", "max_tokens": 2, "bad_words": [f"word{i}" for i in range(n_bad_words)]},
        ),
        "20000 bad_words": (
            "/v1/completions",
            {"prompt": "Hi", "max_tokens": 2, "bad_words": [f"word{i}" for i in range(20_000)]},
        ),
        "chat_template 'ab ' * 1e7": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "chat_template": TEMPLATE_BOMB},
        ),
        "/tokenize 10M characters": ("/tokenize", {"prompt": "hello world " * 833_334}),
        "1000 prompts": ("/v1/completions", {"prompt": ["Hello there"] * 1000, "max_tokens": 1}),
    }


def large_responses(n_blocks: int) -> dict[str, tuple[str, dict]]:
    """Requests whose answers are large; the generation is short (16 tokens) so that building the
    answer is a visible share of the request's time."""
    gen = {"max_tokens": 16, "temperature": 1.0, "seed": 0, "ignore_eos": True}
    hi = [{"role": "user", "content": "Hi"}]
    # Blocks of one space: 50,000 of them still render into a prompt that fits the context.
    blocks = [{"type": "text", "text": " "} for _ in range(n_blocks)]
    chat = {"messages": hi, "n": 128, "logprobs": True, "top_logprobs": 20, **gen}
    return {
        # The same work streamed, so no body is built whole: what the machine and the engine's own
        # work cost a probe, to read the rows below against.
        "chat n=128, logprobs=20, streamed": ("/v1/chat/completions", {**chat, "stream": True}),
        "chat n=128, logprobs=20": ("/v1/chat/completions", chat),
        "completions 256 prompts x n=4 (1,024 sequences)": (
            "/v1/completions",
            {"prompt": ["Hello"] * 256, "n": 4, **gen},
        ),
        f"messages, {n_blocks:,} content blocks": (
            "/v1/messages",
            {"messages": [{"role": "user", "content": blocks}], "max_tokens": 16},
        ),
        "embeddings, 2,048 inputs": (
            "/v1/embeddings",
            {"input": [f"sentence number {i} about paged attention" for i in range(2048)]},
        ),
    }


def health_latencies(url: str, stop: threading.Event) -> list[tuple[float, float]]:
    """(start, latency) of GET /health probes sent back to back until `stop`."""
    probes = []
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            client.get(url + "/health")
            probes.append((t0, time.perf_counter() - t0))
            time.sleep(0.002)
    return probes


def probe_during(url: str, model: str, path: str, body: dict) -> tuple[int, float, float, float]:
    """The request's status and time, the slowest /health probe sent while it ran and the median
    probe before it."""
    stop, probes = threading.Event(), []
    t = threading.Thread(target=lambda: probes.extend(health_latencies(url, stop)))
    t.start()
    time.sleep(0.5)  # quiet probes first: the baseline
    t0 = time.perf_counter()
    try:
        status = httpx.post(url + path, json={"model": model, **body}, timeout=600).status_code
    except httpx.HTTPError:
        status = -1
    t1 = time.perf_counter()
    stop.set()
    t.join(60)
    during = [lat for start, lat in probes if t0 <= start < t1] or [0.0]
    before = [lat for start, lat in probes if start < t0] or [0.0]
    return status, t1 - t0, max(during), statistics.median(before)


def one(url: str, model: str, path: str, body: dict) -> tuple[int, float, float, float]:
    started, stop, times = threading.Event(), threading.Event(), []
    t = threading.Thread(target=stream_times, args=(url, model, started, stop, times))
    t.start()
    assert started.wait(300), "the stream did not start"
    time.sleep(0.5)  # some quiet gaps first: the baseline
    n_before = max(len(times) - 1, 1)
    t0 = time.perf_counter()
    try:
        status = httpx.post(url + path, json={"model": model, **body}, timeout=300).status_code
    except httpx.HTTPError:
        status = -1
    took = time.perf_counter() - t0
    time.sleep(0.5)
    stop.set()
    t.join(300)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return status, took, max(gaps), statistics.median(gaps[:n_before] or gaps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--bad-words", type=int, default=1000, help="an allowed number of bad words")
    p.add_argument("--large-responses", action="store_true", help="/health latency while large answers are built")
    p.add_argument("--content-blocks", type=int, default=50_000, help="content blocks of the Messages request")
    p.add_argument("--embed-url", help="a server with an embedding model (the embeddings kind is skipped without)")
    ns = p.parse_args()
    model = httpx.get(ns.url + "/v1/models").json()["data"][0]["id"]
    if ns.large_responses:
        print(
            f"| large answer | status | its time (s) | slowest /health while it ran (s), median of {ns.repeat} |"
            f" usual /health (s) |"
        )
        print("|---|---|---|---|---|")
        for name, (path, body) in large_responses(ns.content_blocks).items():
            url = ns.embed_url if path == "/v1/embeddings" else ns.url
            if url is None:
                continue
            served = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            runs = [probe_during(url, served, path, body) for _ in range(ns.repeat)]
            status = "/".join(sorted({str(r[0]) for r in runs}))
            print(
                f"| {name} | {status} | {statistics.median(r[1] for r in runs):.2f} | "
                f"{statistics.median(r[2] for r in runs):.3f} | {statistics.median(r[3] for r in runs):.4f} |",
                flush=True,
            )
        return
    print(
        f"| heavy request | status | its time (s) | longest gap of another stream (s), median of {ns.repeat} |"
        f" that stream's usual gap (s) |"
    )
    print("|---|---|---|---|---|")
    for name, (path, body) in heavy_requests(ns.bad_words).items():
        runs = [one(ns.url, model, path, body) for _ in range(ns.repeat)]
        status = "/".join(sorted({str(r[0]) for r in runs}))
        print(
            f"| {name} | {status} | {statistics.median(r[1] for r in runs):.2f} | "
            f"{statistics.median(r[2] for r in runs):.3f} | {statistics.median(r[3] for r in runs):.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
