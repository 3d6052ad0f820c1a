"""W8A8 against bf16 and the weight-only modes: prefill and 32-concurrent speed, and quality, in one table.

    python benchmarks/w8a8.py          # SmolLM2 (the packaged Q4_1 GGUF): bf16 | int8 | int4 | gguf | w8a8 | fp32
    python benchmarks/w8a8.py --repeats 5 --variants bf16,w8a8 --speed-variants bf16,fp32,w8a8,w8a8-fp32

Speed (--speed-variants, against bf16 and fp32), variants interleaved within each repeat, medians: prefill GFLOP/s (the layers' linear
FLOPs, 2 x in x out per token, over the wall time of --prefill-prompts prompts of --prefill-len
tokens, one output token each) and output tok/s of --concurrency requests at once (offline, 256 in
x 128 out). Quality: the 32 chat prompts of benchmarks/variants.py, greedy, against bf16 (identical
outputs, mean / p99 |logprob difference| over the tokens both score in the same context), and the
perplexity of a fixed text (docstrings of Python standard-library modules the w8a8 calibration
set does not contain; they depend on the Python version, which is printed) for every variant and
for float32. Say which machine (lscpu, uptime) next to the figures.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import platform
import statistics
import sys
import time
from unittest import mock

import torch
from quantization import weight_bytes
from variants import agreement, alternating_throughput, chat_outputs, write_result

from tokenmill import LLM, SamplingParams
from tokenmill.bench.offline import wait_for_kv_cache

# name -> (dtype, --quantization[, environment while it loads])
VARIANTS = {
    "bf16": ("bfloat16", None),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
    "gguf": ("bfloat16", "gguf"),
    "w8a8": ("bfloat16", "w8a8"),
    "fp32": ("float32", None),
    "w8a8-fp32": ("float32", "w8a8"),  # w8a8 with float32 activations (norms, attention)
    "w8a8-bf16head": ("bfloat16", "w8a8", {"TOKENMILL_W8A8_LM_HEAD": "0"}),
}  # the lm_head left in bf16
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")
PPL_MODULES = ("argparse", "subprocess", "logging", "json", "csv", "difflib")


def machine() -> str:
    """The CPU's model name and which of the ISA extensions the kernels use it has."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    return f"{name} ({', '.join(f for f in ISA_FLAGS if f in flags) or 'no AVX2'})"


def perplexity_text() -> str:
    import importlib

    docs = (importlib.import_module(m).__doc__ for m in PPL_MODULES)  # a module may have none on some Pythons
    return "\n\n".join(inspect.cleandoc(d) for d in docs if d)


def perplexity(llm: LLM, ids: list[int], segment: int) -> float:
    """exp(mean negative log-likelihood) of every token after the first of each segment."""
    segs = [ids[i : i + segment] for i in range(0, len(ids), segment) if len(ids[i : i + segment]) > 1]
    outs = llm.generate(
        prompt_token_ids=segs, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    nll = [-next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]]
    return math.exp(statistics.mean(nll))


def linear_flops_per_token(llm: LLM) -> int:
    model = llm.engine.core.runner.model
    return 2 * sum(
        m.in_features * m.out_features
        for n, m in model.named_modules()
        if hasattr(m, "in_features") and hasattr(m, "out_features") and n != "lm_head"
    )


