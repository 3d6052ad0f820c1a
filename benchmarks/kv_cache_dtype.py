"""--kv-cache-dtype int8 against the full-precision cache: quality and speed, one run.

    python benchmarks/kv_cache_dtype.py            # SmolLM2 bf16: 32 prompts for quality, 64x256x128 for speed

Quality: 32 chat prompts, greedy, 64 tokens, with the sampled tokens' logprobs. Reports how many
outputs are identical, how far they agree on average, and the |logprob| difference of the
same tokens over the common part (both engines score the same context there).
Speed: offline output throughput on seeded random prompts, the two caches alternating,
median of --repeats. Also prints the KV bytes per token and the tokens a budget holds.
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


def quality(model: str | None, dtype: str, max_tokens: int) -> dict:
    outs = {}
    for kv in ("auto", "int8"):
        llm = LLM(model, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=1.0, enable_prefix_caching=False)
        outs[kv] = chat_outputs(llm, max_tokens)
        del llm
    return agreement(outs["auto"], outs["int8"], max_tokens)


def speed(model: str | None, dtype: str, num_prompts: int, input_len: int, output_len: int, repeats: int) -> dict:
    llms = {kv: LLM(model, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=2.0, enable_prefix_caching=False)
            for kv in ("auto", "int8")}
    res = alternating_throughput(llms, num_prompts, input_len, output_len, repeats)
    kvb = {kv: llm.engine.config.model.kv_bytes_per_token() for kv, llm in llms.items()}
    med = {kv: statistics.median(v) for kv, v in res.items()}
    return {"runs": res, "median_tok_s": med, "int8_over_auto": med["int8"] / med["auto"],
            "kv_bytes_per_token": kvb, "int8_memory_ratio": kvb["int8"] / kvb["auto"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, "benchmarks/results/kv_cache_dtype.json")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    result = {"args": vars(args), "quality": quality(args.model, args.dtype, args.max_tokens)}
    q = result["quality"]
    print(f"quality ({args.dtype} model, int8 vs {args.dtype} cache, {q['prompts']} prompts x {q['max_tokens']} "
          f"greedy tokens): {describe_agreement(q)}", flush=True)
    if not args.skip_speed:
        s = result["speed"] = speed(args.model, args.dtype, args.num_prompts, args.input_len, args.output_len,
                                    args.repeats)
        print(f"speed ({args.num_prompts} x {args.input_len} in x {args.output_len} out, median of {args.repeats}): "
              f"{args.dtype} cache {s['median_tok_s']['auto']:.1f} tok/s, int8 cache {s['median_tok_s']['int8']:.1f} "
              f"tok/s ({s['int8_over_auto']:.2f}x); KV bytes/token {s['kv_bytes_per_token']['auto']} -> "
              f"{s['kv_bytes_per_token']['int8']} ({s['int8_memory_ratio']:.2f}x)")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
