"""Does one heavy request stall everybody else? For each kind of heavy request, a client
streams a completion from a running server; once its stream is flowing, a second client sends
the heavy request. Printed per kind: the heavy request's status and time, and the longest gap
between the first client's chunks (against the same stream's median gap with nothing else).

    tokenmill serve --port 8000 &            # or any older tokenmill, to compare
    python benchmarks/heavy_requests.py --url http://127.0.0.1:8000 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import httpx

TEMPLATE_BOMB = "{{ 'ab ' * 10000000 }}"


def heavy_requests(n_bad_words: int) -> dict[str, tuple[str, dict]]:
    return {
        f"{n_bad_words} bad_words": ("/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                                         "bad_words": [f"word{i}" for i in range(n_bad_words)]}),
        "20000 bad_words": ("/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                                "bad_words": [f"word{i}" for i in range(20_000)]}),
        "chat_template 'ab ' * 1e7": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                                "max_tokens": 2, "chat_template": TEMPLATE_BOMB}),
        "/tokenize 10M characters": ("/tokenize", {"prompt": "hello world " * 833_334}),
        "1000 prompts": ("/v1/completions", {"prompt": ["Hello there"] * 1000, "max_tokens": 1}),
    }


def stream_gaps(url: str, model: str, started: threading.Event, stop: threading.Event) -> list[float]:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if len(times) == 10:
                    started.set()
                if stop.is_set():
                    break
    return [b - a for a, b in zip(times, times[1:])]


def one(url: str, model: str, path: str, body: dict) -> tuple[int, float, float, float]:
    started, stop, gaps = threading.Event(), threading.Event(), []
    t = threading.Thread(target=lambda: gaps.extend(stream_gaps(url, model, started, stop)))
    t.start()
    assert started.wait(300), "the stream did not start"
    time.sleep(0.5)  # some quiet gaps first: the baseline
    n_before = len(gaps) or 1
    t0 = time.perf_counter()
    try:
        status = httpx.post(url + path, json={"model": model, **body}, timeout=300).status_code
    except httpx.HTTPError:
        status = -1
    took = time.perf_counter() - t0
    time.sleep(0.5)
    stop.set()
    t.join(300)
    return status, took, max(gaps), statistics.median(gaps[:n_before] or gaps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--bad-words", type=int, default=1000, help="an allowed number of bad words")
    ns = p.parse_args()
    model = httpx.get(ns.url + "/v1/models").json()["data"][0]["id"]
    print(f"| heavy request | status | its time (s) | longest gap of another stream (s), median of {ns.repeat} |"
          f" that stream's usual gap (s) |")
    print("|---|---|---|---|---|")
    for name, (path, body) in heavy_requests(ns.bad_words).items():
        runs = [one(ns.url, model, path, body) for _ in range(ns.repeat)]
        status = "/".join(sorted({str(r[0]) for r in runs}))
        print(f"| {name} | {status} | {statistics.median(r[1] for r in runs):.2f} | "
              f"{statistics.median(r[2] for r in runs):.3f} | {statistics.median(r[3] for r in runs):.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