def prefill_gflops(llms: dict[str, LLM], prompts: int, length: int, repeats: int) -> dict[str, list[float]]:
    import random

    tok = next(iter(llms.values())).get_tokenizer()
    vocab = [i for i in range(len(tok)) if i not in set(tok.all_special_ids)]
    res: dict[str, list[float]] = {n: [] for n in llms}
    for rep in range(repeats):
        rng = random.Random(1000 + rep)
        batch = [[rng.choice(vocab) for _ in range(length)] for _ in range(prompts)]
        for name, llm in llms.items():
            llm.generate(prompt_token_ids=batch[:1], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
            t0 = time.perf_counter()
            llm.generate(prompt_token_ids=batch, sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
            res[name].append(linear_flops_per_token(llm) * prompts * length / (time.perf_counter() - t0) / 1e9)
            print(f"  prefill repeat {rep + 1} {name:5}: {res[name][-1]:7.1f} GFLOP/s", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--variants", default="bf16,int8,int4,gguf,w8a8,fp32", help="quality table (bf16 always)")
    ap.add_argument("--speed-variants", default="bf16,fp32,w8a8", help="timed (bf16 and fp32 are the baselines)")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per quality prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-prompts", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ppl-segment", type=int, default=512)
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="at most this many tokens of the text")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/w8a8.json")
    args = ap.parse_args(argv)
    names = ["bf16"] + [n for n in args.variants.split(",") if n != "bf16"]
    timed = [] if args.skip_speed else args.speed_variants.split(",")
    names += [n for n in timed if n not in names]
    print(
        f"machine: {machine()}, {os.cpu_count()} cpus, load average "
        f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())}; torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads; Python {platform.python_version()}",
        flush=True,
    )
    llms = {}
    for n in names:
        dtype, quantization, *env = VARIANTS[n]
        with mock.patch.dict(os.environ, env[0] if env else {}):
            llms[n] = LLM(
                args.model, dtype=dtype, quantization=quantization, kv_cache_memory=1.0, enable_prefix_caching=False
            )
    for llm in llms.values():  # timings of the steady state, not of start-up
        wait_for_kv_cache(llm)
    from tokenmill.kernels import cpu_kernels

    kernels = cpu_kernels.load()
    isa = kernels.w8a8_isa() if kernels is not None and hasattr(kernels, "w8a8_isa") else "torch"
    result: dict = {
        "args": vars(args),
        "w8a8_isa": isa,
        "loadavg_start": os.getloadavg(),
        "weight_bytes": {n: weight_bytes(llm) for n, llm in llms.items()},
    }
    outs = {n: chat_outputs(llm, args.max_tokens) for n, llm in llms.items()}
    result["quality_vs_bf16"] = {n: agreement(outs["bf16"], outs[n], args.max_tokens) for n in llms if n != "bf16"}
    write_result(args.out, result)  # each phase's figures are kept if a later one is interrupted
    ids = llms["bf16"].get_tokenizer().encode(perplexity_text())[: args.ppl_tokens]
    result["perplexity_tokens"] = len(ids)
    result["perplexity"] = {n: perplexity(llm, ids, args.ppl_segment) for n, llm in llms.items()}
    write_result(args.out, result)
    speed = {n: llms[n] for n in timed}
    if speed:
        pre = prefill_gflops(speed, args.prefill_prompts, args.prefill_len, args.repeats)
        thr = alternating_throughput(speed, args.concurrency, args.input_len, args.output_len, args.repeats)
        result["prefill_gflop_s"], result["throughput_tok_s"] = pre, thr
        result["median_prefill_gflop_s"] = {n: statistics.median(v) for n, v in pre.items()}
        result["median_throughput_tok_s"] = {n: statistics.median(v) for n, v in thr.items()}
    result["loadavg_end"] = os.getloadavg()
    print(
        f"\nw8a8 kernel path: {isa}; load average at the end "
        f"{' / '.join(f'{x:.2f}' for x in result['loadavg_end'])}; perplexity over {len(ids)} tokens"
    )
    print(
        f"| variant | weights | prefill GFLOP/s (vs bf16, vs fp32) | {args.concurrency}-concurrent tok/s (vs bf16, "
        f"vs fp32) | identical (of 32) | mean / p99 abs logprob diff vs bf16 | perplexity |"
    )
    print("|---|---:|---:|---:|---:|---|---:|")
    wb0 = result["weight_bytes"]["bf16"]
    for n in llms:
        cells = [n, f"{result['weight_bytes'][n] / 1e6:.1f} MB ({result['weight_bytes'][n] / wb0:.2f}x)"]
        for key in ("median_prefill_gflop_s", "median_throughput_tok_s"):
            med = result.get(key, {})
            v = med.get(n)
            ratios = ", ".join(f"{v / med[b]:.2f}x" for b in ("bf16", "fp32") if b in med and b != n)
            cells.append("" if v is None else f"{v:.1f} ({ratios})" if ratios else f"{v:.1f}")
        q = result["quality_vs_bf16"].get(n)
        cells += (
            [f"{q['identical_outputs']}", f"{q['logprob_abs_diff_mean']:.3f} / {q['logprob_abs_diff_p99']:.3f}"]
            if q
            else ["-", "-"]
        )
        cells.append(f"{result['perplexity'][n]:.3f}")
        print("| " + " | ".join(cells) + " |")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
