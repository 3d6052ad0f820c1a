"""`tokenmill bench serve`: a load generator for any OpenAI-compatible server.

Streams requests over /v1/completions (or /v1/chat/completions) at a request rate with Poisson
(or Gamma, with --burstiness) arrivals, or with at most --max-concurrency in flight, and reports
TTFT, TPOT = (E2E - TTFT) / (output tokens - 1), ITL between streamed chunks and E2E latency
(mean, median, p90, p99), request / output-token throughput, goodput and failures."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from tokenmill.bench.datasets import BenchRequest, load_tokenizer, prefix_requests, random_requests, sharegpt_requests

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    start_time: float = 0.0  # since the benchmark start
    error: str = ""


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    endpoint: str,
    model: str,
    req: BenchRequest,
    t0: float,
    temperature: float = 0.0,
    extra_body: dict | None = None,
) -> RequestResult:
    res = RequestResult(prompt_len=req.prompt_len)
    chat = endpoint.endswith("chat/completions")
    body: dict = {
        "model": model,
        "max_tokens": req.output_len,
        "stream": True,
        "ignore_eos": True,
        "temperature": temperature,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
    body.update(extra_body or {})
    start = time.perf_counter()
    res.start_time = start - t0
    last = start
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url + endpoint, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}"
                return res
            async for line in r.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("error"):
                    res.error = json.dumps(msg["error"])[:500]
                    return res
                if msg.get("usage") and msg["usage"].get("completion_tokens") is not None:
                    usage_tokens = msg["usage"]["completion_tokens"]
                text = ""
                for ch in msg.get("choices") or []:
                    text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
        res.e2el = time.perf_counter() - start
        res.output_tokens = usage_tokens if usage_tokens is not None else chunks
        res.success = chunks > 0 or res.output_tokens > 0
        if not res.success:
            res.error = "no tokens streamed"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator):
    """Yield request indices, sleeping Gamma(shape=burstiness, mean 1/rate) between them
    (burstiness 1: Poisson arrivals; rate inf: all at once)."""
    for i in range(n):
        yield i
        if rate == float("inf") or i == n - 1:
            continue
        await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for it in items or []:
        for part in it.split():
            key, sep, val = part.partition(":")
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {part!r}")
            slos[key] = float(val)
    return slos


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64) * scale if values else np.zeros(1)
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    for p in PERCENTILES[1:]:
        out[f"p{p}"] = float(np.percentile(a, p))
    return out


def compute_metrics(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.e2el for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    good = 0
    for r in ok:
        tpot = (r.e2el - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        vals = {"ttft": r.ttft * 1000, "tpot": tpot * 1000, "e2el": r.e2el * 1000}
        good += all(vals[k] <= v for k, v in slos.items())
    m = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats(ttfts),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats(itls),
        "e2el_ms": _stats(e2els),
    }
    if slos:
        m["goodput_slos_ms"] = slos
        m["request_goodput"] = good / duration
    return m


async def fetch_model(client: httpx.AsyncClient, base_url: str) -> str:
    r = await client.get(base_url + "/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def benchmark(
    base_url: str,
    requests: list[BenchRequest],
    *,
    model: str | None = None,
    endpoint: str = "/v1/completions",
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    goodput: dict[str, float] | None = None,
    api_key: str | None = None,
    seed: int = 0,
    warmup: bool = True,
    disable_tqdm: bool = False,
    temperature: float = 0.0,
    timeout: float = 6 * 3600,
    extra_body: dict | None = None,
) -> dict:
    """Run the load and return {'metrics': ..., 'requests': [...], 'config': ...}.
    `extra_body` is merged into every request body (e.g. a logit_bias for servers without ignore_eos)."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if not requests:
        raise ValueError("no requests to send")
    base_url = base_url.rstrip("/")
    if base_url.endswith("/v1"):
        base_url = base_url[:-3]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or 1000, max_keepalive_connections=max_concurrency or 1000)
    async with httpx.AsyncClient(
        headers=headers, timeout=httpx.Timeout(timeout, connect=30.0), limits=limits
    ) as client:
        model = model or await fetch_model(client, base_url)
        if warmup:
            w = requests[0]
            res = await send_request(
                client,
                base_url,
                endpoint,
                model,
                BenchRequest(w.prompt, w.prompt_len, min(w.output_len, 4)),
                time.perf_counter(),
                temperature,
                extra_body,
            )
            if not res.success:
                raise RuntimeError(f"warm-up request failed: {res.error}")
        pbar = None
        if not disable_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(requests), desc="requests", unit="req")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def one(req: BenchRequest, t0: float) -> RequestResult:
            if sem is None:
                r = await send_request(client, base_url, endpoint, model, req, t0, temperature, extra_body)
            else:
                async with sem:
                    r = await send_request(client, base_url, endpoint, model, req, t0, temperature, extra_body)
            if pbar is not None:
                pbar.update(1)
            return r

        counters_before = await scrape_counters(client, base_url)
        rng = np.random.default_rng(seed)
        t0 = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), request_rate, burstiness, rng):
            tasks.append(asyncio.create_task(one(requests[i], t0)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if pbar is not None:
            pbar.close()
        counters_after = await scrape_counters(client, base_url)
    metrics = compute_metrics(results, duration, goodput or {})
    if counters_before is not None and counters_after is not None:
        delta = {k: v - counters_before.get(k, 0.0) for k, v in counters_after.items()}
        if "prefix_cache_queries" in delta and "prefix_cache_hits" in delta:
            queries, hits = delta["prefix_cache_queries"], delta["prefix_cache_hits"]
            metrics["prefix_cache"] = {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else 0.0}
        if delta.get("spec_decode_num_drafts"):  # vLLM's acceptance rate and mean acceptance length
            drafts, proposed = delta["spec_decode_num_drafts"], delta.get("spec_decode_num_draft_tokens", 0.0)
            accepted = delta.get("spec_decode_num_accepted_tokens", 0.0)
            metrics["spec_decode"] = {
                "drafts": drafts,
                "draft_tokens": proposed,
                "accepted_tokens": accepted,
                "acceptance_rate": accepted / proposed if proposed else 0.0,
                "acceptance_length": 1.0 + accepted / drafts,
            }
    config = {
        "base_url": base_url,
        "endpoint": endpoint,
        "model": model,
        "num_prompts": len(requests),
        "request_rate": request_rate if request_rate != float("inf") else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "seed": seed,
    }
    return {"config": config, "metrics": metrics, "requests": [asdict(r) for r in results]}


_COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


async def scrape_counters(client, base_url: str) -> dict[str, float] | None:
    """The server's Prometheus counters this report uses (tokenmill:* or vllm:* prefix-cache
    queries / hits, speculative-decoding drafts / draft tokens / accepted tokens), by the name's
    last part; None when /metrics does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get(base_url + "/metrics", timeout=10)
        if r.status_code != 200:
            return None
        found: dict[str, float] = {}
        for fam in text_string_to_metric_families(r.text):
            for key in _COUNTERS:
                if fam.name.endswith(":" + key):
                    found[key] = found.get(key, 0.0) + sum(x.value for x in fam.samples if x.name.endswith("_total"))
    except (httpx.HTTPError, ValueError):
        return None
    return found


def format_report(metrics: dict) -> str:
    lines = ["============ Serving Benchmark Result ============"]

    def row(k, v):
        lines.append(f"{k:<40}{v:>12}")

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    row("Benchmark duration (s):", f"{metrics['duration_s']:.2f}")
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}")
    if "request_goodput" in metrics:
        row("Request goodput (req/s):", f"{metrics['request_goodput']:.2f}")
    row("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}")
    if "prefix_cache" in metrics:
        pc = metrics["prefix_cache"]
        row("Prefix cache hit rate (tokens):", f"{100 * pc['hit_rate']:.1f}%")
        row("Prefix cache hits / queries:", f"{pc['hits']:.0f}/{pc['queries']:.0f}")
    if "spec_decode" in metrics:
        sd = metrics["spec_decode"]
        row("Draft acceptance rate:", f"{100 * sd['acceptance_rate']:.1f}%")
        row("Mean acceptance length:", f"{sd['acceptance_length']:.2f}")
        row("Accepted / drafted tokens:", f"{sd['accepted_tokens']:.0f}/{sd['draft_tokens']:.0f}")
    for key, title in (
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st)"),
        ("itl_ms", "Inter-token Latency"),
        ("e2el_ms", "End-to-end Latency"),
    ):
        lines.append(f"{'-' * 15}{title}{'-' * 15}")
        name = key.split("_")[0].upper()
        s = metrics[key]
        row(f"Mean {name} (ms):", f"{s['mean']:.2f}")
        row(f"Median {name} (ms):", f"{s['median']:.2f}")
        for p in PERCENTILES[1:]:
            row(f"P{p} {name} (ms):", f"{s[f'p{p}']:.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def save_plots(result: dict, path_prefix: str) -> str | None:
    """Latency histograms and output throughput over time; only when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    reqs = [r for r in result["requests"] if r["success"]]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    for ax, (name, vals) in zip(
        axes[:3],
        (
            ("TTFT (ms)", [r["ttft"] * 1000 for r in reqs]),
            ("ITL (ms)", [x * 1000 for r in reqs for x in r["itl"]]),
            ("E2E latency (ms)", [r["e2el"] * 1000 for r in reqs]),
        ),
    ):
        ax.hist(vals, bins=50)
        ax.set_xlabel(name)
        ax.set_ylabel("count")
    # output tokens per second over time, in 1 s bins, from each request's token timestamps
    times: list[float] = []
    for r in reqs:
        t = r["start_time"] + r["ttft"]
        times.append(t)
        for x in r["itl"]:
            t += x
            times.append(t)
    if times:
        bins = np.arange(0, max(times) + 1.0, 1.0)
        counts, edges = np.histogram(times, bins=bins)
        axes[3].plot(edges[:-1], counts)
    axes[3].set_xlabel("time (s)")
    axes[3].set_ylabel("streamed chunks / s")
    fig.tight_layout()
    out = path_prefix + ".png"
    fig.savefig(out)
    plt.close(fig)
    return out


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="server root, e.g. http://localhost:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model name sent in requests (default: the first of /v1/models)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer folder to build and count prompts (default: the built-in SmolLM2)"
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "prefix"])
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (for --dataset-name sharegpt)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: exact)",
    )
    p.add_argument("--prefix-len", type=int, default=512, help="shared prefix tokens (prefix dataset)")
    p.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="override the output length taken from the ShareGPT answers",
    )
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests per second (default inf: all at once)"
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of the arrivals: 1 = Poisson, <1 burstier, >1 more uniform",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 (also e2el)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--result-file", default=None, help="write the results as JSON here")
    p.add_argument(
        "--plot",
        action="store_true",
        help="also write <result-file>.png (latency histograms, throughput over time; needs matplotlib)",
    )


