"""Does a server's first structured-output request stall the other streams? Each run starts a fresh
`tokenmill serve` (the default model), waits for GET /health 200, then `--settle` seconds; a client
streams a completion and, once it flows, a second client sends the server's first grammar request
(a JSON schema), then a second one with another grammar. Printed, medians of `--repeat` fresh
servers: the grammar requests' status and time, and the longest gap between the streaming
client's chunks while each is in flight, and before either (from the stream's start: what a
server does by itself right after it is ready).

    python benchmarks/first_grammar_request.py --repeat 3                  # this checkout
    python benchmarks/first_grammar_request.py --src /other/checkout/src   # another tree, same machine
    python benchmarks/first_grammar_request.py --settle 0                  # grammar right after ready

It prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import httpx
from server_client import longest_gap, start_server, stop_server, stream_times

FIRST = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SECOND = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}


def grammar_request(url: str, model: str, schema: dict) -> tuple[int, float, float]:
    t0 = time.perf_counter()
    r = httpx.post(
        url + "/v1/completions",
        timeout=300,
        json={"model": model, "prompt": "A person as JSON:", "max_tokens": 30, "temperature": 0, "guided_json": schema},
    )
    return r.status_code, t0, time.perf_counter()


def one_run(src: str | None, serve_args: list[str], settle: float) -> dict:
    with tempfile.TemporaryFile("w+") as log:
        proc, url, ready_s = start_server(src, serve_args, log, 300.0)
        try:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            time.sleep(settle)
            started, stop, times = threading.Event(), threading.Event(), []
            t = threading.Thread(target=stream_times, args=(url, model, started, stop, times))
            t.start()
            assert started.wait(300), "the stream did not start"
            time.sleep(0.5)  # quiet gaps first: the baseline
            usual = statistics.median(b - a for a, b in zip(times, times[1:]))
            alone = longest_gap(times, times[0], time.perf_counter())  # from its start, before any grammar
            s1, a1, b1 = grammar_request(url, model, FIRST)
            time.sleep(0.3)
            s2, a2, b2 = grammar_request(url, model, SECOND)
            time.sleep(0.3)
            stop.set()
            t.join(300)
        finally:
            stop_server(proc)
    return {
        "ready_s": ready_s,
        "usual_gap": usual,
        "alone": ("-", 0.0, alone),
        "first": (s1, b1 - a1, longest_gap(times, a1, b1)),
        "second": (s2, b2 - a2, longest_gap(times, a2, b2)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", help="PYTHONPATH of the tokenmill to serve (default: the installed one)")
    p.add_argument("--repeat", type=int, default=3, help="fresh servers")
    p.add_argument("--settle", type=float, default=3.0, help="seconds between /health 200 and the stream")
    p.add_argument("serve_args", nargs="*", help="more `tokenmill serve` arguments (after --)")
    ns = p.parse_args()
    runs = [one_run(ns.src, ns.serve_args, ns.settle) for _ in range(ns.repeat)]

    def med(f) -> float:
        return statistics.median(f(r) for r in runs)

    print(
        f"start to /health 200: {med(lambda r: r['ready_s']):.2f} s; the stream's usual gap "
        f"{med(lambda r: r['usual_gap']) * 1000:.0f} ms (medians of {ns.repeat} fresh servers, "
        f"grammar requests {ns.settle:g} s after ready)"
    )
    print("| grammar request | status | its time (s) | longest gap of the other stream meanwhile (s) |")
    print("|---|---|---|---|")
    for key, name in (
        ("alone", "none (the stream from its start, before any grammar)"),
        ("first", "first grammar request"),
        ("second", "a second, new grammar"),
    ):
        status = "/".join(sorted({str(r[key][0]) for r in runs}))
        took = "-" if key == "alone" else f"{med(lambda r: r[key][1]):.2f}"
        print(f"| {name} | {status} | {took} | {med(lambda r: r[key][2]):.3f} |", flush=True)


if __name__ == "__main__":
    main()
