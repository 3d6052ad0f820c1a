"""`tokenmill bench throughput | latency | roofline`: measurements straight into the engine.

- throughput: N seeded random-token prompts through LLM.generate, all at once.
- latency: batch-1 prefill time for a prompt length and time per output token (TPOT).
- roofline: this machine's memory bandwidth and matmul FLOP/s, and how close batch-1 decode
  (bound by reading every weight once per token) and large-batch prefill (bound by matmul
  FLOP/s) come to them. Bandwidth and decode are measured in alternating rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from tqdm import tqdm

from tokenmill.engine.arg_utils import add_engine_args, engine_args_from
from tokenmill.kernels.memory import huge_page_buffer
from tokenmill.model.layers.linear import onednn_bf16_fast
from tokenmill.sampling_params import SamplingParams


def add_workload_args(p: argparse.ArgumentParser, input_len: int, output_len: int) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=input_len, help=f"prompt tokens (default {input_len})")
    g.add_argument(
        "--output-len", type=int, default=output_len, help=f"output tokens, EOS ignored (default {output_len})"
    )
    g.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompt tokens")
    g.add_argument("--output-json", default=None, help="write the results here as JSON")


def _random_prompts(llm, n: int, length: int, seed: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    special = set(getattr(tok, "all_special_ids", []) or [])
    vocab = [i for i in range(len(tok)) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(length)] for _ in range(n)]


def _params(output_len: int):
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def _emit(result: dict, path: str | None) -> int:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")
    return 0


def run_throughput(llm, ns: argparse.Namespace) -> int:
    prompts = _random_prompts(llm, ns.num_prompts, ns.input_len, ns.bench_seed)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=_params(4), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_params(ns.output_len), use_tqdm=True)
    dt = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    res = {
        "num_prompts": ns.num_prompts,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "elapsed_s": dt,
        "requests_per_s": ns.num_prompts / dt,
        "output_tokens_per_s": out_tokens / dt,
        "total_tokens_per_s": (in_tokens + out_tokens) / dt,
    }
    print(
        f"{ns.num_prompts} prompts x {ns.input_len} in x {ns.output_len} out in {dt:.2f} s: "
        f"{res['requests_per_s']:.2f} req/s, {res['output_tokens_per_s']:.1f} output tok/s, "
        f"{res['total_tokens_per_s']:.1f} total tok/s"
    )
    return _emit(res, ns.output_json)


def _timed_stream(llm, prompt: list[int], params) -> tuple[float, float]:
    """One batch-1 generation: (seconds to the first token, time per output token after it)."""
    t0 = time.perf_counter()
    first = last = None
    for _ in llm.stream(prompt, params):
        now = time.perf_counter()
        first = first if first is not None else now
        last = now
    return first - t0, (last - first) / max(params.max_tokens - 1, 1)


def measure_latency(llm, input_len: int, output_len: int, iters: int, seed: int = 0) -> dict:
    """Median batch-1 prefill time (to the first token) and TPOT over `iters` runs."""
    prompts = _random_prompts(llm, iters + 1, input_len, seed)
    params = _params(output_len)
    _timed_stream(llm, prompts[0], params)  # warm-up
    # A bar over the timed runs (on a terminal only): a run is seconds, the whole minutes.
    runs = [
        _timed_stream(llm, p, params)
        for p in tqdm(prompts[1:], desc="Latency runs", unit="run", leave=False, disable=None)
    ]
    prefill, tpot = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    return {
        "input_len": input_len,
        "output_len": output_len,
        "iters": iters,
        "prefill_s": prefill,
        "tpot_s": tpot,
        "decode_tokens_per_s": 1.0 / tpot,
    }


def run_latency(llm, ns: argparse.Namespace) -> int:
    res = measure_latency(llm, ns.input_len, ns.output_len, ns.num_iters, ns.bench_seed)
    print(
        f"batch 1, {ns.input_len} in / {ns.output_len} out, median of {ns.num_iters}: "
        f"prefill {res['prefill_s'] * 1e3:.1f} ms, TPOT {res['tpot_s'] * 1e3:.2f} ms "
        f"({res['decode_tokens_per_s']:.1f} tokens/s)"
    )
    return _emit(res, ns.output_json)


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth (bytes/s): a sum over a buffer far larger than the caches, best of N. The
    buffer is on the same kind of pages as the weights a decode step streams (kernels/memory.py)."""

    x = huge_page_buffer(int(gib * 2**30)).view(torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def measure_matmul(dtype: torch.dtype, n: int = 4096, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step must read: every weight once (quantized ones in their stored
    form), but only one row of the embedding table (whose full table a tied lm_head does read)."""
    seen, total = set(), 0
    for mname, mod in model.named_modules():
        if mname.startswith("rope"):
            continue
        embedding = "embed_tokens" in mname
        tensors = list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
        panels = getattr(mod, "panels", None)  # PackedLinear: small steps read its panels (in the weight
        if isinstance(panels, torch.Tensor):  # arena, no buffer), not oneDNN's packed copy
            tensors = [panels] + ([mod.bias] if getattr(mod, "bias", None) is not None else [])
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if embedding:
                total += nbytes // t.shape[0]
            elif id(t) not in seen:
                seen.add(id(t))
                total += nbytes
    return total


def run_roofline(llm, ns: argparse.Namespace) -> int:
    model = llm.engine.core.runner.model
    dtype = llm.engine.config.model.dtype
    weight_bytes = decode_weight_bytes(model)
    # Multiply-adds per prompt token: the layers' linears (logits are computed for one token only).
    matmul_params = sum(
        m.in_features * m.out_features for n, m in model.named_modules() if hasattr(m, "in_features") and n != "lm_head"
    )
    # Memory bandwidth on a shared machine drifts by tens of percent within minutes: each round
    # measures it right before one batch-1 decode run, and the fraction is the rounds' median.
    prompts = _random_prompts(llm, ns.num_iters + 1, ns.input_len, ns.bench_seed)
    params = _params(ns.output_len)
    _timed_stream(llm, prompts[0], params)  # warm-up
    rounds = []
    for prompt in prompts[1:]:
        bw = measure_bandwidth()
        rounds.append((bw, _timed_stream(llm, prompt, params)[1]))
    bw = statistics.median(r[0] for r in rounds)
    tpot = statistics.median(r[1] for r in rounds)
    fraction = statistics.median(weight_bytes / r[1] / r[0] for r in rounds)
    # Without a bf16 GEMM (AVX2 CPUs) the engine computes bf16 linears with float32 FMAs, so
    # float32's GEMM is the compute peak to compare with (torch's bf16 matmul there is ~10x slower).
    mm_dtype = torch.float32 if dtype == torch.bfloat16 and not onednn_bf16_fast() else dtype
    peak = measure_matmul(mm_dtype)
    prefill_tokens = ns.prefill_len
    thr_prompts = _random_prompts(llm, 1, prefill_tokens, ns.bench_seed + 1)
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=thr_prompts, sampling_params=_params(1))
    prefill_s = time.perf_counter() - t0
    prefill_flops = 2 * matmul_params * prefill_tokens / prefill_s
    res = {
        "memory_bandwidth_gb_s": bw / 1e9,
        "matmul_gflop_s": peak / 1e9,
        "dtype": str(dtype),
        "matmul_dtype": str(mm_dtype),
        "weight_bytes_per_decode_step": weight_bytes,
        "batch1_tpot_s": tpot,
        "batch1_decode_gb_s": weight_bytes / tpot / 1e9,
        "batch1_decode_fraction_of_bandwidth": fraction,
        "rounds": [{"memory_bandwidth_gb_s": b / 1e9, "batch1_tpot_s": t} for b, t in rounds],
        "decode_roofline_tokens_per_s": bw / weight_bytes,
        "prefill_tokens": prefill_tokens,
        "prefill_s": prefill_s,
        "prefill_gflop_s": prefill_flops / 1e9,
        "prefill_fraction_of_matmul_peak": prefill_flops / peak,
    }
    print(
        f"machine: memory bandwidth {res['memory_bandwidth_gb_s']:.1f} GB/s (median of {len(rounds)} rounds), "
        f"{mm_dtype} matmul {res['matmul_gflop_s']:.0f} GFLOP/s ({torch.get_num_threads()} threads)"
    )
    print(
        f"batch-1 decode: {weight_bytes / 1e6:.0f} MB of weights per token, TPOT {tpot * 1e3:.2f} ms "
        f"-> {res['batch1_decode_gb_s']:.1f} GB/s = {100 * fraction:.0f}% of bandwidth (median of the rounds' "
        f"ratios; roofline {res['decode_roofline_tokens_per_s']:.0f} tokens/s, measured {1 / tpot:.1f})"
    )
    print("  rounds (GB/s, TPOT ms): " + ", ".join(f"{b / 1e9:.1f} / {t * 1e3:.2f}" for b, t in rounds))
    print(
        f"prefill of {prefill_tokens} tokens: {prefill_s:.2f} s -> {res['prefill_gflop_s']:.0f} GFLOP/s = "
        f"{100 * res['prefill_fraction_of_matmul_peak']:.0f}% of the matmul peak"
    )
    return _emit(res, ns.output_json)


def add_offline_parsers(b) -> None:
    """Adds throughput, latency and roofline to the `tokenmill bench` sub-parsers."""
    t = b.add_parser("throughput", help="offline throughput straight into the engine")
    add_engine_args(t)
    add_workload_args(t, 256, 128)
    t.add_argument("--num-prompts", type=int, default=64, help="prompts, all submitted at once (default 64)")
    t.set_defaults(bench_run=run_throughput)

    lt = b.add_parser("latency", help="batch-1 prefill time and time per output token")
    add_engine_args(lt)
    add_workload_args(lt, 256, 128)
    lt.add_argument("--num-iters", type=int, default=5, help="timed runs; the median is reported (default 5)")
    lt.set_defaults(bench_run=run_latency)

    r = b.add_parser("roofline", help="memory bandwidth and matmul FLOP/s, and how close decode and prefill come")
    add_engine_args(r)
    add_workload_args(r, 32, 64)
    r.add_argument(
        "--num-iters",
        type=int,
        default=5,
        help="rounds of (bandwidth, one timed batch-1 decode run); medians are reported (default 5)",
    )
    r.add_argument("--prefill-len", type=int, default=2048, help="prompt tokens of the prefill measurement")
    r.set_defaults(bench_run=run_roofline)
    for sp in (t, lt, r):
        sp.set_defaults(func=_run_offline)


def _run_offline(ns: argparse.Namespace) -> int:
    # lazy: the parser is built for every command; the engine loads for a run only
    from tokenmill.llm import LLM

    llm = LLM(**vars(engine_args_from(ns)))
    wait_for_kv_cache(llm)
    return ns.bench_run(llm, ns)


def wait_for_kv_cache(llm) -> None:
    """Waits until the background thread that faults in the KV cache's pages after start-up is
    done (kernels.memory.populate_in_background: ~10 s for 4 GiB on a 2-core VM): the steps it runs
    beside are slower (it takes a core's time slices from the step's threads), so a measurement
    taken meanwhile is of start-up, not of the engine. Tensor-parallel workers populate their own."""
    thread = getattr(getattr(llm.engine.core, "runner", None), "kv_populate", None)
    if thread is not None and thread.is_alive():
        t0 = time.perf_counter()
        thread.join()
        print(f"waited {time.perf_counter() - t0:.1f} s for the KV cache's pages (start-up) before measuring")