def build_requests(ns: argparse.Namespace) -> list[BenchRequest]:
    tok = load_tokenizer(ns.tokenizer)
    if ns.dataset_name == "random":
        return random_requests(
            tok, ns.num_prompts, ns.random_input_len, ns.random_output_len, ns.random_range_ratio, ns.seed
        )
    if ns.dataset_name == "prefix":
        return prefix_requests(tok, ns.num_prompts, ns.prefix_len, ns.random_input_len, ns.random_output_len, ns.seed)
    if not ns.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path")
    return sharegpt_requests(tok, ns.dataset_path, ns.num_prompts, ns.sharegpt_output_len, ns.seed)


def run_from_args(ns: argparse.Namespace) -> int:
    slos = parse_goodput(ns.goodput)
    requests = build_requests(ns)
    try:
        result = asyncio.run(
            benchmark(
                ns.base_url,
                requests,
                model=ns.model,
                endpoint=ns.endpoint,
                request_rate=ns.request_rate,
                burstiness=ns.burstiness,
                max_concurrency=ns.max_concurrency,
                goodput=slos,
                api_key=ns.api_key,
                seed=ns.seed,
                warmup=ns.warmup,
                disable_tqdm=ns.disable_tqdm,
                temperature=ns.temperature,
            )
        )
    except (httpx.HTTPError, RuntimeError) as e:
        print(f"tokenmill bench serve: {e}", file=sys.stderr)
        if ns.log_level and ns.log_level.upper() == "DEBUG":
            traceback.print_exc()
        return 1
    print(format_report(result["metrics"]))
    if ns.result_file:
        result["config"].update(dataset_name=ns.dataset_name, tokenizer=ns.tokenizer)
        with open(ns.result_file, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"results written to {ns.result_file}")
        if ns.plot:
            png = save_plots(result, ns.result_file.rsplit(".json", 1)[0])
            print(f"plots written to {png}" if png else "matplotlib is not installed: no plots")
    return 0 if result["metrics"]["failed"] == 0 else 1
