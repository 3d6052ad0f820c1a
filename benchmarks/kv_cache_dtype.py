"""--kv-cache-dtype int8 / fp8 against the full-precision cache: quality and speed, one run.

    python benchmarks/kv_cache_dtype.py            # SmolLM2 bf16: auto, int8, fp8 caches
    python benchmarks/kv_cache_dtype.py --kv-dtypes auto,fp8 --concurrency 32 --skip-quality

Quality: 32 chat prompts, greedy, 64 tokens, with the sampled tokens' logprobs, each quantized
cache against the model's own dtype. Reports how many outputs are identical, how far they agree
on average, and the |logprob| difference of the same tokens over the common part (both engines
score the same context there).
Speed: offline output throughput on seeded random prompts (--input-len in, --output-len out) at
each --concurrency (1: batch-1 decode; 32: 32 requests at once), the caches alternating, median
of --repeats. Also prints the KV bytes per token.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from variants import (
    add_workload_args,
    agreement,
    alternating_throughput,
    chat_outputs,
    describe_agreement,
    write_result,
)

from tokenmill import LLM


def quality(model: str | None, dtype: str, kv_dtypes: list[str], max_tokens: int) -> dict:
    outs = {}
    for kv in ["auto"] + [k for k in kv_dtypes if k != "auto"]:
        llm = LLM(model, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=1.0, enable_prefix_caching=False)
        outs[kv] = chat_outputs(llm, max_tokens)
        del llm
    return {kv: agreement(outs["auto"], outs[kv], max_tokens) for kv in outs if kv != "auto"}


def speed(
    model: str | None,
    dtype: str,
    kv_dtypes: list[str],
    concurrency: list[int],
    input_len: int,
    output_len: int,
    repeats: int,
) -> dict:
    llms = {
        kv: LLM(model, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=2.0, enable_prefix_caching=False)
        for kv in kv_dtypes
    }
    out = {"kv_bytes_per_token": {kv: llm.engine.config.model.kv_bytes_per_token() for kv, llm in llms.items()}}
    for c in concurrency:
        print(f"concurrency {c}:", flush=True)
        res = alternating_throughput(llms, c, input_len, output_len, repeats)
        out[f"c{c}"] = {"runs": res, "median_tok_s": {kv: statistics.median(v) for kv, v in res.items()}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, "benchmarks/results/kv_cache_dtype.json")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-dtypes", default="auto,int8,fp8", help="comma-separated --kv-cache-dtype values")
    ap.add_argument("--concurrency", default="1,32", help="comma-separated request counts for the speed runs")
    ap.add_argument("--skip-quality", action="store_true")
    args = ap.parse_args(argv)
    kv_dtypes = args.kv_dtypes.split(",")
    result: dict = {"args": vars(args)}
    if not args.skip_quality:
        result["quality"] = quality(args.model, args.dtype, kv_dtypes, args.max_tokens)
        for kv, q in result["quality"].items():
            print(
                f"quality ({args.dtype} model, {kv} vs {args.dtype} cache, {q['prompts']} prompts x "
                f"{q['max_tokens']} greedy tokens): {describe_agreement(q)}",
                flush=True,
            )
    if not args.skip_speed:
        s = result["speed"] = speed(
            args.model,
            args.dtype,
            kv_dtypes,
            [int(c) for c in args.concurrency.split(",")],
            args.input_len,
            args.output_len,
            args.repeats,
        )
        base = kv_dtypes[0]
        for key, r in s.items():
            if key.startswith("c"):
                med = r["median_tok_s"]
                print(
                    f"speed {key} ({args.input_len} in x {args.output_len} out, median of {args.repeats}): "
                    + ", ".join(f"{kv} {med[kv]:.1f} tok/s ({med[kv] / med[base]:.2f}x)" for kv in kv_dtypes)
                )
        kvb = s["kv_bytes_per_token"]
        print("KV bytes/token: " + ", ".join(f"{kv} {kvb[kv]} ({kvb[kv] / kvb[base]:.2f}x)" for kv in kv_dtypes))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
